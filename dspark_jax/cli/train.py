"""Train a DSpark draft.

  python -m dspark_jax.train [--config=configs/memory.py[:demo|:paper|:smoke]] [--workdir=DIR] \
      [--config.train.stop_step=N] [--config.key=value ...]

Prints progress, one line per evaluation, warnings and a closing summary (where the checkpoint,
metrics and TensorBoard logs are; final and best eval tau_prob; wall time per stage; the
commands to run next); `--json` prints the last metrics instead. Library logs go to
`<workdir>/train.log` (`--verbosity=0` shows them). Builds the demo caches first when they are
missing. The work directory holds orbax checkpoints, TensorBoard events and `metrics.jsonl`;
rerunning with the same work directory resumes (a different training setting is refused unless
named in `--allow_changed`). SIGTERM saves a checkpoint and exits with status 75. On a
multi-host TPU slice or Slurm allocation `jax.distributed.initialize()` runs first (see launch/); locally,
`JAX_COORDINATOR_ADDRESS=127.0.0.1:PORT JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=i` runs one process per `i`
(CPU collectives through gloo).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import jax
from absl import flags
from etils import epath

from dspark_jax.cli.common import (
    REPO_ROOT,
    config_value,
    define_config_flag,
    define_path_flag,
    log_to_file,
    run,
)
from dspark_jax.training.loop import SUMMARY_FILE, Preempted, check_workdir, train
from dspark_jax.training.progress import format_duration

log = logging.getLogger("dspark_jax.train")
LOG_FILE = "train.log"

_CONFIG = define_config_flag()
_WORKDIR = define_path_flag("workdir", None, "Work directory; default workdirs/<experiment>-<preset>.")
_JSON = flags.DEFINE_bool("json", False, "Print the last logged metrics as JSON instead of the summary.")
_ALLOW_CHANGED = flags.DEFINE_list(
    "allow_changed",
    [],
    "Config keys a resumed run may change from the run in --workdir (e.g. train.peak_lr).",
)
# Exit status of a run stopped by SIGTERM/preemption after saving (EX_TEMPFAIL: rerun to resume).
PREEMPTED_STATUS = 75


def _multi_host() -> bool:
    """True on a multi-process launch (Slurm with several tasks, a multi-worker TPU VM, or explicit)."""
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        return True
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        return True
    return "," in os.environ.get("TPU_WORKER_HOSTNAMES", "")


def initialize_distributed() -> None:
    """`jax.distributed.initialize`, explicit when `JAX_NUM_PROCESSES` and `JAX_PROCESS_ID` are set (local
    multi-process runs, e.g. two CPU processes on one machine), else detected (Slurm, TPU VM). CPU
    processes exchange collectives through gloo."""
    if "JAX_NUM_PROCESSES" not in os.environ or "JAX_PROCESS_ID" not in os.environ:
        jax.distributed.initialize()
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # read by the CPU client only
    jax.distributed.initialize(
        coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
        num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
        process_id=int(os.environ["JAX_PROCESS_ID"]),
    )


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


def main(argv):
    del argv
    if _multi_host():
        initialize_distributed()
    config = config_value(_CONFIG)
    workdir = _WORKDIR.value or str(REPO_ROOT / "workdirs" / f"{config.experiment}-{config.preset}")
    check_workdir(epath.Path(workdir), config, _ALLOW_CHANGED.value)  # before anything is written there
    log_to_file(Path(workdir) / LOG_FILE)
    log.info("experiment %s, preset %s, workdir %s", config.experiment, config.preset, workdir)
    try:
        metrics = train(config, workdir, allow_changed=_ALLOW_CHANGED.value)
    except Preempted as e:
        print(f"{e} (workdir {workdir})", file=sys.stderr)
        sys.exit(PREEMPTED_STATUS)
    if _JSON.value:
        print(json.dumps(metrics))
    else:
        summary = json.loads((Path(workdir) / SUMMARY_FILE).read_text())
        print(human_summary(summary, f"{config.experiment}:{config.preset}"))


def launch() -> None:
    """The command: flags parsed, errors as one line (`cli.common.run`)."""
    run(main)


if __name__ == "__main__":
    launch()
