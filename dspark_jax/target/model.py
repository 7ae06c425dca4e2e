"""The frozen target LLM in Flax NNX: dense (Llama 3, Qwen2/2.5, Qwen3, SmolLM2), sparse (Qwen3-MoE)
and hybrid (Qwen3-Next, Qwen 3.5, Qwen 3.5-MoE: Gated DeltaNet linear attention + gated full attention).

One forward serves cache building (aux layer outputs and the post-norm final state for a
whole sequence), generation and speculative verification (new tokens appended to a decoding
cache). Index conventions follow docs/design.md section 1: aux layer `l` is the output of
decoder layer `l` before the final norm, `-1` the embedding output, and `hidden` is `S`,
the final state after the final norm (the design notes' name for a value, not the shape letter `S`).
Aux layers may be of either kind in a hybrid model. Shape letters in names follow the legend in
`dspark_jax/__init__.py`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax import sharding
from dspark_jax.nn import (
    AttentionProjections,
    Dtype,
    Linear,
    RMSNorm,
    SwiGLU,
    apply_rope,
    gqa_attention,
    gqa_attention_heads_major,
    normal_init,
)
from dspark_jax.target.config import FULL_ATTENTION, TargetConfig
from dspark_jax.target.gated_deltanet import GatedDeltaNet, LinearState, LinearSteps, keep_steps
from dspark_jax.target.moe import SparseMoE


class DecodeCache(NamedTuple):
    """A batch's decoding state: keys/values of the full-attention layers, the conv windows and recurrent
    states of the linear-attention layers, and each row's valid slot range.

    Row `b` holds tokens in slots `start[b] <= t < end[b]`; the next token goes to slot
    `end[b]`, at RoPE position `end[b] - start[b]`. Left padding sets `start > 0`. Rolling a
    speculative block back to its accepted prefix (`keep_prefix`) lowers `end` and, for the linear
    layers, keeps the states after the accepted tokens.
    """

    k_BxGxDxT: tuple[jax.Array, ...]  # one buffer per full-attention layer (heads-major, slots minor)
    v_BxGxTxD: tuple[jax.Array, ...]
    linear: tuple[LinearState, ...]  # one per linear-attention layer
    start_B: jax.Array
    end_B: jax.Array

    @classmethod
    def zeros(cls, cfg: TargetConfig, batch: int, max_len: int, dtype: Dtype) -> DecodeCache:
        shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
        key_shape = (batch, cfg.num_kv_heads, cfg.head_dim, max_len)
        zeros_B = jnp.zeros((batch,), jnp.int32)
        kinds = [cfg.layer_type(i) for i in range(cfg.num_layers)]
        attention = [k for k in kinds if k == FULL_ATTENTION]
        linear = [
            LinearState.zeros(
                batch,
                key_heads=cfg.linear_num_key_heads,
                value_heads=cfg.linear_num_value_heads,
                key_dim=cfg.linear_key_head_dim,
                value_dim=cfg.linear_value_head_dim,
                conv_kernel=cfg.linear_conv_kernel_dim,
                dtype=dtype,
            )
            for k in kinds
            if k != FULL_ATTENTION
        ]
        return cls(
            tuple(jnp.zeros(key_shape, dtype) for _ in attention),
            tuple(jnp.zeros(shape, dtype) for _ in attention),
            tuple(linear),
            zeros_B,
            zeros_B,
        )

    @property
    def max_len(self) -> int:
        return self.v_BxGxTxD[0].shape[2]


class TargetOutput(NamedTuple):
    """Forward results; `aux_BxTxAxH` stacks the requested layer outputs in request order. `steps` holds,
    per linear-attention layer, the states after every new token (only with `keep_steps=True`)."""

    hidden_BxTxH: jax.Array
    aux_BxTxAxH: jax.Array | None
    cache: DecodeCache | None
    steps: tuple[LinearSteps, ...] = ()


def keep_prefix(
    before: DecodeCache, after: DecodeCache, steps: tuple[LinearSteps, ...], end_B: jax.Array
) -> DecodeCache:
    """The cache after the first `end_B - before.end_B` of the tokens that a `keep_steps=True` forward
    appended to `before` (giving `after` and `steps`), per row (0 keeps `before`): attention layers
    lower `end`, linear layers keep the states after exactly those tokens."""
    keep_B = end_B - before.end_B
    linear = tuple(keep_steps(state, step, keep_B) for state, step in zip(before.linear, steps))
    return after._replace(linear=linear, end_B=end_B)


class DecoderLayer(nnx.Module):
    """One pre-norm decoder layer: a token mixer (full attention, optionally with a sigmoid output gate,
    or Gated DeltaNet linear attention), then an MLP (SwiGLU or the sparse experts)."""

    def __init__(self, cfg: TargetConfig, index: int, *, rngs: nnx.Rngs, param_dtype: Dtype, dtype: Dtype):
        kw = dict(rngs=rngs, param_dtype=param_dtype, dtype=dtype)
        norm = dict(param_dtype=param_dtype, unit_offset=cfg.norm_unit_offset)
        h = cfg.hidden_size
        self.input_norm = RMSNorm(h, cfg.rms_norm_eps, **norm)
        if cfg.layer_type(index) == FULL_ATTENTION:
            self.attn = AttentionProjections(
                h,
                cfg.num_heads,
                cfg.num_kv_heads,
                cfg.head_dim,
                eps=cfg.rms_norm_eps,
                use_bias=cfg.attention_bias,
                qk_norm=cfg.qk_norm,
                norm_unit_offset=cfg.norm_unit_offset,
                **kw,
            )
            self.attn_gate = (
                Linear((h,), (cfg.num_heads, cfg.head_dim), ("embed", "heads", "head_dim"), **kw)
                if cfg.attn_output_gate
                else None
            )
            self.linear_attn = None
        else:
            self.attn = self.attn_gate = None
            self.linear_attn = GatedDeltaNet(
                h,
                cfg.linear_num_key_heads,
                cfg.linear_num_value_heads,
                cfg.linear_key_head_dim,
                cfg.linear_value_head_dim,
                cfg.linear_conv_kernel_dim,
                cfg.rms_norm_eps,
                **kw,
            )
        self.post_attn_norm = RMSNorm(h, cfg.rms_norm_eps, **norm)
        if cfg.is_sparse(index):
            self.mlp = SparseMoE(
                h,
                cfg.num_experts,
                cfg.num_experts_per_tok,
                cfg.moe_intermediate_size,
                norm_topk_prob=cfg.norm_topk_prob,
                shared_intermediate=cfg.shared_expert_intermediate_size,
                **kw,
            )
        else:
            self.mlp = SwiGLU(h, cfg.intermediate_size, **kw)

    def attend(self, h_BxTxH, positions_BxT, inv_freq, visible_BxTxT, kv=None):
        """Full attention. `kv = (k_BxGxDxT, v_BxGxTxD, slots_BxT)` appends the new keys/values to a
        cache at `slots_BxT` and attends over it; without it the layer attends over its own keys/values.
        Returns the mixer's output and the cache's keys/values (None without a cache)."""
        q_BxTxQxD = apply_rope(self.attn.queries(h_BxTxH), positions_BxT, inv_freq)
        k_BxTxGxD, v_BxTxGxD = self.attn.keys_values(h_BxTxH)
        k_BxTxGxD = apply_rope(k_BxTxGxD, positions_BxT, inv_freq)
        if kv is None:
            k_BxGxDxT = v_BxGxTxD = None
            attn_BxTxQxD = gqa_attention(q_BxTxQxD, k_BxTxGxD, v_BxTxGxD, visible_BxTxT)
        else:
            k_cache, v_cache, slots_BxT = kv
            rows_Bx1 = jnp.arange(slots_BxT.shape[0])[:, None]  # [B, G, T, D][rows, :, slots] is [B, T, G, D]
            k_BxGxDxT = k_cache.at[rows_Bx1, :, :, slots_BxT].set(k_BxTxGxD.astype(k_cache.dtype))  # likewise
            v_BxGxTxD = v_cache.at[rows_Bx1, :, slots_BxT].set(v_BxTxGxD.astype(v_cache.dtype))
            attn_BxTxQxD = gqa_attention_heads_major(
                q_BxTxQxD, k_BxGxDxT.astype(q_BxTxQxD.dtype), v_BxGxTxD.astype(q_BxTxQxD.dtype), visible_BxTxT
            )
        if self.attn_gate is not None:
            attn_BxTxQxD = attn_BxTxQxD * jax.nn.sigmoid(self.attn_gate(h_BxTxH)).astype(attn_BxTxQxD.dtype)
        return self.attn.o(attn_BxTxQxD), k_BxGxDxT, v_BxGxTxD

    def finish(self, x_BxTxH, mixed_BxTxH):
        """Mixer residual, then the MLP residual."""
        x_BxTxH = x_BxTxH + mixed_BxTxH.astype(x_BxTxH.dtype)
        return x_BxTxH + self.mlp(self.post_attn_norm(x_BxTxH)).astype(x_BxTxH.dtype)


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
                DecoderLayer(cfg, index, rngs=rngs, param_dtype=param_dtype, dtype=dtype)
                for index in range(cfg.num_layers)
            ]
        )
        self.final_norm = RMSNorm(
            cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype, unit_offset=cfg.norm_unit_offset
        )
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
        cache: DecodeCache | None = None,
        valid_BxT: jax.Array | None = None,
        aux_layer_ids: tuple[int, ...] = (),
        keep_steps: bool = False,
        positions_BxT: jax.Array | None = None,
    ) -> TargetOutput:
        """Runs the model on `tokens_BxT`.

        Without `cache`: a whole-sequence causal forward at positions `0..T-1`; `valid_BxT` (optional) marks
        real tokens so right padding never leaks into real positions and left padding is masked.
        `positions_BxT` (without `cache`) runs packed rows instead: each token's position in its own sample,
        restarting at 0 where a sample starts; a token attends only to earlier tokens of its sample, at those
        RoPE positions, and the linear-attention layers restart their recurrence and conv window there, so
        each sample's states equal its forward alone. With `cache`: the tokens are appended at each row's
        `cache.end_B` (positions continue from there) and the updated cache is returned with `end_B` advanced
        by `T`; `valid_BxT` then marks each row's real tokens (a contiguous run: a right-padded prompt), so
        that the linear layers' states stop after them. `keep_steps` (with `cache`) also returns every linear
        layer's state after each new token, for `keep_prefix`.
        """
        for layer_id in aux_layer_ids:
            self.cfg.layer_index(layer_id)
        if positions_BxT is not None and cache is not None:
            raise ValueError("packed rows (positions_BxT) need a whole-sequence forward: no decoding cache")
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
        visible_BxTxT = (key_slots_T[None, None, :] <= slots_BxT[:, :, None]) & (
            key_slots_T[None, None, :] >= start_B[:, None, None]
        )
        sample_BxT = None
        if positions_BxT is None:
            positions_BxT = slots_BxT - start_B[:, None]
        else:  # packed: a sample starts where the position restarts at 0
            sample_BxT = jnp.cumsum(positions_BxT == 0, axis=1)
            visible_BxTxT = visible_BxTxT & (sample_BxT[:, None, :] == sample_BxT[:, :, None])
        if cache is None and valid_BxT is not None:
            visible_BxTxT = visible_BxTxT & valid_BxT[:, None, :].astype(bool)
        # The linear layers read only real tokens: past each row's start, and within `valid_BxT`.
        real_BxT = slots_BxT >= start_B[:, None]
        if valid_BxT is not None:
            real_BxT = real_BxT & valid_BxT.astype(bool)

        # The residual stream stays on its rows' batch shards (weights are gathered to it, FSDP-style), as
        # the draft's activations do; the identity outside `sharding.activation_sharding`.
        x_BxTxH = sharding.constrain_rows(self.embed(tokens_BxT))
        aux = {-1: x_BxTxH}
        ks, vs, linear, steps = [], [], [], []
        inv_freq = self.inv_freq.get_value()
        for index, layer in enumerate(self.layers):
            h_BxTxH = layer.input_norm(x_BxTxH)
            if layer.attn is not None:
                a = len(ks)
                kv = None if cache is None else (cache.k_BxGxDxT[a], cache.v_BxGxTxD[a], slots_BxT)
                mixed_BxTxH, k, v = layer.attend(h_BxTxH, positions_BxT, inv_freq, visible_BxTxT, kv)
                ks.append(k)
                vs.append(v)
            else:
                state = None if cache is None else cache.linear[len(linear)]
                stepwise = keep_steps and cache is not None
                mixed_BxTxH, new_state = layer.linear_attn(
                    h_BxTxH, real_BxT, state=state, all_states=stepwise, sample_BxT=sample_BxT
                )
                linear.append(state if stepwise else new_state)  # stepwise: `keep_prefix` picks the state
                if stepwise:
                    steps.append(new_state)
            x_BxTxH = sharding.constrain_rows(layer.finish(x_BxTxH, mixed_BxTxH))
            aux[index] = x_BxTxH
        hidden_BxTxH = self.final_norm(x_BxTxH)
        aux_BxTxAxH = jnp.stack([aux[i] for i in aux_layer_ids], axis=2) if aux_layer_ids else None
        new_cache = None
        if cache is not None:
            new_cache = DecodeCache(tuple(ks), tuple(vs), tuple(linear), cache.start_B, cache.end_B + t)
        return TargetOutput(hidden_BxTxH, aux_BxTxAxH, new_cache, tuple(steps))
