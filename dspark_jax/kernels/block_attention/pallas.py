"""Pallas block attention: the per-platform forward kernels behind one custom VJP.

- `pallas_tpu.py`: TPU through Mosaic (portable Pallas plus scalar prefetch; query tiles of `block_q`
  blocks, context tiles of `block_k` positions);
- `pallas_gpu.py`: NVIDIA Hopper through Mosaic GPU (warpgroup tiles of 64 query rows, TMA-fed key
  tiles of `block_k`, rounded to fit shared memory; 16-bit inputs).

Both skip the context past each query tile's largest anchor and read only the tile's own blocks' slots
and memory. `platform` picks the kernel ('tpu' or 'gpu'); `interpret=True` runs it on any backend (JAX's
TPU, or GPU, interpret mode: the CPU tests).

Backward: a custom VJP whose backward pass is the chunked XLA implementation's (`xla.py`), recomputing
the attention from the inputs (one extra forward of the XLA path per backward; no Pallas backward yet).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from dspark_jax.kernels.block_attention import pallas_gpu, pallas_tpu, xla
from dspark_jax.kernels.block_attention.common import BlockMemory

PLATFORMS = ("tpu", "gpu")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes: `block_q` blocks per query tile (TPU; on GPU a query tile is one warpgroup's 64 rows),
    `block_k` keys per key tile (on GPU rounded down to a multiple of 64 that fits shared memory)."""

    block_q: int = 8
    block_k: int = 128

    def __post_init__(self):
        if self.block_q < 1 or self.block_k < 1:
            raise ValueError(f"BlockSizes must be positive, got {self}")


DEFAULT_BLOCK_SIZES = BlockSizes()


def _forward(q, k_ctx, v_ctx, k_blk, v_blk, anchors, starts, memory, platform, sizes, interpret):
    if platform == "gpu":
        return pallas_gpu.forward(
            q, k_ctx, v_ctx, k_blk, v_blk, anchors, starts, memory, sizes.block_k, interpret
        )
    return pallas_tpu.forward(
        q, k_ctx, v_ctx, k_blk, v_blk, anchors, starts, memory, sizes.block_q, sizes.block_k, interpret
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10, 11))
def _attention(
    q, k_ctx, v_ctx, k_blk, v_blk, anchors, starts, memory, platform, sizes, interpret, anchor_chunk
):
    return _forward(q, k_ctx, v_ctx, k_blk, v_blk, anchors, starts, memory, platform, sizes, interpret)


def _attention_fwd(
    q, k_ctx, v_ctx, k_blk, v_blk, anchors, starts, memory, platform, sizes, interpret, anchor_chunk
):
    out = _forward(q, k_ctx, v_ctx, k_blk, v_blk, anchors, starts, memory, platform, sizes, interpret)
    return out, (q, k_ctx, v_ctx, k_blk, v_blk, anchors, starts, memory)


def _attention_bwd(platform, sizes, interpret, anchor_chunk, residuals, cot):
    """The chunked XLA path's VJP, recomputed from the inputs; integer and mask inputs get no gradient."""
    q, k_ctx, v_ctx, k_blk, v_blk, anchors, starts, memory = residuals
    mem_kv = None if memory is None else (memory.k_BxNxMxGxD, memory.v_BxNxMxGxD)

    def f(q, k_ctx, v_ctx, k_blk, v_blk, mem_kv):
        mem = None if mem_kv is None else BlockMemory(*mem_kv, memory.valid_BxNxM)
        return xla.block_attention_xla(
            q, k_ctx, v_ctx, k_blk, v_blk, anchors, mem, starts, anchor_chunk=anchor_chunk, remat=True
        )

    _, vjp = jax.vjp(f, q, k_ctx, v_ctx, k_blk, v_blk, mem_kv)
    dq, dkc, dvc, dkb, dvb, dmem = vjp(cot)
    dmemory = None if memory is None else BlockMemory(*dmem, None)
    return dq, dkc, dvc, dkb, dvb, None, None, dmemory


_attention.defvjp(_attention_fwd, _attention_bwd)


def block_attention_pallas(
    q_BxNxSxQxD,
    k_ctx_BxTxGxD,
    v_ctx_BxTxGxD,
    k_blk_BxNxSxGxD,
    v_blk_BxNxSxGxD,
    anchors_BxN,
    memory: BlockMemory | None = None,
    starts_BxN=None,
    *,
    platform: str = "tpu",
    block_sizes: BlockSizes = DEFAULT_BLOCK_SIZES,
    interpret: bool = False,
    anchor_chunk: int = 16,
) -> jax.Array:
    """Pallas block attention `[B, N, S, Q, D]` by the kernel of `platform` (`PLATFORMS`); see the module
    docstring (`anchor_chunk`: the chunk size of the XLA backward)."""
    if platform not in PLATFORMS:
        raise ValueError(
            f"no Pallas block attention kernel for platform {platform!r}; use one of {PLATFORMS}"
        )
    if starts_BxN is None:
        starts_BxN = jnp.zeros_like(anchors_BxN)
    return _attention(
        q_BxNxSxQxD,
        k_ctx_BxTxGxD,
        v_ctx_BxTxGxD,
        k_blk_BxNxSxGxD,
        v_blk_BxNxSxGxD,
        anchors_BxN,
        starts_BxN,
        memory,
        platform,
        block_sizes,
        interpret,
        anchor_chunk,
    )
