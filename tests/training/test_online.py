"""Online training (`data.features = "online"`): the step that runs the frozen target over its token rows
equals the offline step that reads the same rows' states from the cache."""

import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from ml_collections import config_dict

from configs import base, baseline
from dspark_jax import groups, sharding
from dspark_jax.data.batch import STATE_FIELDS
from dspark_jax.data.pipeline import make_iterator, to_global
from dspark_jax.draft.model import FrozenTarget
from dspark_jax.errors import UsageError
from dspark_jax.run import checkpoints, config_lib, draft_state, online, sources, target_side
from dspark_jax.run import optimizer as optimizer_lib
from dspark_jax.suite import plan
from dspark_jax.target import TargetConfig, random_target
from dspark_jax.training import evaluation
from dspark_jax.training import step as step_lib
from dspark_jax.training.loop import forward_seconds, split_micro_batches, train
from dspark_jax.training.summary import SUMMARY_FILE, human_summary
from tests import bf16
from tests.marks import EXTENDED, tiered

# The demo preset (SmolLM2-135M, packed rows of 1,024 tokens) on a few short conversations.
DEMO_DATA = dict(train_limit=6, val_limit=2, regen_max_new_tokens=48, regen_batch_size=8)


def _config(cache_dir, pack, preset="smoke", **data):
    hybrid = preset == "smoke-hybrid"
    config = draft_state.random_init(baseline.get_config("smoke" if hybrid else preset))
    if hybrid:
        config.target.arch = config_dict.ConfigDict(base.SMOKE_HYBRID_TARGET)
    config.data.cache_dir = str(cache_dir)
    config.data.pack = pack
    config.mesh.fsdp = 1
    for key, value in data.items():
        config.data[key] = value
    return config


def _mesh():
    return sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1})


def _step(config, side, params, rest, batch, mesh):
    """One optimizer step's sums, metrics and gradient norm on `batch` (its micro-batches accumulated)."""
    experiment = groups.get(config.experiment)
    graphdef = draft_state.init_draft(config, side.config, mesh)[0]
    micro = jax.jit(
        functools.partial(
            step_lib.micro_step, graphdef=graphdef, experiment=experiment, features=side.features
        )
    )
    rules = config_lib.sharding_rules(config)
    grads = sums = None
    for micro_batch in split_micro_batches(batch, config.train.grad_accum):
        if side.features is not None:
            micro_batch = {k: v for k, v in micro_batch.items() if k not in STATE_FIELDS}
        g, s = micro(params, rest, side.frozen, to_global(micro_batch, mesh, rules))
        grads, sums = (
            (g, s) if grads is None else (step_lib.accumulate(grads, g), step_lib.accumulate(sums, s))
        )
    _, optimizer = optimizer_lib.make_training_optimizer(config, params)
    opt_state = optimizer.init(params)
    _, _, grad_norm = step_lib.apply_step(
        params, opt_state, grads, sums, optimizer=optimizer, experiment=experiment
    )
    metrics = jax.device_get(experiment.model.metrics(sums))
    return {k: float(v) for k, v in metrics.items()} | {"grad_norm": float(grad_norm)}


def _compare(cache_dir, pack, steps=3, preset="smoke", same_forward=False, **data):
    """Metrics of the offline and the online step on the same pipeline batches, for `steps` batches.

    `same_forward`: the offline step reads the states the online step's own forward computes over the
    batch's rows (its shapes, its bf16 rounding) instead of the cache's."""
    mesh = _mesh()
    offline_config = _config(cache_dir, pack, preset, **data)
    online_config = _config(cache_dir, pack, preset, **data)
    online_config.data.features = "online"
    with sharding.activation_sharding(mesh, config_lib.sharding_rules(offline_config)):
        offline_side, paths = target_side.prepare_target_side(offline_config, mesh)
        online_side = target_side.with_online_target(
            online_config, offline_side, target_side.load_run_target(online_config, mesh)
        )
        _, params, rest = draft_state.init_draft(offline_config, offline_side.config, mesh)
        source = sources.open_source(paths["train"], offline_config, offline_side)
        t = offline_config.train
        batches = make_iterator(
            source,
            sources.pipeline_config(
                offline_config, offline_side, batch_size=t.global_batch, seed=0, num_epochs=None
            ),
        )
        forward = jax.jit(online_side.features)
        pairs = []
        for _ in range(steps):
            batch = next(batches)
            if same_forward:
                rows = {k: v for k, v in batch.items() if k not in STATE_FIELDS}
                states = forward(
                    online_side.frozen, to_global(rows, mesh, config_lib.sharding_rules(offline_config))
                )
                batch = rows | {k: np.asarray(states[k]) for k in STATE_FIELDS}
            pairs.append(
                (
                    _step(offline_config, offline_side, params, rest, batch, mesh),
                    _step(online_config, online_side, params, rest, batch, mesh),
                )
            )
    return pairs


