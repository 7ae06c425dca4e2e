"""Stored work of the layout before the run/groups/cli/training redesign (2026-12-01) still loads: a
checkpoint restores under its stored config and evaluates on a cache of that layout to the metrics that
code measured (`tests/data/layout_2026_12_01/README.md` says how they were made)."""

import json
import shutil
from pathlib import Path

import pytest

from dspark_jax import cache
from dspark_jax.run import checkpoints
from dspark_jax.training.evaluation import evaluate_checkpoint

FIXTURE = Path(__file__).parent / "data" / "layout_2026_12_01"


def test_a_checkpoint_and_a_cache_of_the_previous_layout_evaluate_to_that_code_s_metrics(tmp_path):
    shutil.copytree(FIXTURE / "checkpoints", tmp_path / "checkpoints")  # orbax may write beside it
    val_cache = str(FIXTURE / "val_cache")
    assert cache.verify(val_cache) == 4  # every checksum of the old manifest holds
    config = checkpoints.run_config(tmp_path)
    assert checkpoints.checkpoint_step(tmp_path) == 1 and config.experiment == "baseline"
    with config.unlocked():
        config.data.val_cache = config.data.train_cache = val_cache
    got = evaluate_checkpoint(config, tmp_path)
    want = json.loads((FIXTURE / "expected_eval.json").read_text())
    assert set(want) <= set(got)
    for key, value in want.items():
        assert float(got[key]) == pytest.approx(value, rel=1e-6, abs=1e-7), key
