"""Building blocks shared by the target model and the draft: norms, RoPE, projections, MLP.

Modules hold parameters only; every parameter carries logical axis names in its `axes`
metadata (see `dspark_jax.sharding`). Shapes are spelled in names with the letters of the legend
in `dspark_jax/__init__.py`: `x_BxTxH` is a batch of `T` positions of width `H`; `Q`/`G` are
query/KV heads, `E = Q/G` query heads per KV head, `D` the head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

Dtype = jnp.dtype | type


def rms_norm(x: jax.Array, eps: float, scale: jax.Array | None = None) -> jax.Array:
    """RMSNorm over the last axis, computed in float32, returned in `x.dtype`."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if scale is not None:
        y = y * scale.astype(jnp.float32)
    return y.astype(x.dtype)


def normal_init(rngs: nnx.Rngs, shape: tuple[int, ...], dtype: Dtype, std: float = 0.02) -> jax.Array:
    return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class RMSNorm(nnx.Module):
    """RMSNorm with a learned scale (initialised to one). With `unit_offset` the stored weight `w` is
    centred on zero and the scale is `1 + w`, added in float32 (Qwen3-Next and Qwen 3.5 norms)."""

    def __init__(self, dim: int, eps: float, *, param_dtype: Dtype = jnp.float32, unit_offset: bool = False):
        self.eps = eps
        self.unit_offset = unit_offset
        init = jnp.zeros if unit_offset else jnp.ones
        self.scale = nnx.Param(init((dim,), param_dtype), axes=("norm",))

    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.scale.get_value()
        if self.unit_offset:
            scale = 1.0 + scale.astype(jnp.float32)
        return rms_norm(x, self.eps, scale)


class LayerNorm(nnx.Module):
    """LayerNorm over the last axis with a learned scale and bias, computed in float32."""

    def __init__(self, dim: int, eps: float = 1e-5, *, param_dtype: Dtype = jnp.float32):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype), axes=("norm",))
        self.bias = nnx.Param(jnp.zeros((dim,), param_dtype), axes=("norm",))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        centred = x32 - jnp.mean(x32, axis=-1, keepdims=True)
        y = centred * jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + self.eps)
        y = y * self.scale.get_value().astype(jnp.float32) + self.bias.get_value().astype(jnp.float32)
        return y.astype(x.dtype)


def apply_rope(x_BxTxQxD: jax.Array, positions_BxT: jax.Array, inv_freq_F: jax.Array) -> jax.Array:
    """Rotary embedding in the Hugging Face (rotate-half) layout, computed in float32.

    `x` holds queries or keys (then `G` heads in place of `Q`). With fewer than `D/2` frequencies
    (partial rotary) only the first `2F` dims of each head rotate; the rest pass through.
    """
    angles_BxTxF = positions_BxT.astype(jnp.float32)[..., None] * inv_freq_F.astype(jnp.float32)
    cos = jnp.cos(angles_BxTxF)[..., None, :]
    sin = jnp.sin(angles_BxTxF)[..., None, :]
    x = x_BxTxQxD.astype(jnp.float32)
    rotary = 2 * inv_freq_F.shape[-1]
    x1, x2 = jnp.split(x[..., :rotary], 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    if rotary < x.shape[-1]:
        out = jnp.concatenate([out, x[..., rotary:]], axis=-1)
    return out.astype(x_BxTxQxD.dtype)


class Linear(nnx.Module):
    """A bias-optional dense layer `[in...] -> [out...]` with named axes on its kernel."""

    def __init__(
        self,
        in_shape: tuple[int, ...],
        out_shape: tuple[int, ...],
        axes: tuple[str | None, ...],
        *,
        use_bias: bool = False,
        rngs: nnx.Rngs,
        param_dtype: Dtype = jnp.float32,
        dtype: Dtype = jnp.float32,
        zero_init: bool = False,
    ):
        self.n_in = len(in_shape)
        self.dtype = dtype
        shape = (*in_shape, *out_shape)
        value = jnp.zeros(shape, param_dtype) if zero_init else normal_init(rngs, shape, param_dtype)
        self.kernel = nnx.Param(value, axes=axes)
        self.bias = nnx.Param(jnp.zeros(out_shape, param_dtype), axes=axes[self.n_in :]) if use_bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.kernel.get_value().astype(self.dtype)
        contract = (tuple(range(x.ndim - self.n_in, x.ndim)), tuple(range(self.n_in)))
        y = jax.lax.dot_general(x.astype(self.dtype), kernel, (contract, ((), ())))
        if self.bias is not None:
            y = y + self.bias.get_value().astype(self.dtype)
        return y


class AttentionProjections(nnx.Module):
    """Q/K/V/O projections of a GQA layer with optional biases and per-head q/k RMSNorm."""

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        eps: float,
        use_bias: bool,
        qk_norm: bool,
        rngs: nnx.Rngs,
        param_dtype: Dtype = jnp.float32,
        dtype: Dtype = jnp.float32,
        norm_unit_offset: bool = False,
    ):
        kw = dict(rngs=rngs, param_dtype=param_dtype, dtype=dtype)
        self.q = Linear(
            (hidden,), (num_heads, head_dim), ("embed", "heads", "head_dim"), use_bias=use_bias, **kw
        )
        self.k = Linear(
            (hidden,), (num_kv_heads, head_dim), ("embed", "kv_heads", "head_dim"), use_bias=use_bias, **kw
        )
        self.v = Linear(
            (hidden,), (num_kv_heads, head_dim), ("embed", "kv_heads", "head_dim"), use_bias=use_bias, **kw
        )
        self.o = Linear((num_heads, head_dim), (hidden,), ("heads", "head_dim", "embed"), **kw)
        norm = dict(param_dtype=param_dtype, unit_offset=norm_unit_offset)
        self.q_norm = RMSNorm(head_dim, eps, **norm) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps, **norm) if qk_norm else None

    def queries(self, x_BxTxH: jax.Array) -> jax.Array:
        q_BxTxQxD = self.q(x_BxTxH)
        return self.q_norm(q_BxTxQxD) if self.q_norm is not None else q_BxTxQxD

    def keys_values(self, x_BxTxH: jax.Array) -> tuple[jax.Array, jax.Array]:
        k_BxTxGxD = self.k(x_BxTxH)
        if self.k_norm is not None:
            k_BxTxGxD = self.k_norm(k_BxTxGxD)
        return k_BxTxGxD, self.v(x_BxTxH)


