"""Routed experts: `y[t] = sum_k w[t, k] * SwiGLU_{ids[t, k]}(x[t])` at the cost of the routed rows.

`routed_swiglu` is the one entry point, over implementations laid out as block attention's are:

- `reference.py`: every token through every expert, weighted by a dense routing matrix (tests and the
  benchmark's baseline);
- `tiled.py`: pairs sorted by expert and padded per expert to whole tiles of rows, a `lax.scan` over the
  live tiles adding into the tokens' sums (exact, no token dropped, any backend, `[T, H]` of memory);
- `ragged.py`: `jax.lax.ragged_dot` over the sorted pairs, a grouped matmul on TPU (and a masked dense dot
  over every expert on CPU and GPU).

`'auto'` picks 'ragged_dot' on TPU and 'tiled' elsewhere; the backend is the platform being compiled for
(`kernels.backend.target_backend`), so an ahead-of-time compile for a GPU topology on a CPU host compiles
the GPU's choice. Evaluated and not used (JAX 0.10.2): Pallas megablox `gmm` (TPU only compiled; on CPU
only in interpret mode, a Python-level grid), Pallas Mosaic-GPU `ragged_dot_mgpu` (Hopper only, no VJP, not
runnable here), `tokamax.ragged_dot` (its CPU path is `lax.ragged_dot`'s dense rewrite; its GPU kernels
untested without a GPU). Experts held elsewhere (`first_expert`, expert parallelism) add nothing.
"""

from __future__ import annotations

import jax

from dspark_jax.kernels.backend import target_backend
from dspark_jax.kernels.experts.plan import Plan, combine, plan
from dspark_jax.kernels.experts.ragged import ragged_swiglu
from dspark_jax.kernels.experts.reference import dense_swiglu
from dspark_jax.kernels.experts.tiled import default_tile, tiled_swiglu

__all__ = [
    "IMPLEMENTATIONS",
    "Plan",
    "check_implementation",
    "default_tile",
    "dense_swiglu",
    "plan",
    "resolve_implementation",
    "routed_swiglu",
]

IMPLEMENTATIONS = ("auto", "tiled", "ragged_dot", "dense")


def check_implementation(implementation: str) -> None:
    """A `ValueError` naming the choices unless `implementation` is one of `IMPLEMENTATIONS`."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"unknown experts implementation {implementation!r}; use one of {IMPLEMENTATIONS}")


def resolve_implementation(implementation: str, backend: str | None = None) -> str:
    """The implementation that runs on `backend` (default `target_backend()`): 'auto' is 'ragged_dot' on
    TPU and 'tiled' elsewhere."""
    check_implementation(implementation)
    if implementation != "auto":
        return implementation
    return "ragged_dot" if (backend or target_backend()) == "tpu" else "tiled"


def routed_swiglu(
    x_TxH: jax.Array,
    ids_TxK: jax.Array,
    weights_TxK: jax.Array,
    gate_XxHxI: jax.Array,
    up_XxHxI: jax.Array,
    down_XxIxH: jax.Array,
    *,
    first_expert: jax.Array | int = 0,
    implementation: str = "auto",
    tile: int | None = None,
) -> jax.Array:
    """The routed experts' weighted sum `[T, H]` over the picks of experts `first_expert .. + X - 1`.

    Args:
      x_TxH: token states.
      ids_TxK / weights_TxK: each token's picked experts (global ids) and routing weights.
      gate_XxHxI / up_XxHxI / down_XxIxH: the held experts' SwiGLU kernels.
      first_expert: global id of the first held expert (expert parallelism: a device's slice).
      implementation: one of `IMPLEMENTATIONS`.
      tile: rows per tile of 'tiled' (default `default_tile`).
    """
    implementation = resolve_implementation(implementation)
    weights = (gate_XxHxI, up_XxHxI, down_XxIxH)
    if implementation == "dense":
        return dense_swiglu(x_TxH, ids_TxK, weights_TxK, *weights, first_expert)
    sorted_pairs = plan(ids_TxK, gate_XxHxI.shape[0], first_expert)
    if implementation == "tiled":
        return tiled_swiglu(x_TxH, sorted_pairs, weights_TxK, *weights, tile=tile)
    pairs_PxH = ragged_swiglu(x_TxH, sorted_pairs, ids_TxK.shape[-1], *weights)
    return combine(pairs_PxH, sorted_pairs, weights_TxK)
