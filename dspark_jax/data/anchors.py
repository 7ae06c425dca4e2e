"""Anchor sampling on the host (docs/design.md section 1), in pure numpy.

Notation (the legend in `dspark_jax/__init__.py`): `T` sequence length, `N` anchors (blocks) per
sample. An anchor is a position `a` with `loss_mask[a] = 1` and `loss_mask[a + 1] = 1`. What each
block predicts (labels, Markov predecessors, eval mask) is derived from the anchors on device by
`dspark_jax.draft.blocks`.

Padding convention: a block that is not a real anchor has anchor value `ANCHOR_PAD = 0`
and `block_keep = 0`. Position 0 can also be a real anchor, so `block_keep` (never the
anchor value) tells real blocks from padding.
"""

from __future__ import annotations

import numpy as np

ANCHOR_PAD = 0


def valid_anchor_positions(loss_mask_T: np.ndarray, positions_T: np.ndarray | None = None) -> np.ndarray:
    """All anchor positions of one row, ascending: int32[count], `a` with `mask[a] = mask[a+1] = 1`.

    With `positions_T` (a packed row: each sample's positions restart at 0), `a + 1` must also be the
    next token of the same sample (`positions[a+1] = positions[a] + 1`).
    """
    mask_T = np.asarray(loss_mask_T).astype(bool)
    if mask_T.ndim != 1:
        raise ValueError(f"loss_mask must be 1-D [T], got shape {mask_T.shape}")
    valid_T = mask_T[:-1] & mask_T[1:]
    if positions_T is not None:
        positions_T = np.asarray(positions_T)
        valid_T &= positions_T[1:] == positions_T[:-1] + 1
    return np.flatnonzero(valid_T).astype(np.int32)


def sample_anchors(
    loss_mask_T: np.ndarray,
    num_anchors: int,
    rng: np.random.Generator,
    positions_T: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Draws up to `num_anchors` anchors uniformly without replacement, sorted ascending.

    Returns `(anchors_N int32[N], block_keep_N uint8[N])` with `N = num_anchors`: of the `count`
    valid anchor positions, the first `min(count, N)` entries are the sorted drawn anchors
    (`block_keep = 1`), the rest padding (`ANCHOR_PAD`, `block_keep = 0`). With `count <= N` every
    valid anchor is taken. A packed row (`positions_T`) draws over all its samples' anchors.
    """
    if num_anchors < 1:
        raise ValueError(f"num_anchors must be >= 1, got {num_anchors}")
    valid_positions = valid_anchor_positions(loss_mask_T, positions_T)
    count = min(valid_positions.size, num_anchors)
    chosen = (
        valid_positions
        if count == valid_positions.size
        else rng.choice(valid_positions, size=count, replace=False)
    )
    anchors_N = np.full(num_anchors, ANCHOR_PAD, dtype=np.int32)
    anchors_N[:count] = np.sort(chosen)
    block_keep_N = np.zeros(num_anchors, dtype=np.uint8)
    block_keep_N[:count] = 1
    return anchors_N, block_keep_N
