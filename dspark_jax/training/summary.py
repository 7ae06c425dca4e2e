"""The run's summary: `summary.json` in the work directory (where the outputs are, the final and best
evaluation, the wall time of each stage) and its reading for a person."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import jax
from etils import epath

from dspark_jax.run.checkpoints import Checkpointer
from dspark_jax.training.metrics_writer import METRICS_FILE, TENSORBOARD_DIR
from dspark_jax.training.progress import format_duration

SUMMARY_FILE = "summary.json"
LOG_FILE = "train.log"  # every log record of the training command (`python -m dspark_jax.train`)


def write_summary(
    workdir: epath.Path,
    checkpointer: Checkpointer,
    stages: Mapping[str, float],
    pretrained_steps: int = 0,
    process_steps: tuple[int, int] = (0, 0),
    features: Mapping[str, Any] | None = None,
) -> None:
    """`summary.json` in the work directory: where the run's outputs are, its final and best
    evaluation (on the logged, cumulative step axis), the run's own steps and the steps of the run it
    started from, what this process did (`resumed_from_step`: the checkpoint it started from, 0 for a
    fresh run; `steps_computed`: the optimizer steps it ran), the wall time of each stage, and where the
    target's states came from (`features`: the mode, and online what the target's forward cost of each
    step) (process 0 only)."""
    if jax.process_index():
        return
    lines = [json.loads(line) for line in (workdir / METRICS_FILE).read_text().splitlines()]
    evals = [(line["step"], line["eval/tau_prob"]) for line in lines if line.get("eval/tau_prob") is not None]
    step = checkpointer.latest_step()
    summary = {
        "workdir": str(workdir),
        "checkpoint": str(checkpointer.directory / str(step)) if step is not None else None,
        "step": step,
        "pretrained_steps": pretrained_steps,
        "resumed_from_step": process_steps[0],
        "steps_computed": process_steps[1],
        "tensorboard": str(workdir / TENSORBOARD_DIR),
        "metrics": str(workdir / METRICS_FILE),
        "final_eval": dict(zip(("step", "tau_prob"), evals[-1])) if evals else None,
        "best_eval": dict(zip(("step", "tau_prob"), max(evals, key=lambda e: e[1]))) if evals else None,
        "seconds": {name: round(seconds, 1) for name, seconds in stages.items()},
        "features": dict(features or {"mode": "offline"}),
    }
    (workdir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")


def human_summary(summary: dict, config_name: str) -> str:
    """What the run wrote, how it ended, how long each stage took, and what to run next."""
    seconds = summary["seconds"]
    times = ", ".join(f"{name.replace('_', ' ')} {format_duration(s)}" for name, s in seconds.items())
    lines = [
        f"done: step {summary['step']}, checkpoint {summary['checkpoint']}",
        f"  metrics     {summary['metrics']} (all of them; --json prints the last ones)",
        f"  tensorboard {summary['tensorboard']}",
        f"  log         {summary['workdir']}/{LOG_FILE}",
    ]
    if summary["final_eval"]:
        final, best = summary["final_eval"], summary["best_eval"]
        lines.append(
            f"  eval tau_prob {final['tau_prob']:.4f} at step {final['step']} "
            f"(best {best['tau_prob']:.4f} at step {best['step']})"
        )
    features = summary.get("features") or {"mode": "offline"}
    if "draft_seconds_per_step" in features:
        lines.append(
            f"  features: online, a step {features['target_seconds_per_step']:.3f} s in the target's forward "
            f"+ {features['draft_seconds_per_step']:.3f} s in the draft's"
        )
    else:
        lines.append(f"  features: {features['mode']}")
    lines += [
        f"  wall time: {times}",
        "next:",
        f"  python -m dspark_jax.speculate --checkpoint={summary['workdir']} --limit=16   # MAL, tokens/s",
        f"  python -m dspark_jax.evaluate --checkpoint={summary['workdir']}              # offline metrics",
        f"  tensorboard --logdir={summary['tensorboard']}",
        f"  (config: {config_name})",
    ]
    return "\n".join(lines)
