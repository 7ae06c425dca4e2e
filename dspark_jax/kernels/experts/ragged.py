"""Grouped SwiGLU experts through `jax.lax.ragged_dot`: a grouped matmul where the backend has one.

TPU compiles `ragged_dot` to a grouped matmul (a `ragged-dot` custom call;
`results/hybrid-target-2026-12-03`). CPU and GPU (JAX 0.10-0.11) rewrite it as a masked dense dot over every
group for every row: `X` times the routed work, with an `[X, rows, H]` temporary
(`results/gpu-targets-2026-12-04`), so 'auto' picks it on TPU only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dspark_jax.kernels.experts.plan import Plan


def ragged_swiglu(
    x_TxH: jax.Array,
    plan: Plan,
    top_k: int,
    gate_XxHxI: jax.Array,
    up_XxHxI: jax.Array,
    down_XxIxH: jax.Array,
) -> jax.Array:
    """Per-pair expert outputs `[T*K, H]` in pair order (rows of pairs not held: unspecified)."""
    rows_PxH = x_TxH[plan.order_P // top_k]
    inner_PxI = jax.nn.silu(jax.lax.ragged_dot(rows_PxH, gate_XxHxI, plan.sizes_X)) * jax.lax.ragged_dot(
        rows_PxH, up_XxHxI, plan.sizes_X
    )
    sorted_PxH = jax.lax.ragged_dot(inner_PxI, down_XxIxH, plan.sizes_X)
    return jnp.zeros_like(sorted_PxH).at[plan.order_P].set(sorted_PxH, unique_indices=True)
