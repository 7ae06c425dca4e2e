"""Print the AOT memory analysis of one device's training step (see `dspark_jax.train.aot`).

python -m dspark_jax.check_memory --config=configs/baseline.py:paper [--micro_batch=4]
"""

from __future__ import annotations

import json

from absl import flags

from dspark_jax.cli import config_value, define_config_flag, run
from dspark_jax.train.aot import step_memory

_CONFIG = define_config_flag()
_MICRO_BATCH = flags.DEFINE_integer("micro_batch", 4, "Samples per device per micro-step.")


def main(argv):
    del argv
    print(json.dumps(step_memory(config_value(_CONFIG), _MICRO_BATCH.value), indent=2))


if __name__ == "__main__":
    run(main)
