"""Prefix reranker on a frozen baseline (experiment group 7): a trained baseline's backbone, Markov and
confidence head restored and frozen (no optimizer state), only the new reranker trained, with a fresh
optimizer and schedule.

  python -m dspark_jax.train --config=configs/baseline.py            # the baseline: workdirs/baseline-demo
  python -m dspark_jax.train --config=configs/reranker_frozen.py     # :demo, starts from its step 300
  python -m dspark_jax.train --config=configs/reranker_frozen.py:paper \\
      --config.init.checkpoint=/path/to/baseline/workdir                  # the seed's step 2,604

Keys beyond configs/reranker_joint.py:
  init.checkpoint   the baseline work directory (or checkpoints directory) to start from; relative paths
                    resolve against the working directory (default: workdirs/baseline-<preset>).
  init.step         its step (paper 2,604; demo 300, the demo baseline's last; smoke 6).
Metrics are logged at `init.step + new step` (`train/new_steps` holds the run's own count); the learning-rate
schedule counts the new steps from zero (`train.total_steps` / `train.stop_step` are the new run's).
"""

from configs import reranker_joint


def get_config(preset: str = "demo"):
    config = reranker_joint.get_config(preset)
    with config.unlocked():
        config.experiment = "reranker_frozen"
        config.init.checkpoint = f"workdirs/baseline-{preset}"
        config.init.step = {"paper": 2604, "demo": 300, "accel": 2000, "smoke": 6}[preset]
    return config
