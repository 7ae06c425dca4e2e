"""Engram-Markov (experiment group 2): the Markov head reads the drafted prefix's n-gram features.

  python -m dspark_jax.train --config=configs/engram_markov.py          # :demo (fits the table first)
  python -m dspark_jax.train --config=configs/engram_markov.py:smoke    # tiny random target (seconds)
  python -m dspark_jax.train --config=configs/engram_markov.py:paper \\
      --config.target.path=/path/to/Qwen3.8-Flash-Next --config.engram.table_path=/path/to/table.safetensors

`m_i = W1[t_{i-1}] + g_i W_V N(e_{i-1})` with a per-position gate from the draft state (+1,966,080 parameters
at paper shapes). Same presets, caches and loss as configs/baseline.py; the `engram` section
(dspark_jax/groups/engram/prepare.py) names the table, fitted on ShareGPT text training never sees.
"""

from configs import base


def get_config(preset: str = "demo"):
    return base.with_engram(base.get_config(preset), "engram_markov")
