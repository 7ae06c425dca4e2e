"""DSpark block attention: every anchor block attends to its own prefix context, memory and slots.

Queries are the `S` slots of `N` anchor blocks (letters: the legend in `dspark_jax/__init__.py`).
Block `n` with anchor `a_n` sees context positions `start_n <= j < a_n` (`start_n` = 0, or the first
position of the block's own sample in a packed row), its optional `M` memory slots (Draft Memory), and
its own `S` slots (bidirectionally) -- nothing of other blocks. Context keys and values are shared by
all blocks; those of memory and slots are per block.

`block_attention` is the one entry point, over three implementations laid out as JAX's own Pallas ops:

- `reference.py`: dense `[N*S, T + N*M + N*S]` masked attention (tests and benchmarks only);
- `xla.py`: a `lax.scan` over chunks of `anchor_chunk` blocks, memory-bounded, any backend;
- `pallas.py`: the Pallas kernel with `BlockSizes`; query tiles skip the context past their largest
  anchor; compiled on TPU (Mosaic), or anywhere with `interpret=True`.

`implementation='auto'` picks Pallas on a backend with a Pallas lowering of this kernel (TPU) and XLA
elsewhere; `'pallas'` on a backend without one falls back to XLA and says so once in the log. The
backend is the platform being compiled for: that of the devices of the mesh set with `jax.set_mesh`
(ahead-of-time compiles for a TPU topology from a CPU host, `dspark_jax.train.aot`), else JAX's
default backend. The kernel's tiles (`BlockSizes`) are the config keys `draft.attention_block_q` and
`draft.attention_block_k`.
"""

from __future__ import annotations

import logging

import jax

from dspark_jax.kernels.block_attention.common import BlockMemory
from dspark_jax.kernels.block_attention.pallas import DEFAULT_BLOCK_SIZES, BlockSizes, block_attention_pallas
from dspark_jax.kernels.block_attention.reference import block_attention_reference
from dspark_jax.kernels.block_attention.xla import block_attention_xla

__all__ = [
    "DEFAULT_BLOCK_SIZES",
    "IMPLEMENTATIONS",
    "BlockMemory",
    "BlockSizes",
    "block_attention",
    "resolve_implementation",
    "target_backend",
]

log = logging.getLogger(__name__)

IMPLEMENTATIONS = ("auto", "pallas", "xla", "reference")
PALLAS_BACKENDS = ("tpu",)  # backends with a compiled lowering of the Pallas kernel
_WARNED: set[str] = set()


def target_backend() -> str:
    """The platform being compiled for: the current mesh's devices' (`jax.set_mesh`), else the default."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    return device.platform if device is not None else jax.default_backend()


def resolve_implementation(implementation: str, interpret: bool = False, backend: str | None = None) -> str:
    """The implementation that runs on `backend` (default `target_backend()`): 'auto' and 'pallas' become
    'xla' on a backend without a Pallas lowering (unless `interpret`), the latter with one log line per
    backend."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"unknown block attention implementation {implementation!r}; use one of {IMPLEMENTATIONS}"
        )
    backend = backend or target_backend()
    if implementation in ("auto", "pallas") and not interpret and backend not in PALLAS_BACKENDS:
        if implementation == "pallas" and backend not in _WARNED:
            _WARNED.add(backend)
            log.warning(
                "block attention: no Pallas lowering for backend %r (compiled kernels: %s); using the "
                "chunked XLA implementation",
                backend,
                ", ".join(PALLAS_BACKENDS),
            )
        return "xla"
    return "pallas" if implementation == "auto" else implementation


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
      interpret: run the Pallas kernel in interpret mode (any backend; tests).
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
    chosen = resolve_implementation(implementation, interpret)
    if chosen == "pallas":
        return block_attention_pallas(
            *args, block_sizes=block_sizes, interpret=interpret, anchor_chunk=anchor_chunk
        )
    if chosen == "xla":
        return block_attention_xla(*args, anchor_chunk=anchor_chunk, remat=remat)
    return block_attention_reference(*args)
