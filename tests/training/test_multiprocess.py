"""Two real CPU processes (`jax.distributed` on localhost, gloo collectives) train the smoke preset.

The reference is one process with two CPU devices and the same global batch: the two-process run logs
the same losses and ends with the same parameters, bitwise; a run whose processes are killed resumes
to that result; SIGTERM to one process makes both save one step and stop.
"""

import os
import signal
import socket
import subprocess
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from tests.training.test_loop import (
    ROOT,
    SETTINGS,
    assert_resumed,
    logged_metrics,
    saved_steps,
    train_command,
)

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(workdir, cache_dir, processes, devices_per_process, *extra, **settings):
    """`python -m dspark_jax.train` in `processes` processes (one coordinator on localhost); `extra` flags."""
    cmd = train_command(workdir, cache_dir, {**SETTINGS, **settings}, *extra)
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices_per_process}"}
    if processes > 1:
        env |= {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{_free_port()}", "JAX_NUM_PROCESSES": str(processes)}
    return [
        subprocess.Popen(
            cmd,
            cwd=ROOT,
            env={**env, "JAX_PROCESS_ID": str(i)} if processes > 1 else env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(processes)
    ]


def _finish(procs, timeout=600) -> list[str]:
    """Waits for every process to exit 0; returns their stderr."""
    outcomes = [(p.wait(timeout=timeout), p.stderr.read()) for p in procs]
    for code, stderr in outcomes:
        assert code == 0, stderr[-3000:]
    return [stderr for _, stderr in outcomes]


def _params(workdir, step):
    """The saved parameters, restored onto one device whatever the processes that saved them."""
    checkpointer, path = ocp.StandardCheckpointer(), workdir / "checkpoints" / str(step) / "state"
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    tree = checkpointer.metadata(path).item_metadata.tree
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), tree)
    return ocp.tree.to_flat_dict(checkpointer.restore(path, target)["params"])


def _assert_same_run(a, b):
    assert logged_metrics(a) == logged_metrics(b)
    pa, pb = _params(a, 8), _params(b, 8)
    assert pa.keys() == pb.keys()
    for key in pa:
        np.testing.assert_array_equal(np.asarray(pa[key]), np.asarray(pb[key]), err_msg=str(key))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, two devices (builds the smoke caches the two-process runs then share)."""
    root = tmp_path_factory.mktemp("multiprocess")
    _finish(_launch(root / "one", root / "caches", 1, 2))
    return root


def test_two_processes_equal_one_and_resume_bitwise_after_a_kill(reference):
    caches = reference / "caches"
    two = reference / "two"
    _finish(_launch(two, caches, 2, 1))
    _assert_same_run(reference / "one", two)
    assert [m["step"] for m in logged_metrics(two) if "train/loss" in m] == list(range(1, 9))
    assert len(list((two / "tensorboard").iterdir())) == 1  # process 0 alone writes events

    killed = reference / "killed"
    procs = _launch(killed, caches, 2, 1)
    deadline = time.time() + 300
    while not (killed / "checkpoints" / "2").exists():
        assert all(p.poll() is None for p in procs), procs[0].stderr.read()[-3000:]
        assert time.time() < deadline, "no checkpoint at step 2"
        time.sleep(0.05)
    procs[1].send_signal(signal.SIGKILL)  # one process dies; its peer cannot go on alone
    procs[0].send_signal(signal.SIGKILL)
    for p in procs:
        p.wait()
    assert not (killed / "checkpoints" / "8").exists(), "the run finished before it could be killed"
    before_resume = saved_steps(killed)
    stderrs = _finish(_launch(killed, caches, 2, 1))
    resumed = assert_resumed(killed, before_resume)  # process 0's record of what it computed
    for stderr in stderrs:  # both processes restored that step
        assert f"resumed from step {resumed}" in stderr, stderr[-3000:]
    _assert_same_run(reference / "one", killed)


def test_sigterm_to_one_process_stops_both_at_one_saved_step(reference):
    workdir = reference / "sigterm"
    procs = _launch(
        workdir, reference / "caches", 2, 1, total_steps=60, stop_step=60, checkpoint_every=50, eval_every=0
    )
    deadline = time.time() + 300
    while not any('"step": 3,' in line for line in _lines(workdir / "metrics.jsonl")):
        assert all(p.poll() is None for p in procs), procs[0].stderr.read()[-3000:]
        assert time.time() < deadline, "step 3 never logged"
        time.sleep(0.1)
    procs[1].send_signal(signal.SIGTERM)
    outcomes = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    saved = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
    assert len(saved) == 1 and 3 <= saved[0] < 60
    for code, stderr in outcomes:
        assert code == 75, stderr[-3000:]
        assert f"preempted at step {saved[0]}: checkpoint saved" in stderr
    assert [m["step"] for m in logged_metrics(workdir)][-1] == saved[0]


def _lines(path):
    return path.read_text().splitlines() if path.exists() else []


def test_two_processes_train_online_as_one(tmp_path):
    """Online (the target sharded over both processes' devices, run in every step): the same run, bitwise."""
    online = "--config.data.features=online"
    _finish(_launch(tmp_path / "one", tmp_path / "caches", 1, 2, online))
    _finish(_launch(tmp_path / "two", tmp_path / "caches", 2, 1, online))
    _assert_same_run(tmp_path / "one", tmp_path / "two")
    assert [p.name.split("-")[0] for p in (tmp_path / "caches").glob("*/*_tokens-*")] != []
