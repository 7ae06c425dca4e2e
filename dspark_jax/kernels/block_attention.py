"""DSpark block attention: every anchor block attends to its own prefix context and its own slots.

Queries are the `S` slots of `N` anchor blocks (letters: the legend in `dspark_jax/__init__.py`).
Block `n` with anchor `a_n` sees context positions `start_n <= j < a_n` (`start_n` = 0, or the first
position of the block's own sample in a packed row), its optional `M` memory slots
(Draft Memory), and its own `S` slots (bidirectionally) — nothing of other blocks. Keys and
values of the context are shared by all blocks; those of memory and slots are per block.

`block_attention` is the one entry point. `implementation='xla'` runs a memory-bounded
XLA version: a `lax.scan` over chunks of `anchor_chunk` blocks with a rematerialised body,
so no `NS x T` score tensor per head is ever live. `block_attention_reference` builds the
dense `[NS, T + NM + NS]` mask and is for tests and benchmarks only.
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

    k_BxNxMxGxD: jax.Array
    v_BxNxMxGxD: jax.Array
    valid_BxNxM: jax.Array


def _chunk_attention(
    q_BxCxSxQxD,
    k_ctx_BxTxGxD,
    v_ctx_BxTxGxD,
    k_blk_BxCxSxGxD,
    v_blk_BxCxSxGxD,
    anchors_BxC,
    starts_BxC,
    memory: BlockMemory | None,
):
    """Attention of C blocks (S slots each) over context + own memory + own slots; softmax in fp32."""
    b, c, s, heads, d = q_BxCxSxQxD.shape
    kv_heads = k_ctx_BxTxGxD.shape[2]
    t = k_ctx_BxTxGxD.shape[1]
    q_BxCxSxGxExD = q_BxCxSxQxD.reshape(b, c, s, kv_heads, heads // kv_heads, d) * (d**-0.5)
    neg = jnp.finfo(jnp.float32).min
    f32 = dict(preferred_element_type=jnp.float32)

    ctx_BxCxSxGxExT = jnp.einsum("bcsged,btgd->bcsget", q_BxCxSxGxExD, k_ctx_BxTxGxD, **f32)
    j_T = jnp.arange(t)[None, None, :]
    ctx_visible_BxCxT = (j_T < anchors_BxC[:, :, None]) & (j_T >= starts_BxC[:, :, None])
    ctx_BxCxSxGxExT = jnp.where(ctx_visible_BxCxT[:, :, None, None, None, :], ctx_BxCxSxGxExT, neg)
    blk_BxCxSxGxExS = jnp.einsum("bcsged,bcrgd->bcsger", q_BxCxSxGxExD, k_blk_BxCxSxGxD, **f32)
    parts = [ctx_BxCxSxGxExT, blk_BxCxSxGxExS]
    if memory is not None:
        mem = jnp.einsum("bcsged,bcmgd->bcsgem", q_BxCxSxGxExD, memory.k_BxNxMxGxD, **f32)
        parts.append(jnp.where(memory.valid_BxNxM[:, :, None, None, None, :], mem, neg))
    peak = functools.reduce(jnp.maximum, [jnp.max(p, axis=-1, keepdims=True) for p in parts])
    exps = [
        jnp.exp(p - peak) for p in parts
    ]  # masked scores underflow to exactly 0: own slots keep peak finite
    total = sum(jnp.sum(e, axis=-1, keepdims=True) for e in exps)
    dtype = v_ctx_BxTxGxD.dtype
    out = jnp.einsum("bcsget,btgd->bcsged", (exps[0] / total).astype(dtype), v_ctx_BxTxGxD, **f32)
    out += jnp.einsum("bcsger,bcrgd->bcsged", (exps[1] / total).astype(dtype), v_blk_BxCxSxGxD, **f32)
    if memory is not None:
        out += jnp.einsum("bcsgem,bcmgd->bcsged", (exps[2] / total).astype(dtype), memory.v_BxNxMxGxD, **f32)
    return out.reshape(b, c, s, heads, d).astype(q_BxCxSxQxD.dtype)


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
    per_block = [q_BxNxSxQxD, k_blk_BxNxSxGxD, v_blk_BxNxSxGxD, anchors_BxN, starts_BxN]
    if memory is not None:
        per_block += list(memory)
    per_block = [_pad_blocks(x, n_pad) for x in per_block]
    chunks = [x.reshape(b, (n + n_pad) // chunk, chunk, *x.shape[2:]).swapaxes(0, 1) for x in per_block]

    def body(carry, xs):
        q, k_blk, v_blk, anchors, starts, *mem = xs
        mem = BlockMemory(*mem) if mem else None
        out = _chunk_attention(q, k_ctx_BxTxGxD, v_ctx_BxTxGxD, k_blk, v_blk, anchors, starts, mem)
        return carry, sharding.constrain(out, ("batch", None, None, "heads", None))

    if remat:
        body = jax.checkpoint(body)

    _, out = jax.lax.scan(body, None, chunks)
    out = out.swapaxes(0, 1).reshape(b, n + n_pad, *q_BxNxSxQxD.shape[2:])
    return out[:, :n]


def block_attention_reference(
    q_BxNxSxQxD,
    k_ctx_BxTxGxD,
    v_ctx_BxTxGxD,
    k_blk_BxNxSxGxD,
    v_blk_BxNxSxGxD,
    anchors_BxN,
    memory: BlockMemory | None = None,
    starts_BxN=None,
) -> jax.Array:
    """Dense masked attention over `[context; all memory; all slots]`: O(NS * (T + NM + NS)) memory."""
    b, n, s, heads, d = q_BxNxSxQxD.shape
    t = k_ctx_BxTxGxD.shape[1]
    block_of_query = jnp.repeat(jnp.arange(n), s)
    keys = [k_ctx_BxTxGxD, k_blk_BxNxSxGxD.reshape(b, n * s, *k_blk_BxNxSxGxD.shape[3:])]
    values = [v_ctx_BxTxGxD, v_blk_BxNxSxGxD.reshape(b, n * s, *v_blk_BxNxSxGxD.shape[3:])]
    anchor_of_query_BxNS = anchors_BxN[:, block_of_query]
    start_of_query_BxNS = (jnp.zeros_like(anchors_BxN) if starts_BxN is None else starts_BxN)[
        :, block_of_query
    ]
    j_T = jnp.arange(t)[None, None, :]
    visible = [
        (j_T < anchor_of_query_BxNS[:, :, None]) & (j_T >= start_of_query_BxNS[:, :, None]),
        jnp.broadcast_to(block_of_query[:, None] == block_of_query[None, :], (b, n * s, n * s)),
    ]
    if memory is not None:
        m = memory.valid_BxNxM.shape[2]
        keys.append(memory.k_BxNxMxGxD.reshape(b, n * m, *memory.k_BxNxMxGxD.shape[3:]))
        values.append(memory.v_BxNxMxGxD.reshape(b, n * m, *memory.v_BxNxMxGxD.shape[3:]))
        block_of_mem = jnp.repeat(jnp.arange(n), m)
        own = block_of_query[:, None] == block_of_mem[None, :]
        visible.append(own[None] & memory.valid_BxNxM.reshape(b, 1, n * m))
    out = gqa_attention(
        q_BxNxSxQxD.reshape(b, n * s, heads, d),
        jnp.concatenate(keys, 1),
        jnp.concatenate(values, 1),
        jnp.concatenate(visible, -1),
    )
    return out.reshape(b, n, s, heads, d)


def block_attention(
    q_BxNxSxQxD,
    k_ctx_BxTxGxD,
    v_ctx_BxTxGxD,
    k_blk_BxNxSxGxD,
    v_blk_BxNxSxGxD,
    anchors_BxN,
    memory: BlockMemory | None = None,
    starts_BxN=None,
    *,
    implementation: str = "xla",
    anchor_chunk: int = 16,
    remat: bool = True,
) -> jax.Array:
    """Block attention `[B, N, S, Q, D]` (queries of N blocks x S slots, Q heads).

    Args:
      q_BxNxSxQxD: block queries (RoPE applied at positions `a + i`, slot `i`).
      k_ctx_BxTxGxD / v_ctx_BxTxGxD: context keys/values (RoPE at positions `j`).
      k_blk_BxNxSxGxD / v_blk_BxNxSxGxD: the blocks' own keys/values.
      anchors_BxN: anchor position of each block; context `j < a` is visible.
      memory: optional per-block memory keys/values with a validity mask.
      starts_BxN: first visible context position of each block (its sample's first position in a
        packed row); None = 0.
      implementation: 'xla' (chunked, memory-bounded) or 'reference' (dense, tests only).
      anchor_chunk: blocks per chunk of the XLA implementation.
      remat: recompute each chunk in the backward pass (XLA implementation).
    """
    args = (
        q_BxNxSxQxD,
        k_ctx_BxTxGxD,
        v_ctx_BxTxGxD,
        k_blk_BxNxSxGxD,
        v_blk_BxNxSxGxD,
        anchors_BxN,
        memory,
        starts_BxN,
    )
    if implementation == "xla":
        return block_attention_xla(*args, anchor_chunk=anchor_chunk, remat=remat)
    if implementation == "reference":
        return block_attention_reference(*args)
    raise ValueError(f"unknown block attention implementation {implementation!r}; use 'xla' or 'reference'")
