"""The sparse mixture-of-experts MLP of Qwen3-MoE, Qwen3-Next and Qwen 3.5-MoE.

A router picks each token's top-`K` of `X` experts from a float32 softmax over its logits (renormalised
over the top-k when `norm_topk_prob`; Qwen 3.5-MoE always renormalises); each expert is a SwiGLU of width
`I`; a shared expert, when present (Qwen3-Next, Qwen 3.5-MoE), adds `sigmoid(w_g . x) * SwiGLU_shared(x)`.

`SparseMoE.__call__` sorts the `(token, expert)` pairs by expert and multiplies each expert's weights
with its own rows only (`jax.lax.ragged_dot` over the sorted rows), so an expert costs in proportion to
the tokens routed to it. That holds where `ragged_dot` is a grouped matmul: on TPU (a `ragged-dot` custom
call, `results/hybrid-target-2026-12-03/check_memory.md`). On CPU, JAX 0.10 lowers it to a masked dense dot
over all `X` groups for every one of the `BT*K` rows, `K` times the work of the dense pass (see
`benchmarks/moe_forward.py`); XLA's GPU compiler (jax-cuda12-plugin 0.10.2) likewise to a dense dot over
all `X` experts, whose operand grows with the tokens (the paper target's forward does not fit an H200 at
4,096-token rows). `dense_reference` is the all-experts computation, the
independent check for tests and the benchmark's baseline.

Shape letters follow the legend in `dspark_jax/__init__.py`; `K` here is the number of experts each token
picks (`top_k`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.nn import Dtype, Linear, SwiGLU, normal_init


class SparseMoE(nnx.Module):
    """Top-k routed SwiGLU experts plus an optional sigmoid-gated shared expert (`shared_intermediate > 0`).

    The experts' gate and up projections are stored apart (`[X, H, I]` each; Hugging Face fuses them into
    one `gate_up_proj [X, 2I, H]`), so both carry the same `('expert', 'embed', 'mlp')` axes.
    """

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        intermediate: int,
        *,
        norm_topk_prob: bool,
        shared_intermediate: int = 0,
        rngs: nnx.Rngs,
        param_dtype: Dtype = jnp.float32,
        dtype: Dtype = jnp.float32,
    ):
        if not 0 < top_k <= num_experts:
            raise ValueError(f"{top_k=} must be between 1 and {num_experts=}")
        kw = dict(rngs=rngs, param_dtype=param_dtype, dtype=dtype)
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.dtype = dtype
        self.router = Linear((hidden,), (num_experts,), ("embed", None), **kw)
        experts = lambda *shape: normal_init(rngs, (num_experts, *shape), param_dtype)
        self.gate_XxHxI = nnx.Param(experts(hidden, intermediate), axes=("expert", "embed", "mlp"))
        self.up_XxHxI = nnx.Param(experts(hidden, intermediate), axes=("expert", "embed", "mlp"))
        self.down_XxIxH = nnx.Param(experts(intermediate, hidden), axes=("expert", "mlp", "embed"))
        self.shared = SwiGLU(hidden, shared_intermediate, **kw) if shared_intermediate else None
        self.shared_gate = Linear((hidden,), (1,), ("embed", None), **kw) if shared_intermediate else None

    def route(self, x_xH: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Each token's expert ids `[..., K]` (int32, most probable first) and their weights `[..., K]`.

        The logits are in the activation dtype, the softmax (and the renormalisation) in float32, and the
        weights are cast back to the activation dtype, as in the reference.
        """
        logits_xX = self.router(x_xH)
        probs_xX = jax.nn.softmax(logits_xX.astype(jnp.float32), axis=-1)
        weights_xK, ids_xK = jax.lax.top_k(probs_xX, self.top_k)
        if self.norm_topk_prob:
            weights_xK = weights_xK / jnp.sum(weights_xK, axis=-1, keepdims=True)
        return ids_xK, weights_xK.astype(logits_xX.dtype)

    def expert_weights(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The experts' gate `[X, H, I]`, up `[X, H, I]` and down `[X, I, H]` kernels, in the activation
        dtype."""
        return tuple(
            p.get_value().astype(self.dtype) for p in (self.gate_XxHxI, self.up_XxHxI, self.down_XxIxH)
        )

    def shared_output(self, x_xH: jax.Array) -> jax.Array | float:
        """The gated shared expert's output `[..., H]` (0 without a shared expert)."""
        if self.shared is None:
            return 0.0
        return jax.nn.sigmoid(self.shared_gate(x_xH)) * self.shared(x_xH)

    def __call__(self, x_BxTxH: jax.Array) -> jax.Array:
        """The block's output `[B, T, H]` (any leading dims), in the dtype of `x`.

        Pair `p` of the flattened `[BT*K]` picks is token `p // K`'s `(p % K)`-th expert. The pairs are
        stably sorted by expert, each expert's SwiGLU runs over its contiguous rows, and the rows go back
        to pair order before the routing weights sum them per token. All shapes are static.
        """
        h = x_BxTxH.shape[-1]
        x_BTxH = x_BxTxH.reshape(-1, h).astype(self.dtype)
        ids_BTxK, weights_BTxK = self.route(x_BTxH)
        gate_XxHxI, up_XxHxI, down_XxIxH = self.expert_weights()
        ids_BTK = ids_BTxK.reshape(-1)
        order_BTK = jnp.argsort(ids_BTK, stable=True)
        sizes_X = jnp.bincount(ids_BTK, length=gate_XxHxI.shape[0]).astype(jnp.int32)
        rows_BTKxH = x_BTxH[order_BTK // self.top_k]
        inner_BTKxI = jax.nn.silu(jax.lax.ragged_dot(rows_BTKxH, gate_XxHxI, sizes_X)) * jax.lax.ragged_dot(
            rows_BTKxH, up_XxHxI, sizes_X
        )
        sorted_BTKxH = jax.lax.ragged_dot(inner_BTKxI, down_XxIxH, sizes_X)
        pairs_BTKxH = jnp.zeros_like(sorted_BTKxH).at[order_BTK].set(sorted_BTKxH, unique_indices=True)
        y_BTxH = jnp.einsum("nkh,nk->nh", pairs_BTKxH.reshape(*ids_BTxK.shape, h), weights_BTxK)
        y_BTxH = y_BTxH + self.shared_output(x_BTxH)
        return y_BTxH.reshape(x_BxTxH.shape).astype(x_BxTxH.dtype)


def dense_reference(moe: SparseMoE, x_BxTxH: jax.Array) -> jax.Array:
    """`moe(x)` computed with every token through every expert, weighted by a dense routing matrix
    `[BT, X]` that is zero off each token's top-k: `X/K` times the expert work of the sparse pass."""
    h = x_BxTxH.shape[-1]
    x_BTxH = x_BxTxH.reshape(-1, h).astype(moe.dtype)
    ids_BTxK, weights_BTxK = moe.route(x_BTxH)
    gate_XxHxI, up_XxHxI, down_XxIxH = moe.expert_weights()
    picked_BTxKxX = jax.nn.one_hot(ids_BTxK, gate_XxHxI.shape[0], dtype=weights_BTxK.dtype)
    routing_BTxX = jnp.einsum("nkx,nk->nx", picked_BTxKxX, weights_BTxK)
    inner_BTxXxI = jax.nn.silu(jnp.einsum("nh,xhi->nxi", x_BTxH, gate_XxHxI)) * jnp.einsum(
        "nh,xhi->nxi", x_BTxH, up_XxHxI
    )
    out_BTxXxH = jnp.einsum("nxi,xih->nxh", inner_BTxXxI, down_XxIxH)
    y_BTxH = jnp.einsum("nxh,nx->nh", out_BTxXxH, routing_BTxX) + moe.shared_output(x_BTxH)
    return y_BTxH.reshape(x_BxTxH.shape).astype(x_BxTxH.dtype)
