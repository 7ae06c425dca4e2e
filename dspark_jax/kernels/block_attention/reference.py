"""Dense masked block attention over `[context; all memory; all slots]`: the tests' reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dspark_jax.kernels.block_attention.common import BlockMemory
from dspark_jax.nn import gqa_attention


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
