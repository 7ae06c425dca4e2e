"""Every token through every held expert, weighted by a dense routing matrix: the independent check of the
grouped implementations (`X / K` times their expert work)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def dense_swiglu(
    x_TxH: jax.Array,
    ids_TxK: jax.Array,
    weights_TxK: jax.Array,
    gate_XxHxI: jax.Array,
    up_XxHxI: jax.Array,
    down_XxIxH: jax.Array,
    first_expert: jax.Array | int = 0,
) -> jax.Array:
    """`y[t] = sum_k w[t, k] * SwiGLU_{ids[t, k]}(x[t])` `[T, H]` over the picks of the `X` experts from
    `first_expert` (other picks add 0)."""
    experts = gate_XxHxI.shape[0]
    picked_TxKxX = jax.nn.one_hot(ids_TxK - first_expert, experts, dtype=weights_TxK.dtype)  # 0 off range
    routing_TxX = jnp.einsum("tkx,tk->tx", picked_TxKxX, weights_TxK)
    inner_TxXxI = jax.nn.silu(jnp.einsum("th,xhi->txi", x_TxH, gate_XxHxI)) * jnp.einsum(
        "th,xhi->txi", x_TxH, up_XxHxI
    )
    out_TxXxH = jnp.einsum("txi,xih->txh", inner_TxXxI, down_XxIxH)
    return jnp.einsum("txh,tx->th", out_TxXxH, routing_TxX.astype(out_TxXxH.dtype))
