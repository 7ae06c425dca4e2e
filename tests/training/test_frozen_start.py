"""Starting from another run (the frozen-baseline reranker): exact partial restore, frozen parameters
bitwise unchanged with no optimizer state, the cumulative step axis and a fresh schedule, bad init runs."""

import json

import jax
import numpy as np
import pytest
from flax import nnx

from configs import baseline, memory, reranker_frozen
from dspark_jax import sharding
from dspark_jax.errors import UsageError
from dspark_jax.run import draft_state
from dspark_jax.run import optimizer as optimizer_lib
from dspark_jax.target import TargetConfig
from dspark_jax.training.loop import train


def _smoke(module, cache_dir, **keys):
    config = module.get_config("smoke")
    config.data.cache_dir = cache_dir
    config.mesh.fsdp = 1
    for name, value in keys.items():
        section, key = name.split(".")
        config[section][key] = value
    return config


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("frozen")
    cache_dir = str(root / "caches")
    base_dir = root / "baseline"
    train(_smoke(baseline, cache_dir), base_dir)
    frozen = _smoke(reranker_frozen, cache_dir, **{"init.checkpoint": str(base_dir)})
    train(frozen, root / "frozen")
    return cache_dir, base_dir, root / "frozen", frozen


def _params(config, workdir):
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1})
    target = TargetConfig.from_json(config.target.arch.to_dict())
    return draft_state.restore_draft(config, target, mesh, workdir)[1]


@pytest.mark.slow
def test_frozen_parameters_are_bitwise_unchanged_and_only_the_reranker_learns(runs):
    cache_dir, base_dir, frozen_dir, frozen = runs
    before = dict(nnx.to_flat_state(_params(_smoke(baseline, cache_dir), base_dir)))
    after = dict(nnx.to_flat_state(_params(frozen, frozen_dir)))
    assert set(after) - set(before) == {p for p in after if p[0] == "reranker"}
    for path, value in before.items():
        np.testing.assert_array_equal(
            np.asarray(after[path].get_value()), np.asarray(value.get_value()), str(path)
        )
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1})
    target = TargetConfig.from_json(frozen.target.arch.to_dict())
    _, fresh, _ = draft_state.init_draft(frozen, target, mesh)
    moved = [
        p
        for p, v in nnx.to_flat_state(fresh)
        if p[0] == "reranker" and not np.array_equal(v.get_value(), after[p].get_value())
    ]
    assert moved  # the reranker trained


def test_optimizer_state_exists_only_for_the_reranker(runs):
    _, _, _, frozen = runs
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1})
    target = TargetConfig.from_json(frozen.target.arch.to_dict())
    _, params, _ = draft_state.init_draft(frozen, target, mesh)
    _, optimizer = optimizer_lib.make_training_optimizer(frozen, params)
    state = jax.eval_shape(optimizer.init, params)
    sizes = sum(x.size for x in jax.tree.leaves(state) if x.ndim)
    reranker = sum(x.size for x in jax.tree.leaves(params["reranker"]))
    assert sizes == 2 * reranker  # Adam's two moments, for the reranker's parameters only


def test_steps_are_cumulative_and_the_schedule_starts_at_zero(runs):
    _, _, frozen_dir, frozen = runs
    lines = [json.loads(line) for line in (frozen_dir / "metrics.jsonl").read_text().splitlines()]
    train_lines = [line for line in lines if "train/loss" in line]
    assert [line["step"] for line in train_lines] == list(range(7, 13))
    assert [line["train/new_steps"] for line in train_lines] == list(range(1, 7))
    schedule, _ = optimizer_lib.make_training_optimizer(frozen)
    assert train_lines[0]["train/learning_rate"] == pytest.approx(float(schedule(0)))
    assert float(schedule(0)) != float(schedule(6))  # the continued schedule would be elsewhere
    assert [line["step"] for line in lines if "eval/tau_prob" in line] == [9, 12]
    summary = json.loads((frozen_dir / "summary.json").read_text())
    assert summary["step"] == 6 and summary["pretrained_steps"] == 6


def test_bad_init_runs_are_refused(runs, tmp_path):
    cache_dir, base_dir, _, _ = runs
    with pytest.raises(UsageError, match=r"config\.init\.checkpoint: checkpoint path not found"):
        draft_state.init_source(
            _smoke(reranker_frozen, cache_dir, **{"init.checkpoint": str(tmp_path / "none")})
        )
    with pytest.raises(UsageError, match=r"config.init.step=5: .* holds steps \[3, 6\]"):
        draft_state.init_source(
            _smoke(reranker_frozen, cache_dir, **{"init.checkpoint": str(base_dir), "init.step": 5})
        )
    other_shape = _smoke(
        reranker_frozen, cache_dir, **{"init.checkpoint": str(base_dir), "draft.num_heads": 8}
    )
    with pytest.raises(UsageError, match=r"disagrees with the config stored in .* on draft\.num_heads"):
        draft_state.init_source(other_shape)
    memory_dir = tmp_path / "memory"
    train(_smoke(memory, cache_dir, **{"train.stop_step": 3}), memory_dir)
    with pytest.raises(UsageError, match="is a 'memory' run; reranker_frozen starts from a 'baseline' one"):
        draft_state.init_source(
            _smoke(reranker_frozen, cache_dir, **{"init.checkpoint": str(memory_dir), "init.step": 3})
        )
