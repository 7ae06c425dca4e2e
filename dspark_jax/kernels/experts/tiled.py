"""Grouped SwiGLU experts in tiles of rows: the portable implementation (any backend, exact).

Each held expert's pairs are padded to a whole number of `tile`-row tiles, so that every tile belongs to one
expert; a `lax.scan` over the tiles gathers each live tile's token rows, multiplies them by its expert's
weights (a dynamic slice, no copy of the experts), and adds them, times their routing weights, into the
tokens' float32 sums; it skips the rest. Work and reads are those of the routed rows plus at most
`tile - 1` padding rows per expert: no token is dropped and nothing is computed for an expert's absent rows;
memory is the `[T, H]` sums and one tile, never a row per pair. The number of tiles is static: the bound
`ceil((P + min(X, P) * (tile - 1)) / tile)` for `P` pairs, reached only when every pair goes to held
experts and each pads a tile; tiles past the live ones cost a branch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dspark_jax.kernels.experts.plan import Plan

MIN_TILE, MAX_TILE = 8, 256


def default_tile(pairs: int, experts: int) -> int:
    """Rows per tile: the mean pairs per expert rounded up to a power of two, within [8, 256]."""
    mean = max(1, -(-pairs // max(1, experts)))
    return min(MAX_TILE, max(MIN_TILE, 1 << (mean - 1).bit_length()))


def tiled_swiglu(
    x_TxH: jax.Array,
    plan: Plan,
    weights_TxK: jax.Array,
    gate_XxHxI: jax.Array,
    up_XxHxI: jax.Array,
    down_XxIxH: jax.Array,
    *,
    tile: int | None = None,
) -> jax.Array:
    """`y[t] = sum_k w[t, k] * SwiGLU_{ids[t, k]}(x[t])` `[T, H]` over the held experts' picks."""
    top_k = weights_TxK.shape[-1]
    pairs = plan.order_P.shape[0]
    experts = gate_XxHxI.shape[0]
    m = tile or default_tile(pairs, experts)
    if m < 1:
        raise ValueError(f"tile must be >= 1 rows, got {m}")
    num_tiles = -(-(pairs + min(experts, pairs) * (m - 1)) // m)
    padded_X = -(-plan.sizes_X // m) * m
    ends_X = jnp.cumsum(padded_X)
    starts_X = ends_X - padded_X
    expert_T = jnp.minimum(jnp.searchsorted(ends_X, jnp.arange(num_tiles) * m, side="right"), experts - 1)
    live_T = jnp.arange(num_tiles) < ends_X[-1] // m

    # Padded row r holds sorted pair `starts[e] + r - padded_starts[e]` of its tile's expert e, if real.
    row_R = jnp.arange(num_tiles * m)
    expert_R = expert_T[row_R // m]
    offset_R = row_R - starts_X[expert_R]
    real_R = (offset_R < plan.sizes_X[expert_R]) & (row_R < ends_X[-1])
    pair_R = plan.order_P[jnp.clip(plan.starts_X[expert_R] + offset_R, 0, pairs - 1)]
    scale_R = jnp.where(real_R, weights_TxK.reshape(-1)[pair_R], 0).astype(jnp.float32)

    def one_tile(y_TxH, tile_inputs):
        tokens_M, scale_M, expert, live = tile_inputs

        def add(y_TxH):
            rows_MxH = x_TxH[tokens_M]
            inner_MxI = jax.nn.silu(rows_MxH @ gate_XxHxI[expert]) * (rows_MxH @ up_XxHxI[expert])
            out_MxH = (inner_MxI @ down_XxIxH[expert]).astype(jnp.float32)
            return y_TxH.at[tokens_M].add(out_MxH * scale_M[:, None])

        return jax.lax.cond(live, add, lambda y: y, y_TxH), None

    tiles = ((pair_R // top_k).reshape(num_tiles, m), scale_R.reshape(num_tiles, m), expert_T, live_T)
    y_TxH, _ = jax.lax.scan(one_tile, jnp.zeros(x_TxH.shape, jnp.float32), tiles)
    return y_TxH.astype(x_TxH.dtype)
