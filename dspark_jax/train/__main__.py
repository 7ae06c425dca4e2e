"""Train a DSpark draft.

  python -m dspark_jax.train --config=configs/baseline.py[:demo|:paper|:smoke] [--workdir=DIR] \
      [--config.train.stop_step=N] [--config.key=value ...]

Builds the demo caches first when they are missing. The work directory holds orbax
checkpoints, TensorBoard events and `metrics.jsonl`; rerunning with the same work directory
resumes (a different training setting is refused unless named in `--allow_changed`). SIGTERM
saves a checkpoint and exits with status 75. On a multi-host TPU slice or Slurm allocation
`jax.distributed.initialize()` runs first (see launch/).
"""

from __future__ import annotations

import json
import os
import sys

import jax
from absl import flags, logging

from dspark_jax.cli import REPO_ROOT, config_value, define_config_flag, run
from dspark_jax.train.loop import Preempted, train

_CONFIG = define_config_flag()
_WORKDIR = flags.DEFINE_string("workdir", None, "Work directory; default workdirs/<experiment>-<preset>.")
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


def main(argv):
    del argv
    if _multi_host():
        jax.distributed.initialize()
    config = config_value(_CONFIG)
    workdir = _WORKDIR.value or str(REPO_ROOT / "workdirs" / f"{config.experiment}-{config.preset}")
    logging.info("experiment %s preset %s, workdir %s", config.experiment, config.preset, workdir)
    try:
        metrics = train(config, workdir, allow_changed=_ALLOW_CHANGED.value)
    except Preempted as e:
        print(f"{e} (workdir {workdir})", file=sys.stderr)
        sys.exit(PREEMPTED_STATUS)
    print(json.dumps(metrics))


if __name__ == "__main__":
    run(main)
