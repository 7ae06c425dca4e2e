"""What the block attention implementations share: the per-block memory operand, the masking constant, the
regrouping of keys per KV head."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

NEG_INF = -1e30  # a finite "minus infinity": masked scores, and a kernel's running max before any visible key


class BlockMemory(NamedTuple):
    """Per-block extra keys/values visible only to their own block (Draft Memory)."""

    k_BxNxMxGxD: jax.Array
    v_BxNxMxGxD: jax.Array
    valid_BxNxM: jax.Array


def per_kv_head(x):
    """`[B, ..., G, D]` keys or values -> `[B, G, P, D]`: one row of keys per KV head, the positions `...`
    flattened in order (`[B, N, S, G, D]` -> `[B, G, N*S, D]`)."""
    b, g, d = x.shape[0], x.shape[-2], x.shape[-1]
    return jnp.moveaxis(x, -2, 1).reshape(b, g, -1, d)
