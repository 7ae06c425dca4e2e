"""Anchor sampling and per-block index arrays (DESIGN.md section 2), in pure numpy.

Notation: `T` sequence length, `N` anchors (blocks) per sample, `B` block size (7).
An anchor is a position `a` with `loss_mask[a] = 1` and `loss_mask[a + 1] = 1`.
Prediction `i = 0..B-1` of the block at anchor `a` predicts `x[a+1+i]` (CE label),
its teacher is `S[a+i]`, and its Markov predecessor is `x[a+i]` (the anchor for `i = 0`).

Padding convention: a block that is not a real anchor has anchor value `ANCHOR_PAD = 0`
and `block_keep = 0`. Position 0 can also be a real anchor, so `block_keep` (never the
anchor value) tells real blocks from padding.

The per-block helpers accept any leading batch dims: `loss_mask [..., T]` with
`anchors [..., N]` gives `[..., N, B]`.
"""

from __future__ import annotations

import numpy as np

BLOCK_SIZE = 7
ANCHOR_PAD = 0


def valid_anchor_positions(loss_mask_T: np.ndarray) -> np.ndarray:
    """All anchor positions of one sample, ascending: int32[K], `a` with `mask[a] = mask[a+1] = 1`."""
    mask_T = np.asarray(loss_mask_T).astype(bool)
    if mask_T.ndim != 1:
        raise ValueError(f"loss_mask must be 1-D [T], got shape {mask_T.shape}")
    return np.flatnonzero(mask_T[:-1] & mask_T[1:]).astype(np.int32)


def sample_anchors(
    loss_mask_T: np.ndarray, num_anchors: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Draws up to `num_anchors` anchors uniformly without replacement, sorted ascending.

    Returns `(anchors_N int32[N], block_keep_N uint8[N])` with `N = num_anchors`: the first
    `min(K, N)` entries are the sorted drawn anchors (`block_keep = 1`), the rest padding
    (`ANCHOR_PAD`, `block_keep = 0`). With `K <= N` every valid anchor is taken.
    """
    if num_anchors < 1:
        raise ValueError(f"num_anchors must be >= 1, got {num_anchors}")
    valid_K = valid_anchor_positions(loss_mask_T)
    count = min(valid_K.size, num_anchors)
    chosen = valid_K if count == valid_K.size else rng.choice(valid_K, size=count, replace=False)
    anchors_N = np.full(num_anchors, ANCHOR_PAD, dtype=np.int32)
    anchors_N[:count] = np.sort(chosen)
    block_keep_N = np.zeros(num_anchors, dtype=np.uint8)
    block_keep_N[:count] = 1
    return anchors_N, block_keep_N


def _gather_blocks(values_xT: np.ndarray, positions_xNB: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`values[..., positions]` per block and the in-range mask `0 <= position < T`; out of range -> 0."""
    length = values_xT.shape[-1]
    in_range_xNB = (positions_xNB >= 0) & (positions_xNB < length)
    if length == 0:
        return np.zeros(positions_xNB.shape, values_xT.dtype), in_range_xNB
    *lead, n, b = positions_xNB.shape
    flat_idx = np.clip(positions_xNB, 0, length - 1).reshape(*lead, n * b)
    gathered_xNB = np.take_along_axis(values_xT, flat_idx, axis=-1).reshape(positions_xNB.shape)
    return np.where(in_range_xNB, gathered_xNB, 0).astype(values_xT.dtype), in_range_xNB


def teacher_positions(anchors_xN: np.ndarray, block_size: int = BLOCK_SIZE) -> np.ndarray:
    """Teacher position `a + i` of every prediction: int32[..., N, B] (the teacher is `S[a+i]`).

    Not clipped to the sequence; entries with `eval_mask = 0` may point past it.
    """
    return (np.asarray(anchors_xN, np.int32)[..., None] + np.arange(block_size, dtype=np.int32)).astype(
        np.int32
    )


def block_labels(
    input_ids_xT: np.ndarray, anchors_xN: np.ndarray, block_size: int = BLOCK_SIZE
) -> np.ndarray:
    """CE labels `x[a+1+i]`: int32[..., N, B], 0 where `a+1+i >= T`."""
    labels, _ = _gather_blocks(
        np.asarray(input_ids_xT, np.int32), teacher_positions(anchors_xN, block_size) + 1
    )
    return labels


def markov_predecessors(
    input_ids_xT: np.ndarray, anchors_xN: np.ndarray, block_size: int = BLOCK_SIZE
) -> np.ndarray:
    """Markov-head predecessors `x[a+i]` (teacher forcing; the anchor token for `i = 0`): int32[..., N, B].

    0 where `a+i >= T`.
    """
    preds, _ = _gather_blocks(np.asarray(input_ids_xT, np.int32), teacher_positions(anchors_xN, block_size))
    return preds


def eval_mask(
    loss_mask_xT: np.ndarray,
    anchors_xN: np.ndarray,
    block_keep_xN: np.ndarray,
    block_size: int = BLOCK_SIZE,
) -> np.ndarray:
    """Which predictions count: uint8[..., N, B].

    `eval_mask[n, i] = prod_{j <= i} [a+1+j < T and loss_mask[a+1+j]]`, times `block_keep[n]`.
    """
    label_mask, in_range = _gather_blocks(
        np.asarray(loss_mask_xT).astype(np.uint8), teacher_positions(anchors_xN, block_size) + 1
    )
    valid_xNB = (label_mask != 0) & in_range & (np.asarray(block_keep_xN) != 0)[..., None]
    return np.cumprod(valid_xNB, axis=-1).astype(np.uint8)
