"""Baseline DSpark (experiment group 1): the original draft trained from scratch.

  python -m dspark_jax.train --config=configs/baseline.py            # :demo, SmolLM2 on CPU (minutes)
  python -m dspark_jax.train --config=configs/baseline.py:smoke      # tiny random target (seconds)
  python -m dspark_jax.train --config=configs/baseline.py:paper \\
      --config.target.path=/path/to/Qwen3.8-Flash-Next --config.data.cache_dir=gs://bucket/dspark

Every key is documented in configs/base.py; override with `--config.key=value`.
"""

from configs import base


def get_config(preset: str = "demo"):
    config = base.get_config(preset)
    with config.unlocked():
        config.experiment = "baseline"
    return config
