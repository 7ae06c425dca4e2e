"""The training loop end to end on the smoke preset: resume exactness, errors, NaN stop."""

import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import pytest

from configs import baseline
from dspark_jax import sharding
from dspark_jax.run import config_lib, sources, target_side
from dspark_jax.run.checkpoints import Checkpointer
from dspark_jax.training import loop
from dspark_jax.training.loop import NonFiniteLossError, train
from dspark_jax.training.summary import SUMMARY_FILE

ROOT = Path(__file__).resolve().parents[2]
TIMING = ("train/step_seconds", "train/tokens_per_second", "train/wall_minutes", "eval/wall_minutes")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("smoke_caches"))


def _config(cache_dir, features="offline", **train):
    config = baseline.get_config("smoke")
    config.data.cache_dir = cache_dir
    config.data.features = features
    config.mesh.fsdp = 1
    for key, value in train.items():
        setattr(config.train, key, value)
    return config


def logged_metrics(workdir):
    lines = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in line.items() if k not in TIMING} for line in lines]


def _params(workdir, step):
    restored = ocp.StandardCheckpointer().restore(workdir / "checkpoints" / str(step) / "state")
    return restored["params"]


SETTINGS = dict(total_steps=8, stop_step=8, checkpoint_every=2, eval_every=4, log_every=1)


def train_command(workdir, cache_dir, settings, *extra) -> list[str]:
    """`python -m dspark_jax.train` of the smoke preset with `settings` as `--config.train.*` overrides."""
    overrides = [f"--config.train.{k}={v}" for k, v in settings.items()]
    return [
        sys.executable,
        "-m",
        "dspark_jax.train",
        f"--config={ROOT}/configs/baseline.py:smoke",
        f"--workdir={workdir}",
        f"--config.data.cache_dir={cache_dir}",
        *extra,
        *overrides,
    ]


def _start_subprocess(cache_dir, workdir, features="offline"):
    cmd = train_command(
        workdir, cache_dir, SETTINGS, "--config.mesh.fsdp=1", f"--config.data.features={features}"
    )
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _wait_for(path, proc, timeout=300):
    deadline = time.time() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def assert_resumed(workdir, saved_steps, stop_step=SETTINGS["stop_step"]):
    """The last process in `workdir` started from its latest checkpoint before the kill (one of
    `saved_steps`, at least step 2) and computed only the steps after it: a run that ignored the
    checkpoint and retrained from step 0 reproduces the same numbers, but not this record."""
    summary = json.loads((workdir / SUMMARY_FILE).read_text())
    resumed = summary["resumed_from_step"]
    assert resumed == max(saved_steps) >= 2, (summary, saved_steps)
    assert summary["steps_computed"] == stop_step - resumed, summary
    return resumed


def saved_steps(workdir):
    return [int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()]


@pytest.mark.slow
@pytest.mark.parametrize("features", ["offline", "online"])
def test_killed_run_resumes_to_the_uninterrupted_result(cache_dir, tmp_path, monkeypatch, features):
    """kill -9 mid-run, then a resume: the metrics and parameters of the uninterrupted run, bit for bit
    (online: the target runs in the step, over the token cache)."""
    full, killed = tmp_path / "full", tmp_path / "killed"
    train(_config(cache_dir, features, **SETTINGS), full)
    assert json.loads((full / SUMMARY_FILE).read_text())["resumed_from_step"] == 0
    proc = _start_subprocess(cache_dir, killed, features)
    _wait_for(killed / "checkpoints" / "2", proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (killed / "checkpoints" / "8").exists(), "the run finished before it could be killed"
    before_resume = saved_steps(killed)
    # Counted independently of the summary: the optimizer steps the resumed process runs (one host
    # batch split per step).
    steps = []
    split = loop.split_micro_batches
    monkeypatch.setattr(loop, "split_micro_batches", lambda *a: steps.append(1) or split(*a))
    train(_config(cache_dir, features, **SETTINGS), killed)
    resumed = assert_resumed(killed, before_resume)
    assert len(steps) == SETTINGS["stop_step"] - resumed
    assert logged_metrics(killed) == logged_metrics(full)
    assert [m["step"] for m in logged_metrics(full) if "train/loss" in m] == list(range(1, 9))
    a, b = ocp.tree.to_flat_dict(_params(full, 8)), ocp.tree.to_flat_dict(_params(killed, 8))
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]), err_msg=str(key))


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_before_exit(cache_dir, tmp_path):
    proc = _start_subprocess(cache_dir, tmp_path)
    _wait_for(tmp_path / "checkpoints" / "2", proc)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=300)
    steps = sorted(saved_steps(tmp_path))
    assert proc.returncode == 75, stderr[-3000:]  # not 0: the run did not finish
    assert f"preempted at step {steps[-1]}: checkpoint saved" in stderr
    logged = [m["step"] for m in logged_metrics(tmp_path) if "train/loss" in m]
    assert steps[-1] == logged[-1] >= 2  # the step it stopped at is saved, nothing later was logged


