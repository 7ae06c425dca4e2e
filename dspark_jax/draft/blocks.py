"""Block index math on device (docs/design.md section 1): what each block predicts, from what, what counts.

A block at anchor `a` has `S` slots at positions `a + i` (`i = 0..S-1`). Prediction `i` (slot i's
output) predicts `x[a+1+i]` (its CE label), its teacher is `S[a+i]` (the target's post-norm state
at the teacher position `a + i`), and its Markov predecessor is `x[a+i]` (the anchor for `i = 0`).
`eval_mask[i] = prod_{j<=i} [a+1+j < T and loss_mask[a+1+j]]`, times `block_keep`: a prediction
counts only while every earlier one in its block is a real response token. In a packed row (several
samples one after another, `positions` restarting at 0 for each) a prediction also needs `x[a+1+i]`
to be in the anchor's own sample, and the block's context starts at its sample's first position
(`sample_starts`).

Anchors come in as arrays, so steps that choose anchors on device (Draft Memory's new anchor
`a' = a + m + 1`) use the same functions as the baseline. Positions past the sequence gather 0.
Every function takes `[B, T]` sequences and `[B, N]` anchors and returns `[B, N, S]`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class BlockTargets(NamedTuple):
    """Per-prediction index arrays of `B x N` blocks, each `[B, N, S]`."""

    labels: jax.Array  # int32, x[a+1+i]
    predecessors: jax.Array  # int32, x[a+i]
    eval_mask: jax.Array  # uint8, cumulative validity


def teacher_positions(anchors_BxN: jax.Array, block_size: int) -> jax.Array:
    """Teacher position `a + i` of every prediction, int32[B, N, S] (not clipped to the sequence)."""
    return anchors_BxN.astype(jnp.int32)[..., None] + jnp.arange(block_size, dtype=jnp.int32)


def gather_blocks(values_BxT: jax.Array, positions_BxNxS: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`values[b, positions]` and the in-range mask `0 <= position < T`; out-of-range entries are 0."""
    b, n, s = positions_BxNxS.shape
    length = values_BxT.shape[1]
    in_range_BxNxS = (positions_BxNxS >= 0) & (positions_BxNxS < length)
    flat_BxNS = jnp.clip(positions_BxNxS, 0, length - 1).reshape(b, n * s)
    gathered_BxNxS = jnp.take_along_axis(values_BxT, flat_BxNS, axis=1).reshape(b, n, s)
    return jnp.where(in_range_BxNxS, gathered_BxNxS, 0).astype(values_BxT.dtype), in_range_BxNxS


def sample_starts(positions_BxT: jax.Array, anchors_BxN: jax.Array) -> jax.Array:
    """First row index of each anchor's sample, `a - positions[a]`, int32[B, N] (0 without packing)."""
    anchor_pos_BxN = jnp.take_along_axis(
        positions_BxT.astype(jnp.int32), anchors_BxN.astype(jnp.int32), axis=1
    )
    return anchors_BxN.astype(jnp.int32) - anchor_pos_BxN


def block_targets(
    input_ids_BxT: jax.Array,
    loss_mask_BxT: jax.Array,
    anchors_BxN: jax.Array,
    block_keep_BxN: jax.Array,
    block_size: int,
    positions_BxT: jax.Array | None = None,
) -> BlockTargets:
    """Labels `x[a+1+i]`, Markov predecessors `x[a+i]` and the eval mask of every prediction.

    With `positions_BxT` (packed rows), a label must belong to the anchor's sample.
    """
    positions_BxNxS = teacher_positions(anchors_BxN, block_size)
    ids_BxT = input_ids_BxT.astype(jnp.int32)
    predecessors, _ = gather_blocks(ids_BxT, positions_BxNxS)
    labels, _ = gather_blocks(ids_BxT, positions_BxNxS + 1)
    label_mask, in_range = gather_blocks(loss_mask_BxT.astype(jnp.int32), positions_BxNxS + 1)
    valid_BxNxS = (label_mask != 0) & in_range & (block_keep_BxN != 0)[..., None]
    if positions_BxT is not None:
        starts_BxN = sample_starts(positions_BxT, anchors_BxN)
        label_pos_BxNxS, _ = gather_blocks(positions_BxT.astype(jnp.int32), positions_BxNxS + 1)
        valid_BxNxS &= label_pos_BxNxS == positions_BxNxS + 1 - starts_BxN[..., None]
    eval_mask = jnp.cumprod(valid_BxNxS.astype(jnp.int32), axis=-1).astype(jnp.uint8)
    return BlockTargets(labels, predecessors, eval_mask)


def teacher_hidden(last_hidden_BxTxH: jax.Array, anchors_BxN: jax.Array, block_size: int) -> jax.Array:
    """`S[a+i]` for every prediction, `[B, N, S, H]` (positions past T clamp; they are masked)."""
    t = last_hidden_BxTxH.shape[1]
    positions_BxNxS = jnp.minimum(teacher_positions(anchors_BxN, block_size), t - 1)
    b, n, s = positions_BxNxS.shape
    gathered = jnp.take_along_axis(last_hidden_BxTxH, positions_BxNxS.reshape(b, n * s, 1), axis=1)
    return gathered.reshape(b, n, s, -1)
