"""What every block attention implementation shares: the per-block memory operand."""

from __future__ import annotations

from typing import NamedTuple

import jax


class BlockMemory(NamedTuple):
    """Per-block extra keys/values visible only to their own block (Draft Memory)."""

    k_BxNxMxGxD: jax.Array
    v_BxNxMxGxD: jax.Array
    valid_BxNxM: jax.Array