def test_nonfinite_loss_stops_naming_the_step(cache_dir, tmp_path):
    config = _config(
        cache_dir,
        stop_step=4,
        total_steps=4,
        peak_lr=1e30,
        warmup_fraction=0.0,
        clip_norm=None,
        checkpoint_every=4,
        eval_every=0,
    )
    with pytest.raises(NonFiniteLossError, match=r"at step [2-4]"):
        train(config, tmp_path)
    assert not (tmp_path / "checkpoints" / "4").exists()


@pytest.mark.slow
def test_resume_with_other_training_settings_is_refused(cache_dir, tmp_path):
    train(_config(cache_dir, stop_step=2, total_steps=4, eval_every=0), tmp_path)
    with pytest.raises(
        config_lib.UsageError, match=r"train\.peak_lr \(run 0\.0003, now 0\.001\).*--allow_changed"
    ):
        train(_config(cache_dir, stop_step=4, total_steps=4, eval_every=0, peak_lr=1e-3), tmp_path)
    with pytest.raises(config_lib.UsageError, match=r"train\.total_steps"):
        train(_config(cache_dir, stop_step=4, total_steps=8, eval_every=0), tmp_path)
    trained = lambda: [m["step"] for m in logged_metrics(tmp_path) if "train/loss" in m]
    assert trained() == [1, 2]  # nothing ran
    # stop_step may change; another key only when named explicitly.
    train(_config(cache_dir, stop_step=3, total_steps=4, eval_every=0), tmp_path)
    config = _config(cache_dir, stop_step=4, total_steps=4, eval_every=0, peak_lr=1e-3)
    train(config, tmp_path, allow_changed=["train.peak_lr"])
    assert trained() == [1, 2, 3, 4]


@pytest.mark.slow
def test_a_kill_right_after_a_save_keeps_that_steps_eval(cache_dir, tmp_path, monkeypatch):
    """The eval line of a checkpoint step is written before the checkpoint: a kill after the save loses
    nothing, and the resumed run does not log it twice."""

    class Killed(BaseException):
        """The process dying right after the save."""

    original = Checkpointer.save

    def save_then_die(self, step, *args, **kwargs):
        saved = original(self, step, *args, **kwargs)
        if step == 2:
            raise Killed
        return saved

    settings = dict(stop_step=4, total_steps=4, checkpoint_every=2, eval_every=2)
    monkeypatch.setattr(Checkpointer, "save", save_then_die)
    with pytest.raises(Killed):
        train(_config(cache_dir, **settings), tmp_path)
    monkeypatch.setattr(Checkpointer, "save", original)
    train(_config(cache_dir, **settings), tmp_path)
    evals = [m["step"] for m in logged_metrics(tmp_path) if "eval/tau_prob" in m]
    assert evals == [2, 4]


def test_config_errors_name_the_key(cache_dir, tmp_path):
    with pytest.raises(ValueError, match=r"train\.grad_accum=3"):
        train(_config(cache_dir, global_batch=2, grad_accum=3), tmp_path)
    with pytest.raises(ValueError, match=r"train\.stop_step=9"):
        train(_config(cache_dir, stop_step=9, total_steps=6), tmp_path)
    with pytest.raises(AttributeError, match="no_such_key"):
        _config(cache_dir).train.no_such_key = 1


def test_aux_layers_mismatching_the_cache_fail_clearly(cache_dir):
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1})
    side, paths = target_side.prepare_target_side(
        _config(cache_dir), mesh
    )  # builds the smoke caches if needed
    config = _config(cache_dir)
    config.data.aux_layer_ids = (0, 1, 2)
    with pytest.raises(ValueError, match="aux_layer_ids"):
        sources.open_source(paths["train"], config, side)


