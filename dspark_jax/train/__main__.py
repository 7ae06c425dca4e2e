"""Train a DSpark draft.

  python -m dspark_jax.train --config=configs/baseline.py[:demo|:paper|:smoke] [--workdir=DIR] \
      [--config.train.stop_step=N] [--config.key=value ...]

Builds the demo caches first when they are missing. The work directory holds orbax
checkpoints, TensorBoard events and `metrics.jsonl`; rerunning with the same work directory
resumes. On a multi-host TPU slice or Slurm allocation `jax.distributed.initialize()` runs
first (see launch/).
"""

from __future__ import annotations

import json
import os

import jax
from absl import app, flags, logging

from dspark_jax.cli import REPO_ROOT, define_config_flag
from dspark_jax.train.loop import train

_CONFIG = define_config_flag()
_WORKDIR = flags.DEFINE_string("workdir", None, "Work directory; default workdirs/<experiment>-<preset>.")


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
    config = _CONFIG.value
    workdir = _WORKDIR.value or str(REPO_ROOT / "workdirs" / f"{config.experiment}-{config.preset}")
    logging.info("experiment %s preset %s, workdir %s", config.experiment, config.preset, workdir)
    print(json.dumps(train(config, workdir)))


if __name__ == "__main__":
    app.run(main)
