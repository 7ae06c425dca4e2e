"""What a new user sees: relative paths everywhere, a quiet terminal, a useful summary, a cheap dry run."""

import json
import os
import pty
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.training.test_metrics_writer import read_events

ROOT = Path(__file__).resolve().parents[1]


def _env(cwd: Path) -> dict[str, str]:
    env = {**os.environ, "DSPARK_JAX_CACHE": str(cwd.parent / "default_cache"), "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    return env


def run(cwd: Path, module: str, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", f"dspark_jax.{module}", *args]
    proc = subprocess.run(cmd, cwd=cwd, env=_env(cwd), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def run_in_terminal(cwd: Path, module: str, *args: str) -> str:
    """What a command shows in a terminal (a pseudo-terminal: progress bars redraw their line)."""
    main, child = pty.openpty()
    cmd = [sys.executable, "-m", f"dspark_jax.{module}", *args]
    proc = subprocess.Popen(cmd, cwd=cwd, env=_env(cwd), stdout=child, stderr=child)
    os.close(child)
    chunks = []
    while True:
        try:
            data = os.read(main, 1 << 16)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(main)
    text = b"".join(chunks).decode(errors="replace").replace("\r\n", "\n")
    assert proc.wait(timeout=900) == 0, text[-3000:]
    return text


@pytest.mark.slow
def test_relative_paths_quiet_train_and_follow_up_commands(tmp_path):
    here, there = tmp_path / "here", tmp_path / "there"
    here.mkdir()
    there.mkdir()
    config = f"--config={os.path.relpath(ROOT / 'configs' / 'baseline.py', here)}:smoke"
    shown = run_in_terminal(here, "train", config, "--workdir=runs/smoke", "--config.data.cache_dir=caches")
    terminal = shown.split("\n")  # a progress bar redraws its own line with \r
    assert len(terminal) < 40, shown
    assert not any(line.startswith(("I1", "W1")) for line in terminal)  # no absl/orbax INFO chatter
    workdir = here / "runs" / "smoke"
    assert f"checkpoint {workdir}/checkpoints/6" in shown
    assert f"python -m dspark_jax.speculate --checkpoint={workdir}" in shown
    assert f"tensorboard --logdir={workdir}/tensorboard" in shown
    lines = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    (events,) = (workdir / "tensorboard").glob("events.out.tfevents.*")
    assert set(read_events(events)) == {key for line in lines for key in line} - {"step"}
    log = (workdir / "train.log").read_text()
    assert "orbax" in log and "conversation" in log  # library logs and per-item messages live here

    # From another directory, with relative paths only.
    rel = os.path.relpath(workdir, there)
    spec = run(
        there, "speculate", f"--checkpoint={rel}", "--limit=2", "--max_new_tokens=4", "--output=spec.json"
    )
    assert json.loads((there / "spec.json").read_text())["identical_to_target_greedy"] == "2/2", spec.stderr
    run(there, "evaluate", f"--checkpoint={rel}", "--output=eval.json")
    assert json.loads((there / "eval.json").read_text())["step"] == 6
    (cache,) = (here / "caches").glob("*/train_cache-*")
    inspected = run(there, "inspect_cache", os.path.relpath(cache, there), "--verify")
    assert "verify: OK" in inspected.stdout


def test_build_cache_dry_run_is_cheap_and_writes_nothing(tmp_path, record_property):
    """The demo preset's projected cache sizes: no weights loaded, nothing generated or written. Its wall
    time is recorded (`dry_run_seconds` in the `--junitxml` report, printed under `-s` without xdist;
    measured 16-34 s on 2 shared cores), not asserted: on a busy machine it says more about the machine
    than about the command."""
    began = time.perf_counter()
    proc = run(tmp_path, "build_cache", "--dry_run", "--config.data.cache_dir=caches")
    seconds = time.perf_counter() - began
    record_property("dry_run_seconds", round(seconds, 1))
    print(f"build_cache --dry_run (demo preset): {seconds:.1f} s")
    reports = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["split"] for r in reports] == ["train", "val"]
    assert all(r["bytes_at_most"] > 0 and r["samples_at_most"] > 0 for r in reports)
    assert reports[1]["samples_at_most"] == 256  # GSM8K-256, no prompt longer than the cap
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no cache, no replies, no lock
    assert not (tmp_path.parent / "default_cache").exists()
