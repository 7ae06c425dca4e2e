"""What online training costs next to offline: step seconds on this host, bytes per device on a pod slice.

  python benchmarks/online_training.py [--presets=demo] [--steps=3] \
      [--topologies=tpu-v5p-8,h200x8 --tpu_path=/tmp/libtpu_site --cuda_path=/tmp/cuda_site]

1. Seconds per optimizer step of the baseline at each preset's shapes, offline (the target's states read
   from the batch) and online (`data.features=online`: a random target of the preset's shape runs in the
   step), from `benchmarks/train_step.py`'s timing; the demo preset's target is SmolLM2-135M's shape.
2. With `--topologies`, `check_memory --topology=NAME` of the paper preset's step offline and online
   (the whole hybrid MoE target of `PAPER_TARGET` sharded over the slice, shapes only), each compiled in a
   process of its own with that platform's compiler on `PYTHONPATH` (`--tpu_path` / `--cuda_path`: where
   `pip install --target` put libtpu or the CUDA plugin; empty = this environment's own), GB per device.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import ROOT, load_config_module
from benchmarks.train_step import time_step
from dspark_jax.training import topology

MODES = ("offline", "online")
COLUMNS = (
    ("parameters", "params"),
    ("optimizer_state", "Adam"),
    ("gradient_accumulators", "grads"),
    ("frozen_target", "frozen"),
    ("online_target_state", "target"),
    ("batch", "batch"),
    ("micro_step_temporaries", "temps"),
)


def step_seconds(presets: list[str], steps: int) -> None:
    config_module = load_config_module("configs/baseline.py")
    print(f"jax {jax.__version__}, {jax.device_count()} x {jax.devices()[0].device_kind}")
    print(f"{'preset':8s} {'features':8s} {'step s':>10s} {'tokens/s':>10s} {'vs offline':>10s}")
    for preset in presets:
        offline = None
        for mode in MODES:
            r = time_step(config_module, preset, steps, shape_only=True, features=mode)
            offline = offline or r["step_seconds"]
            print(
                f"{preset:8s} {mode:8s} {r['step_seconds']:10.3f} {r['tokens_per_second']:10.0f} "
                f"{r['step_seconds'] / offline:9.2f}x"
            )


def check_memory(name: str, mode: str, compiler_path: str) -> dict:
    """`check_memory --topology=name` of the paper step in `mode`, in a subprocess."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [compiler_path, str(ROOT)])))
    cmd = [
        sys.executable,
        "-m",
        "dspark_jax.check_memory",
        "--config=configs/baseline.py:paper",
        f"--topology={name}",
        f"--config.data.features={mode}",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed: {proc.stderr.strip().splitlines()[-1]}")
    return json.loads(proc.stdout)


def device_bytes(names: list[str], paths: dict[str, str]) -> None:
    head = " ".join(f"{label:>7s}" for _, label in COLUMNS)
    print("\npaper step, GB per device")
    print(f"{'topology':10s} {'features':8s} {head} {'peak':>7s} {'memory':>7s}  fits")
    for name in names:
        for mode in MODES:
            r = check_memory(name, mode, paths[topology.get(name).platform])
            per = r["per_device_bytes"]
            cells = " ".join(f"{per[key] / 1e9:7.2f}" for key, _ in COLUMNS)
            fits = "yes" if r["fits"] else "no"
            peak, memory = r["estimated_peak_gb"], r["device_memory_gb"]
            print(f"{name:10s} {mode:8s} {cells} {peak:7.2f} {memory:7.2f}  {fits}")


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--presets", default="demo")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--topologies", default="", help="e.g. tpu-v5p-8,h200x8 (empty: step seconds only)")
    parser.add_argument("--tpu_path", default="", help="a directory holding libtpu, put on PYTHONPATH")
    parser.add_argument("--cuda_path", default="", help="a directory holding the CUDA plugin")
    args = parser.parse_args()
    if args.presets:
        step_seconds(args.presets.split(","), args.steps)
    if args.topologies:
        device_bytes(args.topologies.split(","), {"tpu": args.tpu_path, "cuda": args.cuda_path})


if __name__ == "__main__":
    main()
