"""Engram-MASK, gated residual (experiment group 3): MASK slots gain `tanh(theta_j) N(P e[a-1])`.

  python -m dspark_jax.train --config=configs/engram_mask_gated.py        # :demo (fits the table first)
  python -m dspark_jax.train --config=configs/engram_mask_gated.py:smoke  # tiny random target (seconds)

Zero-initialised per-slot gates keep the first step equal to the baseline's (+6,553,606 parameters at
paper shapes). Table settings: the `engram` section (dspark_jax/groups/engram/prepare.py).
"""

from configs import base


def get_config(preset: str = "demo"):
    return base.with_engram(base.get_config(preset), "engram_mask_gated")
