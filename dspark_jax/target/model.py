"""The frozen target LLM in Flax NNX: Llama 3, Qwen2/2.5, Qwen3 dense and SmolLM2.

One forward serves cache building (aux layer outputs and the post-norm final state for a
whole sequence), generation and speculative verification (new tokens appended to a KV
cache). Index conventions follow docs/design.md section 1: aux layer `l` is the output of
decoder layer `l` before the final norm, `-1` the embedding output, and `hidden` is `S`,
the final state after the final norm (the design notes' name for a value, not the shape letter `S`).
Shape letters in names follow the legend in `dspark_jax/__init__.py`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.nn import DecoderBlock, Dtype, RMSNorm, apply_rope, gqa_attention, normal_init
from dspark_jax.target.config import TargetConfig


class KVCache(NamedTuple):
    """Per-layer keys/values of a batch of sequences plus each row's valid slot range.

    Row `b` holds tokens in slots `start[b] <= t < end[b]`; the next token goes to slot
    `end[b]`, at RoPE position `end[b] - start[b]`. Left padding sets `start > 0`; rolling
    back a speculative block lowers `end`.
    """

    k_BxTxGxD: tuple[jax.Array, ...]  # one buffer per layer, updated in place under jit
    v_BxTxGxD: tuple[jax.Array, ...]
    start_B: jax.Array
    end_B: jax.Array

    @classmethod
    def zeros(cls, cfg: TargetConfig, batch: int, max_len: int, dtype: Dtype) -> KVCache:
        shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
        zeros_B = jnp.zeros((batch,), jnp.int32)
        layers = range(cfg.num_layers)
        return cls(
            tuple(jnp.zeros(shape, dtype) for _ in layers),
            tuple(jnp.zeros(shape, dtype) for _ in layers),
            zeros_B,
            zeros_B,
        )

    @property
    def max_len(self) -> int:
        return self.k_BxTxGxD[0].shape[1]


class TargetOutput(NamedTuple):
    """Forward results; `aux_BxTxAxH` stacks the requested layer outputs in request order."""

    hidden_BxTxH: jax.Array
    aux_BxTxAxH: jax.Array | None
    cache: KVCache | None


class DecoderLayer(DecoderBlock):
    def __init__(self, cfg: TargetConfig, *, rngs: nnx.Rngs, param_dtype: Dtype, dtype: Dtype):
        super().__init__(
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.intermediate_size,
            eps=cfg.rms_norm_eps,
            use_bias=cfg.attention_bias,
            qk_norm=cfg.qk_norm,
            rngs=rngs,
            param_dtype=param_dtype,
            dtype=dtype,
        )

    def __call__(self, x_BxTxH, positions_BxT, inv_freq, visible_BxTxT, kv=None):
        """One layer. `kv = (k_BxTxGxD, v_BxTxGxD, slots_BxT)` appends the new keys/values to a
        cache at `slots_BxT` and attends over it; without it the layer attends over its own
        keys/values. Returns the new residual stream and the keys/values attended over."""
        h = self.input_norm(x_BxTxH)
        q_BxTxQxD = apply_rope(self.attn.queries(h), positions_BxT, inv_freq)
        k_BxTxGxD, v_BxTxGxD = self.attn.keys_values(h)
        k_BxTxGxD = apply_rope(k_BxTxGxD, positions_BxT, inv_freq)
        if kv is not None:
            k_cache, v_cache, slots_BxT = kv
            rows_Bx1 = jnp.arange(slots_BxT.shape[0])[:, None]
            k_BxTxGxD = k_cache.at[rows_Bx1, slots_BxT].set(k_BxTxGxD.astype(k_cache.dtype))
            v_BxTxGxD = v_cache.at[rows_Bx1, slots_BxT].set(v_BxTxGxD.astype(v_cache.dtype))
        attn_BxTxQxD = gqa_attention(
            q_BxTxQxD, k_BxTxGxD.astype(q_BxTxQxD.dtype), v_BxTxGxD.astype(q_BxTxQxD.dtype), visible_BxTxT
        )
        x_BxTxH = self.finish(x_BxTxH, attn_BxTxQxD)
        return x_BxTxH, k_BxTxGxD, v_BxTxGxD


class Transformer(nnx.Module):
    """Decoder-only target LLM. Parameters in `param_dtype`, activations in `dtype`."""

    def __init__(
        self,
        cfg: TargetConfig,
        *,
        rngs: nnx.Rngs,
        param_dtype: Dtype = jnp.float32,
        dtype: Dtype = jnp.float32,
    ):
        self.cfg = cfg
        self.dtype = dtype
        self.embedding = nnx.Param(
            normal_init(rngs, (cfg.vocab_size, cfg.hidden_size), param_dtype), axes=("vocab", "embed")
        )
        self.layers = nnx.List(
            [
                DecoderLayer(cfg, rngs=rngs, param_dtype=param_dtype, dtype=dtype)
                for _ in range(cfg.num_layers)
            ]
        )
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else nnx.Param(
                normal_init(rngs, (cfg.hidden_size, cfg.vocab_size), param_dtype), axes=("embed", "vocab")
            )
        )
        self.inv_freq = nnx.Variable(jnp.asarray(cfg.rope_inv_freq(), jnp.float32))

    def embed(self, tokens_BxT: jax.Array) -> jax.Array:
        return jnp.take(self.embedding.get_value(), tokens_BxT, axis=0).astype(self.dtype)

    def lm_head_matrix(self) -> jax.Array:
        """The `[H, V]` output projection (the transposed embedding when tied)."""
        return self.embedding.get_value().T if self.lm_head is None else self.lm_head.get_value()

    def logits(self, hidden_BxTxH: jax.Array) -> jax.Array:
        """Float32 logits `[..., V]` from post-norm final states."""
        return jnp.einsum(
            "...h,hv->...v",
            hidden_BxTxH.astype(self.dtype),
            self.lm_head_matrix().astype(self.dtype),
            preferred_element_type=jnp.float32,
        )

    def __call__(
        self,
        tokens_BxT: jax.Array,
        *,
        cache: KVCache | None = None,
        valid_BxT: jax.Array | None = None,
        aux_layer_ids: tuple[int, ...] = (),
    ) -> TargetOutput:
        """Runs the model on `tokens_BxT`.

        Without `cache`: a whole-sequence causal forward at positions `0..T-1`; `valid_BxT`
        (optional) marks real tokens so right padding never leaks into real positions and
        left padding is masked. With `cache`: the tokens are appended at each row's
        `cache.end_B` (positions continue from there) and the updated cache is returned
        with `end_B` advanced by `T`.
        """
        for layer_id in aux_layer_ids:
            self.cfg.layer_index(layer_id)
        b, t = tokens_BxT.shape
        if cache is None:
            start_B = jnp.zeros((b,), jnp.int32)
            if valid_BxT is not None:
                start_B = jnp.argmax(valid_BxT, axis=1).astype(jnp.int32)  # left padding
            slots_BxT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
            key_slots_T = jnp.arange(t, dtype=jnp.int32)
        else:
            start_B = cache.start_B
            slots_BxT = cache.end_B[:, None] + jnp.arange(t, dtype=jnp.int32)
            key_slots_T = jnp.arange(cache.max_len, dtype=jnp.int32)
        positions_BxT = slots_BxT - start_B[:, None]
        visible_BxTxT = (key_slots_T[None, None, :] <= slots_BxT[:, :, None]) & (
            key_slots_T[None, None, :] >= start_B[:, None, None]
        )
        if cache is None and valid_BxT is not None:
            visible_BxTxT = visible_BxTxT & valid_BxT[:, None, :].astype(bool)

        x_BxTxH = self.embed(tokens_BxT)
        aux = {-1: x_BxTxH}
        ks, vs = [], []
        for index, layer in enumerate(self.layers):
            kv = None if cache is None else (cache.k_BxTxGxD[index], cache.v_BxTxGxD[index], slots_BxT)
            x_BxTxH, k, v = layer(x_BxTxH, positions_BxT, self.inv_freq.get_value(), visible_BxTxT, kv)
            ks.append(k)
            vs.append(v)
            aux[index] = x_BxTxH
        hidden_BxTxH = self.final_norm(x_BxTxH)
        aux_BxTxAxH = jnp.stack([aux[i] for i in aux_layer_ids], axis=2) if aux_layer_ids else None
        new_cache = None if cache is None else KVCache(tuple(ks), tuple(vs), cache.start_B, cache.end_B + t)
        return TargetOutput(hidden_BxTxH, aux_BxTxAxH, new_cache)
