"""Training with a draft vocabulary (`train.draft_vocab = K`): every group trains with its draft's logits
over the training responses' `K` most used tokens, evaluates and decodes from them losslessly, and bad
sizes are refused before any cache is built."""

import json

import jax
import numpy as np
import pytest

from dspark_jax import sharding
from dspark_jax.data.conversations import GSM8K_VAL256, read_turns_jsonl
from dspark_jax.errors import UsageError
from dspark_jax.run import checkpoints, target_side
from dspark_jax.suite import measure, plan
from dspark_jax.target import target_from_config
from dspark_jax.training import aot
from dspark_jax.training.evaluation import evaluate_checkpoint
from dspark_jax.training.loop import train
from dspark_jax.training.summary import SUMMARY_FILE
from tests.marks import tiered

SIZE = 256  # of the smoke target's 49,152 ids: the smoke responses use fewer, so the rest is ranked by id
SEED_GROUPS = {g.name: g for g in plan.suites()["seed"]}
FAST_GROUPS = ("baseline", "memory")  # plain, two-stage (its stage-1 greedy choices are vocabulary ids)


def _config(root, name):
    group = SEED_GROUPS[name]
    overrides = [f"data.cache_dir={root / 'caches'}", "mesh.fsdp=1", f"train.draft_vocab={SIZE}"]
    return plan.group_config(group, "smoke", overrides)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """`group name -> (config, work directory)`, trained on first use on one shared smoke cache."""
    root = tmp_path_factory.mktemp("draft_vocab_runs")
    done = {}

    def run(name):
        if name not in done:
            config = _config(root, name)
            if SEED_GROUPS[name].starts_from:
                config.init.checkpoint = str(run(SEED_GROUPS[name].starts_from)[1])
                config.init.step = config.train.stop_step
            train(config, root / name)
            done[name] = config, root / name
        return done[name]

    return run


@pytest.mark.parametrize("name", tiered(list(SEED_GROUPS), fast=FAST_GROUPS, slow=["reranker_joint"]))
def test_every_group_trains_evaluates_and_decodes_losslessly_over_a_draft_vocabulary(runs, name):
    config, workdir = runs(name)
    summary = json.loads((workdir / SUMMARY_FILE).read_text())
    assert checkpoints.run_config(workdir).train.draft_vocab == SIZE  # stored with the run
    offline = evaluate_checkpoint(checkpoints.run_config(workdir), workdir)
    assert offline["tau_prob"] == pytest.approx(summary["final_eval"]["tau_prob"], rel=1e-5)

    mesh = sharding.make_mesh(config.mesh.to_dict())
    target = target_from_config(config.target, seed=config.seed, mesh=mesh)
    settings = measure.DecodeSettings(max_new_tokens=12, concurrency=2)
    decoder, step = measure.speculative_decoder(config, workdir, target, mesh, settings)
    side = target_side.side_from_target(target, mesh)
    want = target_side.training_vocabulary(config, side, SIZE)
    assert decoder.draft_vocab_size == len(want) >= SIZE  # the training vocabulary by default, EOS in it
    np.testing.assert_array_equal(jax.device_get(decoder.frozen.draft_vocab.ids_K), want)
    result = measure.speculate(
        decoder,
        step,
        config,
        target,
        read_turns_jsonl(GSM8K_VAL256)[:4],
        settings,
        input_name="gsm8k",
        time_phases=False,
    )
    assert result["identical_to_target_greedy"] == "4/4"


def test_the_compiled_memory_check_places_the_draft_vocabulary(tmp_path):
    config = _config(tmp_path, "baseline")
    report = aot.step_memory(config, micro_batch=1)
    arch = config.target.arch
    itemsize = np.dtype(config.target.param_dtype).itemsize
    head = arch.vocab_size * arch.hidden_size * itemsize  # the embedding and the LM head: each [V, H]
    assert report["per_device_bytes"]["frozen_target"] == 2 * head + SIZE * (arch.hidden_size * itemsize + 4)


@pytest.mark.parametrize("size", [-1, 49153])
def test_bad_draft_vocabularies_are_refused_before_any_cache(tmp_path, size):
    config = plan.group_config(SEED_GROUPS["baseline"], "smoke", [f"data.cache_dir={tmp_path / 'caches'}"])
    with config.unlocked():
        config.train.draft_vocab = size
    with pytest.raises(
        UsageError, match=rf"^train.draft_vocab={size} must be an integer in 0..49152"
    ) as error:
        train(config, tmp_path / "run")
    assert "\n" not in str(error.value)
    assert not (tmp_path / "caches").exists()