@pytest.mark.parametrize("every", [False, True])
def test_the_ablations_are_measured_at_the_last_evaluation_or_every_one(cache_dir, tmp_path, every):
    """tau_prob without the target context (and its paired gain) at the run's last evaluation; at every one
    with `train.ablate_every_eval`."""
    config = _config(cache_dir, stop_step=4, total_steps=4, eval_every=2)
    config.train.ablate_every_eval = every
    train(config, tmp_path)
    evals = {m["step"]: m for m in logged_metrics(tmp_path) if "eval/tau_prob" in m}
    assert sorted(evals) == [2, 4]
    assert ("eval/tau_prob_without_context" in evals[2]) == every
    last = evals[4]
    assert last["eval/context_gain_low95"] <= last["eval/context_gain"] <= last["eval/context_gain_high95"]
    np.testing.assert_allclose(
        last["eval/context_gain"], last["eval/tau_prob"] - last["eval/tau_prob_without_context"], atol=1e-6
    )


@pytest.mark.slow
def test_metrics_are_finite_and_named(cache_dir, tmp_path):
    last = train(_config(cache_dir, stop_step=2, total_steps=2, eval_every=2), tmp_path)
    for name in (
        "train/loss",
        "train/tau_prob",
        "train/accept_rate_0",
        "eval/tau_prob",
        "train/grad_norm",
        "train/learning_rate",
        "train/confidence_abs_error",
        "train/confidence_cumprod_bias",
        "eval/confidence_cumprod_bias",
        "train/anchors_per_row",
        "train/samples_per_step",
        "train/wall_minutes",
        "eval/wall_minutes",
    ):
        assert math.isfinite(last[name]), name
    assert last["eval/tau_prob_low95"] < last["eval/tau_prob"] < last["eval/tau_prob_high95"]
    assert (tmp_path / "tensorboard").is_dir()


@pytest.mark.slow
def test_paper_micro_step_fits_one_80gb_accelerator():
    from dspark_jax.training.aot import step_memory

    report = step_memory(baseline.get_config("paper"), micro_batch=4)
    assert (
        report["draft_parameters"] > 4e8
    )  # hidden 2560, FFN 9728, Markov rank 256 over a 151,936 vocabulary
    assert report["estimated_peak_bytes"] < 80e9


@pytest.mark.slow
def test_trains_on_a_cache_in_deepspec_layout(cache_dir, tmp_path):
    """The smoke train cache rewritten by hand in DeepSpec's layout (`data.train_cache`) trains to the
    same logged metrics as the native cache of the same samples, bitwise (the same program reads the same
    bf16 states in the same order)."""
    from tests.cache.test_deepspec import write_reference_cache

    config = _config(cache_dir, stop_step=2, total_steps=2, eval_every=2)
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1})
    side, paths = target_side.prepare_target_side(config, mesh)
    native = sources.open_source(paths["train"], config, side)
    samples = [native[i] for i in range(len(native))]
    deepspec_dir = tmp_path / "deepspec"
    write_reference_cache(
        deepspec_dir, samples, [len(samples) // 2, len(samples) - len(samples) // 2], (1, 2, 3)
    )
    train(config, tmp_path / "native")
    config.data.train_cache = str(deepspec_dir)
    last = train(config, tmp_path / "deepspec")
    assert math.isfinite(last["train/loss"]) and math.isfinite(last["eval/tau_prob"])
    assert logged_metrics(tmp_path / "deepspec") == logged_metrics(tmp_path / "native")


def test_changed_data_settings_build_a_new_cache(cache_dir):
    """`data.train_limit` changed: the run gets a cache of the new settings, not the old one's."""
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1})
    old = _config(cache_dir)
    side, old_paths = target_side.prepare_target_side(old, mesh)
    new = _config(cache_dir)
    new.data.train_limit = 3
    _, new_paths = target_side.prepare_target_side(new, mesh)
    assert new_paths["train"] != old_paths["train"] and new_paths["val"] == old_paths["val"]
    old_samples = len(sources.open_source(old_paths["train"], old, side))
    new_samples = len(sources.open_source(new_paths["train"], new, side))
    assert new_samples <= 3 < old_samples
