"""The sparse mixture-of-experts MLP of Qwen3-MoE, Qwen3-Next and Qwen 3.5-MoE.

A router picks each token's top-`K` of `X` experts from a float32 softmax over its logits (renormalised
over the top-k when `norm_topk_prob`; Qwen 3.5-MoE always renormalises); each expert is a SwiGLU of width
`I`; a shared expert, when present (Qwen3-Next, Qwen 3.5-MoE), adds `sigmoid(w_g . x) * SwiGLU_shared(x)`.

The routed experts run through `kernels.experts.routed_swiglu`, at the cost of the routed rows: a grouped
matmul on TPU, tiles of rows sorted by expert elsewhere (`implementation`, default 'auto'). Under an
activation sharding whose rules split the 'expert' axis over mesh axes, each device holds `X / n` whole
experts and the block runs expert-parallel (`sharding.expert_parallel`): the tokens of the devices sharing
those axes are gathered, each device adds its own experts' share, and the sums are reduce-scattered back.
`dense_reference` is the all-experts computation, the independent check for tests and the benchmark's
baseline.

Shape letters follow the legend in `dspark_jax/__init__.py`; `K` here is the number of experts each token
picks (`top_k`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax import sharding
from dspark_jax.kernels.experts import check_implementation, dense_swiglu, routed_swiglu
from dspark_jax.nn import Dtype, Linear, SwiGLU, normal_init


class SparseMoE(nnx.Module):
    """Top-k routed SwiGLU experts plus an optional sigmoid-gated shared expert (`shared_intermediate > 0`).

    The experts' gate and up projections are stored apart (`[X, H, I]` each; Hugging Face fuses them into
    one `gate_up_proj [X, 2I, H]`), so both carry the same `('expert', 'embed', 'mlp')` axes.
    `implementation` and `tile`: `kernels.experts.routed_swiglu`'s.
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
        implementation: str = "auto",
        tile: int | None = None,
    ):
        if not 0 < top_k <= num_experts:
            raise ValueError(f"{top_k=} must be between 1 and {num_experts=}")
        check_implementation(implementation)
        self.implementation = implementation
        self.tile = tile
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
        """The block's output `[B, T, H]` (any leading dims), in the dtype of `x`."""
        routed = functools.partial(routed_swiglu, implementation=self.implementation, tile=self.tile)
        return self.forward(x_BxTxH, sharding.expert_parallel(routed))

    def forward(self, x_BxTxH: jax.Array, routed) -> jax.Array:
        """The block's output with the routed experts' weighted sum computed by `routed(x_TxH, ids_TxK,
        weights_TxK, gate, up, down) -> [T, H]`."""
        h = x_BxTxH.shape[-1]
        x_BTxH = x_BxTxH.reshape(-1, h).astype(self.dtype)
        ids_BTxK, weights_BTxK = self.route(x_BTxH)
        y_BTxH = routed(x_BTxH, ids_BTxK, weights_BTxK, *self.expert_weights()) + self.shared_output(x_BTxH)
        return y_BTxH.reshape(x_BxTxH.shape).astype(x_BxTxH.dtype)


def dense_reference(moe: SparseMoE, x_BxTxH: jax.Array) -> jax.Array:
    """`moe(x)` computed with every token through every expert, weighted by a dense routing matrix
    `[BT, X]` that is zero off each token's top-k: `X/K` times the expert work of the sparse pass."""
    return moe.forward(x_BxTxH, dense_swiglu)
