"""Offline (teacher-forced) metrics of a trained draft on the validation cache.

  python -m dspark_jax.evaluate --checkpoint=DIR [--config=configs/baseline.py[:preset]] [--output=OUT.json]

`--checkpoint` takes a training work directory (its latest checkpoint), a checkpoints
directory, or one step's directory; the run's stored config is used unless `--config` is
given (which must agree with it on every key that shapes the draft). Prints (and writes)
`eval` metrics: tau_prob, accept_rate_0..6, losses, confidence error.
"""

from __future__ import annotations

import json

from etils import epath

from dspark_jax.cli import checkpoint_config, define_config_flag, define_path_flag, run
from dspark_jax.training.evaluation import evaluate_checkpoint

_CONFIG = define_config_flag(default=None)
_CHECKPOINT = define_path_flag("checkpoint", None, "Work directory or checkpoint directory.", required=True)
_OUTPUT = define_path_flag("output", None, "Optional JSON output path.")


def main(argv):
    del argv
    result = evaluate_checkpoint(checkpoint_config(_CONFIG, _CHECKPOINT.value), _CHECKPOINT.value)
    text = json.dumps(result, indent=2)
    if _OUTPUT.value:
        epath.Path(_OUTPUT.value).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    run(main, config_default=None)
