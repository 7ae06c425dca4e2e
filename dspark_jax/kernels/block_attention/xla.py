"""Chunked XLA block attention: a `lax.scan` over chunks of blocks with a rematerialised body.

No `[N*S, T]` score tensor per head is ever live; every chunk scores all `T` context positions (the
Pallas kernel skips the context tiles past a tile's largest anchor instead).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dspark_jax import sharding
from dspark_jax.kernels.block_attention.common import BlockMemory, per_kv_head


def _chunk_attention(
    q_BxCxSxQxD,
    k_ctx_BxGxTxD,
    v_ctx_BxGxTxD,
    k_blk_BxCxSxGxD,
    v_blk_BxCxSxGxD,
    anchors_BxC,
    starts_BxC,
    memory: BlockMemory | None,
):
    """Attention of C blocks (S slots each) over context + own memory + own slots; softmax in fp32.

    The context keys/values come heads-major (`per_kv_head`) and the queries are regrouped to match, so the
    two context products (the big ones) are batched matmuls over `B x G`: on a CPU, XLA runs the `[B, T, G,
    D]` layout's products several times slower."""
    b, c, s, heads, d = q_BxCxSxQxD.shape
    kv_heads, t = k_ctx_BxGxTxD.shape[1], k_ctx_BxGxTxD.shape[2]
    e = heads // kv_heads
    q_BxGxCxSxExD = (q_BxCxSxQxD.reshape(b, c, s, kv_heads, e, d) * (d**-0.5)).transpose(0, 3, 1, 2, 4, 5)
    neg = jnp.finfo(jnp.float32).min
    f32 = dict(preferred_element_type=jnp.float32)

    ctx_BxGxCSExT = jnp.einsum(
        "bgqd,bgtd->bgqt", q_BxGxCxSxExD.reshape(b, kv_heads, -1, d), k_ctx_BxGxTxD, **f32
    )
    j_T = jnp.arange(t)[None, None, :]
    ctx_visible_BxCxT = (j_T < anchors_BxC[:, :, None]) & (j_T >= starts_BxC[:, :, None])
    ctx_BxGxCxSxExT = jnp.where(
        ctx_visible_BxCxT[:, None, :, None, None, :], ctx_BxGxCSExT.reshape(b, kv_heads, c, s, e, t), neg
    )
    blk_BxGxCxSxExS = jnp.einsum("bgcsed,bcrgd->bgcser", q_BxGxCxSxExD, k_blk_BxCxSxGxD, **f32)
    parts = [ctx_BxGxCxSxExT, blk_BxGxCxSxExS]
    if memory is not None:
        mem = jnp.einsum("bgcsed,bcmgd->bgcsem", q_BxGxCxSxExD, memory.k_BxNxMxGxD, **f32)
        parts.append(jnp.where(memory.valid_BxNxM[:, None, :, None, None, :], mem, neg))
    peak = functools.reduce(jnp.maximum, [jnp.max(p, axis=-1, keepdims=True) for p in parts])
    exps = [
        jnp.exp(p - peak) for p in parts
    ]  # masked scores underflow to exactly 0: own slots keep peak finite
    total = sum(jnp.sum(e, axis=-1, keepdims=True) for e in exps)
    dtype = v_ctx_BxGxTxD.dtype
    ctx_probs = (exps[0] / total).astype(dtype).reshape(b, kv_heads, -1, t)
    out = jnp.einsum("bgqt,bgtd->bgqd", ctx_probs, v_ctx_BxGxTxD, **f32).reshape(b, kv_heads, c, s, e, d)
    out += jnp.einsum("bgcser,bcrgd->bgcsed", (exps[1] / total).astype(dtype), v_blk_BxCxSxGxD, **f32)
    if memory is not None:
        out += jnp.einsum("bgcsem,bcmgd->bgcsed", (exps[2] / total).astype(dtype), memory.v_BxNxMxGxD, **f32)
    return out.transpose(0, 2, 3, 1, 4, 5).reshape(b, c, s, heads, d).astype(q_BxCxSxQxD.dtype)


def _pad_blocks(x, n_pad):
    return jnp.pad(x, [(0, 0), (0, n_pad)] + [(0, 0)] * (x.ndim - 2)) if n_pad else x


def block_attention_xla(
    q_BxNxSxQxD,
    k_ctx_BxTxGxD,
    v_ctx_BxTxGxD,
    k_blk_BxNxSxGxD,
    v_blk_BxNxSxGxD,
    anchors_BxN,
    memory: BlockMemory | None = None,
    starts_BxN=None,
    *,
    anchor_chunk: int = 16,
    remat: bool = True,
) -> jax.Array:
    """Chunked XLA block attention; see the module docstring. Returns `[B, N, S, Q, D]`.

    `remat=False` stores every chunk's scores for the backward pass instead of recomputing them.
    """
    b, n = anchors_BxN.shape
    chunk = min(anchor_chunk, n)
    n_pad = -n % chunk
    if starts_BxN is None:
        starts_BxN = jnp.zeros_like(anchors_BxN)
    k_ctx_BxGxTxD, v_ctx_BxGxTxD = per_kv_head(k_ctx_BxTxGxD), per_kv_head(v_ctx_BxTxGxD)
    per_block = [q_BxNxSxQxD, k_blk_BxNxSxGxD, v_blk_BxNxSxGxD, anchors_BxN, starts_BxN]
    if memory is not None:
        per_block += list(memory)
    per_block = [_pad_blocks(x, n_pad) for x in per_block]
    chunks = [x.reshape(b, (n + n_pad) // chunk, chunk, *x.shape[2:]).swapaxes(0, 1) for x in per_block]

    def body(carry, xs):
        q, k_blk, v_blk, anchors, starts, *mem = xs
        mem = BlockMemory(*mem) if mem else None
        out = _chunk_attention(q, k_ctx_BxGxTxD, v_ctx_BxGxTxD, k_blk, v_blk, anchors, starts, mem)
        return carry, sharding.constrain(out, ("batch", None, None, "heads", None))

    if remat:
        body = jax.checkpoint(body)

    _, out = jax.lax.scan(body, None, chunks)
    out = out.swapaxes(0, 1).reshape(b, n + n_pad, *q_BxNxSxQxD.shape[2:])
    return out[:, :n]