@pytest.mark.parametrize(
    "preset, pack, data, rel, abs_",
    [
        ("smoke", False, {}, 1e-6, 1e-9),
        ("smoke", True, {}, 1e-6, 1e-9),
        # Extended: the chunked feature pass's states equal the whole one's (the chunks test below).
        pytest.param("smoke", True, {"online_chunks": 2}, 1e-6, 1e-9, marks=EXTENDED),
        ("smoke-hybrid", True, {}, 1e-5, 1e-9),
        pytest.param("demo", True, DEMO_DATA, 1e-4, 1e-8, marks=pytest.mark.slow),
        pytest.param("demo", True, DEMO_DATA | {"same_forward": True}, 1e-6, 1e-9, marks=EXTENDED),
    ],
    ids=[
        "smoke-rows",
        "smoke-packed",
        "smoke-packed-2-chunks",
        "smoke-hybrid-packed",
        "demo-packed",
        "demo-packed-same-forward",
    ],
)
def test_online_step_equals_the_offline_step_on_the_same_batches(
    tmp_path_factory, preset, pack, data, rel, abs_
):
    """Loss, every logged metric and the gradient norm: the same target forward as the cache builder's,
    rounded to bf16 as the cache stores it. On the smoke target the states are bitwise those of the cache
    (equal to 1e-6, in practice to the last bit). On a tiny Qwen3-Next-shaped target with packed rows the
    Gated DeltaNet layers restart at each sample, as the builder's per-sample forward starts, but the
    packed row cuts a sample into other 64-token chunks than its forward alone does, so the recurrence
    sums in another order: metrics within 3e-7, the gradient norm within 1.5e-6 (measured on 4 layers; with
    the fifth, a Gated DeltaNet layer after the aux layers, `l1` moved by 3.9e-6: the test holds 1e-5). On
    SmolLM2-135M (demo) XLA's float32 sums run in another order for the online batch's shape (packed rows of
    1,024) than for the builder's (its own packed rows, as wide as their longest sample's power of two),
    which moves about 0.2% of the state elements by one bf16 step: metrics of a size differ by up to 5.6e-5
    relative (`accept_rate_0`; `results/online-2026-12-03/README.md`), as two offline caches built with
    other batch shapes do (`tests/cache/test_build.py`); the test holds 1e-4. The untrained draft's later
    accept rates are products of tiny probabilities (~7e-6) that differ by up to 1.1e-9 absolute (1.5e-4
    relative, `accept_rate_3`, 2026-12-05): they are held to 1e-8 absolute.
    With the states of one forward for both (`same_forward`: the offline
    step reads what the online step's forward computes over the same packed rows, rounded to bf16 alike)
    the demo case holds 1e-6: the steps differ only in where their states come from. The target's forward
    in two pieces (`data.online_chunks=2`) reads the same states."""
    pairs = _compare(tmp_path_factory.mktemp("caches"), pack, preset=preset, **data)
    for offline_metrics, online_metrics in pairs:
        assert set(online_metrics) == set(offline_metrics)
        for name, want in offline_metrics.items():
            assert online_metrics[name] == pytest.approx(want, rel=rel, abs=abs_), name


def test_full_precision_states_differ_from_the_offline_step_by_the_bf16_rounding(tmp_path_factory):
    """`data.online_dtype=float32` keeps the target's states unrounded: the step then differs from the
    offline one (whose states are bf16) by about the bf16 rounding's effect, well above 1e-6."""
    for offline_metrics, online_metrics in _compare(
        tmp_path_factory.mktemp("caches"), False, online_dtype="float32"
    ):
        rel = {
            name: abs(online_metrics[name] - want) / max(abs(want), 1e-12)
            for name, want in offline_metrics.items()
        }
        print("float32 states: relative difference from offline", rel)
        assert max(rel["grad_norm"], rel["loss"]) > 1e-5 and max(rel.values()) < 1e-2, rel


SEED_GROUPS = {g.name: g for g in plan.suites()["seed"]}
FAST_GROUPS = ("baseline", "memory", "engram_mask_gated")  # plain, two-stage, side inputs


@pytest.fixture(scope="module")
def online_runs(tmp_path_factory):
    """`group name -> its online smoke run's work directory`, trained on first use (a group that starts
    from another trains after it), on one shared token cache."""
    root = tmp_path_factory.mktemp("online_runs")
    done: dict[str, object] = {}

    def run(name):
        if name not in done:
            group = SEED_GROUPS[name]
            overrides = ["data.features=online", f"data.cache_dir={root / 'caches'}", "mesh.fsdp=1"]
            config = plan.group_config(group, "smoke", overrides)
            if group.starts_from:
                config.init.checkpoint = str(run(group.starts_from))
                config.init.step = config.train.stop_step
            train(config, root / name)
            done[name] = root / name
        return done[name]

    return run


