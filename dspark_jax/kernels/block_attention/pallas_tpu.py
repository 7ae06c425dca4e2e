"""TPU (Mosaic) forward of the Pallas block attention: query tiles of consecutive blocks that read
context tiles only up to their largest anchor.

Layout (letters: the legend in `dspark_jax/__init__.py`). Queries are regrouped per KV head, `[B, G,
N*S*E, D]` with rows ordered (block, slot, head of the group), so a GQA group shares every key tile.
The grid is `(B, G, N / block_q)`; program `(b, g, i)` owns the `block_q` blocks `i*block_q ..` and:

1. context: the anchors are sorted, so its blocks see context positions in `[lo_i, hi_i)`, `lo_i` the
   smallest sample start and `hi_i` the largest anchor of the tile. The tile ranges are computed
   outside the kernel and scalar-prefetched (the way splash attention passes its block-sparse mask
   info); the kernel loops over the `block_k` context tiles of that range only (none for a tile whose
   blocks see no context) and masks each row with its own block's `[start, anchor)`;
2. own slots and memory: the tile's `block_q * S` own keys and `block_q * M` memory keys are one small
   local tile each, masked block-diagonally (memory also by its validity);

with one online softmax over all three parts, fp32 statistics and accumulation, inputs in their own
dtype (bf16 matmuls accumulate in fp32).

The backward pass is `pallas.py`'s custom VJP (the chunked XLA path).

Platforms: the kernel uses only portable Pallas (`BlockSpec`s, `pl.ds` loads, `fori_loop`) and scalar
prefetch; `interpret=True` runs it anywhere (the CPU tests). Compiled, it targets TPU through Mosaic;
NVIDIA Hopper has its own kernel (`pallas_gpu.py`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from dspark_jax.kernels.block_attention.common import NEG_INF, BlockMemory, per_kv_head


def tile_ranges(anchors_BxN: jax.Array, starts_BxN: jax.Array, block_q: int, t: int) -> jax.Array:
    """int32 `[B, N / block_q, 2]`: per query tile, the context range `[lo, hi)` its blocks can see."""
    b, n = anchors_BxN.shape
    hi_BxI = jnp.clip(jnp.max(anchors_BxN.reshape(b, n // block_q, block_q), axis=-1), 0, t)
    lo_BxI = jnp.minimum(
        jnp.clip(jnp.min(starts_BxN.reshape(b, n // block_q, block_q), axis=-1), 0, t), hi_BxI
    )
    return jnp.stack([lo_BxI, hi_BxI], axis=-1).astype(jnp.int32)


def _online(carry, scores_RxK, visible_RxK, v_KxD):
    """One online-softmax step over a key tile: running max, denominator and fp32 accumulator."""
    m_Rx1, l_Rx1, acc_RxD = carry
    scores_RxK = jnp.where(visible_RxK, scores_RxK, NEG_INF)
    m_new = jnp.maximum(m_Rx1, jnp.max(scores_RxK, axis=-1, keepdims=True))
    p_RxK = jnp.where(visible_RxK, jnp.exp(scores_RxK - m_new), 0.0)
    alpha = jnp.exp(m_Rx1 - m_new)
    pv = jnp.dot(p_RxK.astype(v_KxD.dtype), v_KxD, preferred_element_type=jnp.float32)
    return m_new, alpha * l_Rx1 + jnp.sum(p_RxK, axis=-1, keepdims=True), alpha * acc_RxD + pv


def _scores(q_RxD, k_KxD):
    return jax.lax.dot_general(q_RxD, k_KxD, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _kernel(
    ranges_ref, q_ref, anchor_ref, start_ref, kc_ref, vc_ref, ko_ref, vo_ref, *rest, s, e, m, block_k
):
    """One query tile of one (row, KV head): context tiles in range, then own slots, then memory."""
    if m:
        km_ref, vm_ref, valid_ref, o_ref = rest
    else:
        (o_ref,) = rest
    b, i = pl.program_id(0), pl.program_id(2)
    q_RxD = q_ref[...]
    rows, d = q_RxD.shape
    q_RxD = (q_RxD.astype(jnp.float32) * d**-0.5).astype(q_RxD.dtype)
    anchor_Rx1, start_Rx1 = anchor_ref[...], start_ref[...]
    carry = (jnp.full((rows, 1), NEG_INF, jnp.float32), jnp.zeros((rows, 1), jnp.float32))
    carry = (*carry, jnp.zeros((rows, d), jnp.float32))

    def context_tile(tile, carry):
        first = pl.multiple_of(tile * block_k, block_k)
        j_1xK = first + jax.lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
        visible = (j_1xK >= start_Rx1) & (j_1xK < anchor_Rx1)
        scores = _scores(q_RxD, kc_ref[pl.ds(first, block_k), :])
        return _online(carry, scores, visible, vc_ref[pl.ds(first, block_k), :])

    lo, hi = ranges_ref[b, i, 0], ranges_ref[b, i, 1]
    carry = jax.lax.fori_loop(lo // block_k, pl.cdiv(hi, block_k), context_tile, carry)

    block_Rx1 = jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0) // (s * e)
    own = ko_ref.shape[0]
    own_visible = block_Rx1 == jax.lax.broadcasted_iota(jnp.int32, (1, own), 1) // s
    carry = _online(carry, _scores(q_RxD, ko_ref[...]), own_visible, vo_ref[...])
    if m:
        mem = km_ref.shape[0]
        mem_visible = (block_Rx1 == jax.lax.broadcasted_iota(jnp.int32, (1, mem), 1) // m) & (
            valid_ref[...] > 0
        )
        carry = _online(carry, _scores(q_RxD, km_ref[...]), mem_visible, vm_ref[...])
    _, l_Rx1, acc_RxD = carry
    o_ref[...] = (acc_RxD / l_Rx1).astype(o_ref.dtype)


def forward(
    q,
    k_ctx,
    v_ctx,
    k_blk,
    v_blk,
    anchors,
    starts,
    memory: BlockMemory | None,
    block_q: int,
    block_k: int,
    interpret: bool,
):
    """Block attention `[B, N, S, Q, D]` by the TPU kernel (inputs: `block_attention`'s)."""
    b, n, s, heads, d = q.shape
    t, g = k_ctx.shape[1], k_ctx.shape[2]
    e = heads // g
    tq = block_q
    n_pad, t_pad = -n % tq, -t % block_k
    pad_n = lambda x: jnp.pad(x, [(0, 0), (0, n_pad)] + [(0, 0)] * (x.ndim - 2))
    q, k_blk, v_blk, anchors, starts = (pad_n(x) for x in (q, k_blk, v_blk, anchors, starts))
    n_all = n + n_pad
    # [B, N, S, G*E, D] -> [B, G, N*S*E, D]: rows (block, slot, head of the group) of one KV head.
    q_BxGxNSExD = q.reshape(b, n_all, s, g, e, d).transpose(0, 3, 1, 2, 4, 5).reshape(b, g, n_all * s * e, d)
    kc_BxGxTxD, vc_BxGxTxD = (
        jnp.pad(x, [(0, 0), (0, t_pad), (0, 0), (0, 0)]).transpose(0, 2, 1, 3) for x in (k_ctx, v_ctx)
    )
    per_row = lambda x_BxN: jnp.repeat(x_BxN.astype(jnp.int32), s * e, axis=1)[..., None]  # [B, N*S*E, 1]
    rows = tq * s * e
    q_spec = pl.BlockSpec((None, None, rows, d), lambda bi, gi, i, r: (bi, gi, i, 0))
    row_spec = pl.BlockSpec((None, rows, 1), lambda bi, gi, i, r: (bi, i, 0))
    ctx_spec = pl.BlockSpec((None, None, t + t_pad, d), lambda bi, gi, i, r: (bi, gi, 0, 0))
    own_spec = pl.BlockSpec((None, None, tq * s, d), lambda bi, gi, i, r: (bi, gi, i, 0))
    inputs = [
        q_BxGxNSExD,
        per_row(anchors),
        per_row(starts),
        kc_BxGxTxD,
        vc_BxGxTxD,
        per_kv_head(k_blk),
        per_kv_head(v_blk),
    ]
    specs = [q_spec, row_spec, row_spec, ctx_spec, ctx_spec, own_spec, own_spec]
    m = 0
    if memory is not None:
        m = memory.valid_BxNxM.shape[2]
        mem_spec = pl.BlockSpec((None, None, tq * m, d), lambda bi, gi, i, r: (bi, gi, i, 0))
        # One [1, tq*M] slab per query tile: Mosaic takes a block equal to the array's last two dims at any
        # width, not a (1, tq*M) window of a [1, N*M] row unless tq*M is a multiple of 128 lanes.
        valid = pad_n(memory.valid_BxNxM).reshape(b, n_all // tq, 1, tq * m).astype(jnp.int32)
        inputs += [per_kv_head(pad_n(memory.k_BxNxMxGxD)), per_kv_head(pad_n(memory.v_BxNxMxGxD)), valid]
        specs += [
            mem_spec,
            mem_spec,
            pl.BlockSpec((None, None, 1, tq * m), lambda bi, gi, i, r: (bi, i, 0, 0)),
        ]
    out = pl.pallas_call(
        functools.partial(_kernel, s=s, e=e, m=m, block_k=block_k),
        out_shape=jax.ShapeDtypeStruct(q_BxGxNSExD.shape, q.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(b, g, n_all // tq), in_specs=specs, out_specs=q_spec
        ),
        interpret=interpret,
        name="dspark_block_attention",
    )(tile_ranges(anchors, starts, tq, t), *inputs)
    out = out.reshape(b, g, n_all, s, e, d).transpose(0, 2, 3, 1, 4, 5).reshape(b, n_all, s, heads, d)
    return out[:, :n]