def gqa_attention(
    q_BxTxQxD: jax.Array, k_BxTxGxD: jax.Array, v_BxTxGxD: jax.Array, visible_BxTxT: jax.Array
) -> jax.Array:
    """Dense grouped-query attention with a boolean visibility mask; softmax in float32.

    Queries at `T` positions attend over keys/values at `T` positions (the two `T` may differ:
    `visible_BxTxT` is `[B, queries, keys]`). A query with no visible key returns zeros instead of NaN.
    """
    return gqa_attention_heads_major(
        q_BxTxQxD, k_BxTxGxD.transpose(0, 2, 3, 1), v_BxTxGxD.transpose(0, 2, 1, 3), visible_BxTxT
    )


def gqa_attention_heads_major(
    q_BxTxQxD: jax.Array, k_BxGxDxT: jax.Array, v_BxGxTxD: jax.Array, visible_BxTxT: jax.Array
) -> jax.Array:
    """`gqa_attention` over keys/values stored heads-major (a decoding cache's layout): keys
    `[B, G, D, T]`, slots minor, values `[B, G, T, D]`.

    Both products are plain batched matmuls over `B x G` with the `E` query heads of a KV head stacked
    as rows, each in the layout a CPU matmul streams: on a CPU, XLA runs the `[B, T, G, D]` layout's
    products several times slower (and a cache in that layout is copied to this one at every step), and
    the scores of a few query rows over slot-major keys `[B, G, T, D]` 4x slower than over these
    (`benchmarks/regeneration.py`).
    """
    b, t, heads, d = q_BxTxQxD.shape
    kv_heads, s = k_BxGxDxT.shape[1], k_BxGxDxT.shape[3]
    e = heads // kv_heads
    q_BxGxETxD = (
        q_BxTxQxD.reshape(b, t, kv_heads, e, d).transpose(0, 2, 3, 1, 4).reshape(b, kv_heads, e * t, d)
    )
    logits_BxGxExTxT = jnp.einsum(
        "bgqd,bgds->bgqs", q_BxGxETxD, k_BxGxDxT, preferred_element_type=jnp.float32
    ).reshape(b, kv_heads, e, t, s) * (d**-0.5)
    mask = visible_BxTxT[:, None, None]
    logits_BxGxExTxT = jnp.where(mask, logits_BxGxExTxT, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits_BxGxExTxT, axis=-1)
    probs = jnp.where(mask, probs, 0.0).astype(v_BxGxTxD.dtype)
    out_BxGxETxD = jnp.einsum("bgqs,bgsd->bgqd", probs.reshape(b, kv_heads, e * t, s), v_BxGxTxD)
    return out_BxGxETxD.reshape(b, kv_heads, e, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, heads, d)


class SwiGLU(nnx.Module):
    """`down(silu(gate(x)) * up(x))`."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        *,
        rngs: nnx.Rngs,
        param_dtype: Dtype = jnp.float32,
        dtype: Dtype = jnp.float32,
    ):
        kw = dict(rngs=rngs, param_dtype=param_dtype, dtype=dtype)
        self.gate = Linear((hidden,), (intermediate,), ("embed", "mlp"), **kw)
        self.up = Linear((hidden,), (intermediate,), ("embed", "mlp"), **kw)
        self.down = Linear((intermediate,), (hidden,), ("mlp", "embed"), **kw)

    def __call__(self, x_BxTxH: jax.Array) -> jax.Array:
        return self.down(jax.nn.silu(self.gate(x_BxTxH)) * self.up(x_BxTxH))


class DecoderBlock(nnx.Module):
    """Parameters of a pre-norm GQA decoder block (input norm, attention, post-attention norm, SwiGLU).

    Subclasses define how keys/values are gathered in `__call__` and end with `finish`.
    """

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        intermediate: int,
        *,
        eps: float,
        use_bias: bool,
        qk_norm: bool,
        rngs: nnx.Rngs,
        param_dtype: Dtype,
        dtype: Dtype,
    ):
        kw = dict(rngs=rngs, param_dtype=param_dtype, dtype=dtype)
        self.input_norm = RMSNorm(hidden, eps, param_dtype=param_dtype)
        self.attn = AttentionProjections(
            hidden, num_heads, num_kv_heads, head_dim, eps=eps, use_bias=use_bias, qk_norm=qk_norm, **kw
        )
        self.post_attn_norm = RMSNorm(hidden, eps, param_dtype=param_dtype)
        self.mlp = SwiGLU(hidden, intermediate, **kw)

    def finish(self, x: jax.Array, attn_out: jax.Array) -> jax.Array:
        """Output projection + residual, then the MLP residual."""
        x = x + self.attn.o(attn_out).astype(x.dtype)
        return x + self.mlp(self.post_attn_norm(x)).astype(x.dtype)
