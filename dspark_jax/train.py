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
import sys
from pathlib import Path

from absl import flags
from etils import epath

from dspark_jax.cli import (
    REPO_ROOT,
    config_value,
    define_config_flag,
    define_path_flag,
    log_to_file,
    run,
)
from dspark_jax.run.distributed import initialize_distributed, multi_process_launch
from dspark_jax.training.loop import Preempted, check_workdir, train
from dspark_jax.training.summary import LOG_FILE, SUMMARY_FILE, human_summary

log = logging.getLogger("dspark_jax.train")

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


def main(argv):
    del argv
    if multi_process_launch():
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


if __name__ == "__main__":
    run(main)
