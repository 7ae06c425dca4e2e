"""The routed pairs of a batch sorted by expert: what every grouped implementation starts from.

Pair `p` of the flattened `[T*K]` picks is token `p // K`'s `(p % K)`-th pick. Pairs whose expert is not one
of the `X` held here (`first_expert <= id < first_expert + X`; another device's, under expert parallelism)
sort after every held expert's and are left out.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Plan(NamedTuple):
    """The pairs in expert order.

    order_P: pair index at each sorted position (held experts' pairs first, each expert's contiguous, in
      pair order within an expert).
    local_P: each pair's expert among the held ones, `X` for a pair of an expert not held.
    sizes_X: pairs per held expert.
    starts_X: first sorted position of each held expert's pairs.
    """

    order_P: jax.Array
    local_P: jax.Array
    sizes_X: jax.Array
    starts_X: jax.Array

    @property
    def held_P(self) -> jax.Array:
        """Whether each pair's expert is held here."""
        return self.local_P < self.sizes_X.shape[0]


def plan(ids_TxK: jax.Array, num_experts: int, first_expert: jax.Array | int = 0) -> Plan:
    """The sorted pairs of the picks `ids_TxK` over the `num_experts` experts from `first_expert`."""
    local_P = ids_TxK.reshape(-1).astype(jnp.int32) - first_expert
    local_P = jnp.where((local_P >= 0) & (local_P < num_experts), local_P, num_experts)
    order_P = jnp.argsort(local_P, stable=True)
    sizes_X = jnp.bincount(local_P, length=num_experts + 1)[:num_experts].astype(jnp.int32)
    return Plan(order_P, local_P, sizes_X, jnp.cumsum(sizes_X) - sizes_X)


def combine(pairs_PxH: jax.Array, plan_: Plan, weights_TxK: jax.Array) -> jax.Array:
    """`y[t] = sum_k w[t, k] * out[t, k]` `[T, H]` from per-pair outputs `pairs_PxH` in pair order (pairs of
    experts not held contribute 0, whatever their rows hold)."""
    t, k = weights_TxK.shape
    pairs_PxH = jnp.where(plan_.held_P[:, None], pairs_PxH, 0)
    return jnp.einsum("tkh,tk->th", pairs_PxH.reshape(t, k, -1), weights_TxK.astype(pairs_PxH.dtype))
