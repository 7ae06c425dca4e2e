"""Engram-MASK, direct replacement (experiment group 4): MASK slots are `N(P e[a-1])` itself.

  python -m dspark_jax.train --config=configs/engram_mask_replace.py        # :demo (fits the table first)
  python -m dspark_jax.train --config=configs/engram_mask_replace.py:smoke  # tiny random target (seconds)

No MASK vector, no gates (+6,553,600 parameters at paper shapes). Table settings: the `engram` section
(dspark_jax/groups/engram/prepare.py).
"""

from configs import base


def get_config(preset: str = "demo"):
    return base.with_engram(base.get_config(preset), "engram_mask_replace")
