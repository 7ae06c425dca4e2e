"""DSpark block attention: every anchor block attends to its own prefix context, memory and slots.

Queries are the `S` slots of `N` anchor blocks (letters: the legend in `dspark_jax/__init__.py`).
Block `n` with anchor `a_n` sees context positions `start_n <= j < a_n` (`start_n` = 0, or the first
position of the block's own sample in a packed row), its optional `M` memory slots (Draft Memory), and
its own `S` slots (bidirectionally) -- nothing of other blocks. Context keys and values are shared by
all blocks; those of memory and slots are per block.

`block_attention` is the one entry point, over three implementations laid out as JAX's own Pallas ops:

- `reference.py`: dense `[N*S, T + N*M + N*S]` masked attention (tests and benchmarks only);
- `xla.py`: a `lax.scan` over chunks of `anchor_chunk` blocks, memory-bounded, any backend;
- `pallas.py`: the Pallas kernels with `BlockSizes`, one per platform (`pallas_tpu.py` for TPU through
  Mosaic, `pallas_gpu.py` for NVIDIA Hopper through Mosaic GPU) behind one custom VJP; query tiles skip
  the context past their largest anchor; `interpret=True` runs them anywhere.

`implementation='pallas'` runs the kernel of the backend (TPU, or a GPU: Hopper, 16-bit inputs); on a
backend without one, or fp32 inputs on a GPU, it falls back to XLA and says so once in the log.
`'auto'` picks Pallas on `AUTO_BACKENDS` (TPU) and XLA elsewhere: the GPU kernel is tested in JAX's GPU
interpret mode and compiled for H200 ahead of time on a CPU host, but not yet run on a GPU, so it is
chosen explicitly until `benchmarks/gpu_check.sh` has passed on one. The backend is the platform being
compiled for: that of the devices of the mesh set with `jax.set_mesh` (ahead-of-time compiles for a
topology from a CPU host, `dspark_jax.training.aot`), else JAX's default backend. The kernels' tiles
(`BlockSizes`) are the config keys `draft.attention_block_q` and `draft.attention_block_k`.
"""

from __future__ import annotations

import logging

import jax

from dspark_jax.kernels.backend import target_backend
from dspark_jax.kernels.block_attention import pallas_gpu
from dspark_jax.kernels.block_attention.common import BlockMemory
from dspark_jax.kernels.block_attention.pallas import DEFAULT_BLOCK_SIZES, BlockSizes, block_attention_pallas
from dspark_jax.kernels.block_attention.reference import block_attention_reference
from dspark_jax.kernels.block_attention.xla import block_attention_xla

__all__ = [
    "AUTO_BACKENDS",
    "DEFAULT_BLOCK_SIZES",
    "IMPLEMENTATIONS",
    "PALLAS_BACKENDS",
    "BlockMemory",
    "BlockSizes",
    "block_attention",
    "resolve_implementation",
    "target_backend",
]

log = logging.getLogger(__name__)

IMPLEMENTATIONS = ("auto", "pallas", "xla", "reference")
PALLAS_BACKENDS = ("tpu", "gpu")  # backends with a compiled Pallas kernel
AUTO_BACKENDS = ("tpu",)  # backends where 'auto' picks it
_WARNED: set[str] = set()


def _warn_once(key: str, message: str, *args) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning(message, *args)


def resolve_implementation(implementation: str, interpret: bool = False, backend: str | None = None) -> str:
    """The implementation that runs on `backend` (default `target_backend()`): 'auto' is 'pallas' on
    `AUTO_BACKENDS`, else 'xla'; 'pallas' becomes 'xla' on a backend without a kernel, with one log line
    per backend; with `interpret` both are 'pallas'."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"unknown block attention implementation {implementation!r}; use one of {IMPLEMENTATIONS}"
        )
    backend = backend or target_backend()
    if interpret or implementation not in ("auto", "pallas"):
        return "pallas" if implementation == "auto" else implementation
    if implementation == "auto":
        return "pallas" if backend in AUTO_BACKENDS else "xla"
    if backend not in PALLAS_BACKENDS:
        _warn_once(
            backend,
            "block attention: no Pallas lowering for backend %r (compiled kernels: %s); using the chunked "
            "XLA implementation",
            backend,
            ", ".join(PALLAS_BACKENDS),
        )
        return "xla"
    return "pallas"


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
    block_sizes: BlockSizes = DEFAULT_BLOCK_SIZES,
    interpret: bool = False,
) -> jax.Array:
    """Block attention `[B, N, S, Q, D]` (queries of N blocks x S slots, Q heads).

    Args:
      q_BxNxSxQxD: block queries (RoPE applied at positions `a + i`, slot `i`).
      k_ctx_BxTxGxD / v_ctx_BxTxGxD: context keys/values (RoPE at positions `j`).
      k_blk_BxNxSxGxD / v_blk_BxNxSxGxD: the blocks' own keys/values.
      anchors_BxN: anchor position of each block (sorted along N); context `j < a` is visible.
      memory: optional per-block memory keys/values with a validity mask.
      starts_BxN: first visible context position of each block (its sample's first position in a
        packed row); None = 0.
      implementation: one of `IMPLEMENTATIONS` (see the module docstring).
      anchor_chunk: blocks per chunk of the XLA implementation (and of the Pallas kernel's backward).
      remat: recompute each chunk in the backward pass (XLA implementation).
      block_sizes: the Pallas kernel's tiles.
      interpret: run the portable (TPU) Pallas kernel in interpret mode on any backend (tests; the GPU
        kernel's: `pallas.block_attention_pallas(..., platform='gpu', interpret=True)`).
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
    backend = target_backend()
    chosen = resolve_implementation(implementation, interpret, backend)
    platform = "gpu" if backend == "gpu" and not interpret else "tpu"
    if chosen == "pallas" and platform == "gpu" and not pallas_gpu.supports(q_BxNxSxQxD.dtype):
        _warn_once(
            f"gpu-{q_BxNxSxQxD.dtype}",
            "block attention: the GPU kernel takes bf16/f16 inputs, not %s; using the chunked XLA "
            "implementation",
            q_BxNxSxQxD.dtype,
        )
        chosen = "xla"
    if chosen == "pallas":
        return block_attention_pallas(
            *args, platform=platform, block_sizes=block_sizes, interpret=interpret, anchor_chunk=anchor_chunk
        )
    if chosen == "xla":
        return block_attention_xla(*args, anchor_chunk=anchor_chunk, remat=remat)
    return block_attention_reference(*args)