@pytest.mark.parametrize("name", tiered(list(SEED_GROUPS), fast=FAST_GROUPS, slow=list(SEED_GROUPS)))
def test_every_groups_smoke_run_trains_online(online_runs, name):
    workdir = online_runs(name)
    summary = json.loads((workdir / SUMMARY_FILE).read_text())
    assert summary["features"]["mode"] == "online", summary
    assert summary["features"]["target_seconds_per_step"] > 0, summary
    cache_names = sorted(p.name.split("-")[0] for p in (workdir.parent / "caches").glob("*/*_*"))
    assert "train_tokens" in cache_names and "train_cache" not in cache_names, cache_names
    if name == "baseline":  # `evaluate` of the checkpoint: the stored online config, the target in its step
        assert "features: online, a step " in human_summary(summary, "baseline:smoke")
        metrics = evaluation.evaluate_checkpoint(checkpoints.run_config(workdir), workdir)
        assert metrics["tau_prob"] == pytest.approx(summary["final_eval"]["tau_prob"], rel=1e-5)


def test_a_target_that_does_not_fit_next_to_the_draft_is_refused_before_compiling(tmp_path, monkeypatch):
    """One line naming the bytes and the mesh axes that would shard them, before any cache, weight read
    or compile (a device of 1 MB stands in for a too small accelerator)."""
    monkeypatch.setattr(target_side, "device_memory_bytes", lambda mesh: 1_000_000)
    config = _config(tmp_path / "caches", False, features="online")
    with pytest.raises(UsageError) as error:
        train(config, tmp_path / "run")
    message = str(error.value)
    assert "\n" not in message
    assert (
        "one device needs" in message and "has 0.00 GB (mesh.data=1, mesh.fsdp=1, mesh.tensor=1)" in message
    )
    assert "mesh.fsdp" in message and "data.features=offline" in message
    assert not (tmp_path / "caches").exists() and not (tmp_path / "run" / "checkpoints").exists()
    monkeypatch.setattr(target_side, "device_memory_bytes", lambda mesh: 10**12)
    target_side.check_online_fits(config, TargetConfig.from_json(config.target.arch.to_dict()), _mesh())


def test_the_target_forward_in_chunks_keeps_one_chunks_activations_live(mesh1):
    """`data.online_chunks=4`: the feature pass compiled alone (8 rows of 256 tokens, the hybrid smoke target)
    holds about a quarter of the temporaries of the whole micro-batch's forward (its outputs, the states,
    are whole either way), and writes the same states but for XLA's sum order at the other batch shape: a
    few elements in 10,000 one bf16 step apart, as the demo's online and offline states are."""
    config = _config("", pack=True, preset="smoke-hybrid")
    cfg = TargetConfig.from_json(config.target.arch.to_dict())
    model = random_target(config.target.arch.to_dict(), seed=0, mesh=mesh1).model
    frozen = FrozenTarget(None, None, target_state=nnx.state(model))
    rows, t = 8, config.data.max_length
    positions = jnp.tile(jnp.concatenate([jnp.arange(100), jnp.arange(t - 100)]), (rows, 1))
    batch = {
        "input_ids": jax.random.randint(jax.random.key(0), (rows, t), 3, cfg.vocab_size),
        "positions": positions,
    }
    temporaries, states = {}, {}
    for chunks in (1, 4):
        config.data.online_chunks = chunks
        feature_pass = jax.jit(online.online_features(config, model))
        temporaries[chunks] = feature_pass.lower(frozen, batch).compile().memory_analysis().temp_size_in_bytes
        states[chunks] = feature_pass(frozen, batch)
    print("feature pass temporaries, 1 chunk / 4 chunks:", temporaries)
    assert temporaries[4] < 0.4 * temporaries[1]
    for name in STATE_FIELDS:
        got, want = (np.asarray(x[name], np.float32) for x in (states[4], states[1]))
        steps, large = bf16.steps(got, want), np.abs(want) > 0.01 * np.abs(want).max()
        print(name, "elements that differ:", np.mean(steps > 0), "bf16 steps apart:", np.unique(steps))
        # One step at most where a state is not tiny (near 0 a float32 difference spans many bf16 steps).
        assert np.mean(steps > 0) < 1e-3 and steps[large].max() <= 1, name


def test_the_targets_share_of_a_step_is_the_median_of_its_timed_forwards():
    """One slow forward (a busy host) does not set `target_seconds_per_step`: of five timed runs after the
    compiling one, the first sleeps 0.5 s and the others 0.01 s."""
    delays = iter([0.0, 0.5, 0.01, 0.01, 0.01, 0.01])

    def sleep(x):
        time.sleep(next(delays))
        return x

    def features(frozen, micro_batch):
        return jax.pure_callback(sleep, jax.ShapeDtypeStruct((), jnp.float32), micro_batch + frozen)

    seconds = forward_seconds(features, jnp.float32(0), jnp.float32(1))
    assert 0.01 <= seconds < 0.1, seconds
