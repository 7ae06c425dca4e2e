"""What the block attention implementations share: the per-block memory operand, the masking constant."""

from __future__ import annotations

from typing import NamedTuple

import jax

NEG_INF = -1e30  # a finite "minus infinity": masked scores, and a kernel's running max before any visible key


class BlockMemory(NamedTuple):
    """Per-block extra keys/values visible only to their own block (Draft Memory)."""

    k_BxNxMxGxD: jax.Array
    v_BxNxMxGxD: jax.Array
    valid_BxNxM: jax.Array
