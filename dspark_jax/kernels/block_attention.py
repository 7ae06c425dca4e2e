"""DSpark block attention: every anchor block attends to its own prefix context and its own slots.

Queries are the `K` slots of `N` anchor blocks. Block `n` with anchor `a_n` sees context
positions `j < a_n`, its optional memory slots (Draft Memory), and its own `K` slots
(bidirectionally) — nothing of other blocks. Keys and values of the context are shared by
all blocks; those of memory and slots are per block.

`block_attention` is the one entry point. `implementation='xla'` runs a memory-bounded
XLA version: a `lax.scan` over chunks of `anchor_chunk` blocks with a rematerialised body,
so no `N*K x T` score tensor per head is ever live. `block_attention_reference` builds the
dense `[N*K, T + N*M + N*K]` mask and is for tests and benchmarks only.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dspark_jax import sharding
from dspark_jax.nn import gqa_attention


class BlockMemory(NamedTuple):
    """Per-block extra keys/values visible only to their own block (Draft Memory)."""

    k_BxNxMxKxD: jax.Array
    v_BxNxMxKxD: jax.Array
    valid_BxNxM: jax.Array


def _chunk_attention(
    q_BxCxSxNxD,
    k_ctx_BxTxKxD,
    v_ctx_BxTxKxD,
    k_blk_BxCxSxKxD,
    v_blk_BxCxSxKxD,
    anchors_BxC,
    memory: BlockMemory | None,
):
    """Attention of C blocks (S slots each) over context + own memory + own slots; softmax in fp32."""
    b, c, s, n, d = q_BxCxSxNxD.shape
    kv = k_ctx_BxTxKxD.shape[2]
    t = k_ctx_BxTxKxD.shape[1]
    q = q_BxCxSxNxD.reshape(b, c, s, kv, n // kv, d) * (d**-0.5)
    neg = jnp.finfo(jnp.float32).min
    f32 = dict(preferred_element_type=jnp.float32)

    ctx_BxCxSxKxGxT = jnp.einsum("bcskgd,btkd->bcskgt", q, k_ctx_BxTxKxD, **f32)
    ctx_visible_BxCxT = jnp.arange(t)[None, None, :] < anchors_BxC[:, :, None]
    ctx_BxCxSxKxGxT = jnp.where(ctx_visible_BxCxT[:, :, None, None, None, :], ctx_BxCxSxKxGxT, neg)
    blk_BxCxSxKxGxS = jnp.einsum("bcskgd,bcrkd->bcskgr", q, k_blk_BxCxSxKxD, **f32)
    parts = [ctx_BxCxSxKxGxT, blk_BxCxSxKxGxS]
    if memory is not None:
        mem = jnp.einsum("bcskgd,bcmkd->bcskgm", q, memory.k_BxNxMxKxD, **f32)
        parts.append(jnp.where(memory.valid_BxNxM[:, :, None, None, None, :], mem, neg))
    peak = functools.reduce(jnp.maximum, [jnp.max(p, axis=-1, keepdims=True) for p in parts])
    exps = [
        jnp.exp(p - peak) for p in parts
    ]  # masked scores underflow to exactly 0: own slots keep peak finite
    total = sum(jnp.sum(e, axis=-1, keepdims=True) for e in exps)
    dtype = v_ctx_BxTxKxD.dtype
    out = jnp.einsum("bcskgt,btkd->bcskgd", (exps[0] / total).astype(dtype), v_ctx_BxTxKxD, **f32)
    out += jnp.einsum("bcskgr,bcrkd->bcskgd", (exps[1] / total).astype(dtype), v_blk_BxCxSxKxD, **f32)
    if memory is not None:
        out += jnp.einsum("bcskgm,bcmkd->bcskgd", (exps[2] / total).astype(dtype), memory.v_BxNxMxKxD, **f32)
    return out.reshape(b, c, s, n, d).astype(q_BxCxSxNxD.dtype)


def _pad_blocks(x, n_pad):
    return jnp.pad(x, [(0, 0), (0, n_pad)] + [(0, 0)] * (x.ndim - 2)) if n_pad else x


def block_attention_xla(
    q_BxNxSxHxD,
    k_ctx_BxTxKxD,
    v_ctx_BxTxKxD,
    k_blk_BxNxSxKxD,
    v_blk_BxNxSxKxD,
    anchors_BxN,
    memory: BlockMemory | None = None,
    *,
    anchor_chunk: int = 16,
) -> jax.Array:
    """Chunked XLA block attention; see the module docstring. Returns `[B, N, S, H, D]`."""
    b, n = anchors_BxN.shape
    chunk = min(anchor_chunk, n)
    n_pad = -n % chunk
    per_block = [q_BxNxSxHxD, k_blk_BxNxSxKxD, v_blk_BxNxSxKxD, anchors_BxN]
    if memory is not None:
        per_block += list(memory)
    per_block = [_pad_blocks(x, n_pad) for x in per_block]
    chunks = [x.reshape(b, (n + n_pad) // chunk, chunk, *x.shape[2:]).swapaxes(0, 1) for x in per_block]

    @jax.checkpoint
    def body(carry, xs):
        q, k_blk, v_blk, anchors, *mem = xs
        mem = BlockMemory(*mem) if mem else None
        out = _chunk_attention(q, k_ctx_BxTxKxD, v_ctx_BxTxKxD, k_blk, v_blk, anchors, mem)
        return carry, sharding.constrain(out, ("batch", None, None, "heads", None))

    _, out = jax.lax.scan(body, None, chunks)
    out = out.swapaxes(0, 1).reshape(b, n + n_pad, *q_BxNxSxHxD.shape[2:])
    return out[:, :n]


def block_attention_reference(
    q_BxNxSxHxD,
    k_ctx_BxTxKxD,
    v_ctx_BxTxKxD,
    k_blk_BxNxSxKxD,
    v_blk_BxNxSxKxD,
    anchors_BxN,
    memory: BlockMemory | None = None,
) -> jax.Array:
    """Dense masked attention over `[context; all memory; all slots]`: O(N*S*(T+N*S)) memory."""
    b, n, s, h, d = q_BxNxSxHxD.shape
    t = k_ctx_BxTxKxD.shape[1]
    block_of_query = jnp.repeat(jnp.arange(n), s)
    keys = [k_ctx_BxTxKxD, k_blk_BxNxSxKxD.reshape(b, n * s, *k_blk_BxNxSxKxD.shape[3:])]
    values = [v_ctx_BxTxKxD, v_blk_BxNxSxKxD.reshape(b, n * s, *v_blk_BxNxSxKxD.shape[3:])]
    anchor_of_query_BxQ = anchors_BxN[:, block_of_query]
    visible = [
        jnp.arange(t)[None, None, :] < anchor_of_query_BxQ[:, :, None],
        jnp.broadcast_to(block_of_query[:, None] == block_of_query[None, :], (b, n * s, n * s)),
    ]
    if memory is not None:
        m = memory.valid_BxNxM.shape[2]
        keys.append(memory.k_BxNxMxKxD.reshape(b, n * m, *memory.k_BxNxMxKxD.shape[3:]))
        values.append(memory.v_BxNxMxKxD.reshape(b, n * m, *memory.v_BxNxMxKxD.shape[3:]))
        block_of_mem = jnp.repeat(jnp.arange(n), m)
        own = block_of_query[:, None] == block_of_mem[None, :]
        visible.append(own[None] & memory.valid_BxNxM.reshape(b, 1, n * m))
    out = gqa_attention(
        q_BxNxSxHxD.reshape(b, n * s, h, d),
        jnp.concatenate(keys, 1),
        jnp.concatenate(values, 1),
        jnp.concatenate(visible, -1),
    )
    return out.reshape(b, n, s, h, d)


def block_attention(
    q_BxNxSxHxD,
    k_ctx_BxTxKxD,
    v_ctx_BxTxKxD,
    k_blk_BxNxSxKxD,
    v_blk_BxNxSxKxD,
    anchors_BxN,
    memory: BlockMemory | None = None,
    *,
    implementation: str = "xla",
    anchor_chunk: int = 16,
) -> jax.Array:
    """Block attention `[B, N, S, H, D]` (queries of N blocks x S slots, H heads).

    Args:
      q_BxNxSxHxD: block queries (RoPE applied at positions `a + k`).
      k_ctx_BxTxKxD / v_ctx_BxTxKxD: context keys/values (RoPE at positions `j`).
      k_blk_BxNxSxKxD / v_blk_BxNxSxKxD: the blocks' own keys/values.
      anchors_BxN: anchor position of each block; context `j < a` is visible.
      memory: optional per-block memory keys/values with a validity mask.
      implementation: 'xla' (chunked, memory-bounded) or 'reference' (dense, tests only).
      anchor_chunk: blocks per chunk of the XLA implementation.
    """
    args = (q_BxNxSxHxD, k_ctx_BxTxKxD, v_ctx_BxTxKxD, k_blk_BxNxSxKxD, v_blk_BxNxSxKxD, anchors_BxN, memory)
    if implementation == "xla":
        return block_attention_xla(*args, anchor_chunk=anchor_chunk)
    if implementation == "reference":
        return block_attention_reference(*args)
    raise ValueError(f"unknown block attention implementation {implementation!r}; use 'xla' or 'reference'")
