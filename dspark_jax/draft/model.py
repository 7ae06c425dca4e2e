"""The DSpark block draft (Flax NNX): aux projection, block backbone, Markov and confidence heads.

Notation (docs/design.md section 1; shape letters: the legend in `dspark_jax/__init__.py`): a block
with anchor `a` has `S = 7` slots at RoPE positions `a + i`; slot 0 holds `E(x[a])`, slots
1..6 `E(MASK)`; prediction `i` (slot i's output `h[i]`) predicts `x[a+1+i]`. Context features
`c[j] = RMSNorm(W_aux [H_l1[j]; H_l2[j]; H_l3[j]])` are visible to the block for `j < a` only.
The Markov head adds `W2 W1[t_i]` to the logits `h[i] @ lm_head`, with predecessor
`t_i = x[a+i]`; the confidence head reads `[h_i; m_i]`.

The target's embedding and LM head are frozen inputs (`FrozenTarget`), not parameters.
Variants extend the pieces here by composition: other block inputs, memory keys/values,
or a different Markov head.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax import sharding
from dspark_jax.kernels.block_attention import (
    DEFAULT_BLOCK_SIZES,
    BlockMemory,
    BlockSizes,
    block_attention,
    resolve_implementation,
)
from dspark_jax.nn import DecoderBlock, Dtype, Linear, RMSNorm, apply_rope, normal_init


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    """Shape of the draft. `hidden_size` and `vocab_size` must equal the target's.

    Built from a config's whole `draft` section plus what the target fixes (`from_config`); the
    keys are documented in configs/base.py. Experiment groups with more draft settings subclass it.

    Attributes:
      num_aux: number of target layers in the context features (A).
      mask_token_id: a spare target embedding row used as MASK; None (or -1) = a learned vector.
      attention: block attention implementation ('auto', 'pallas', 'xla' or 'reference'; see
        `dspark_jax.kernels.block_attention`).
      attention_block_q, attention_block_k: the Pallas kernel's tiles (`BlockSizes`).
      anchor_chunk: blocks per chunk of the XLA block attention and of the vocabulary-sized objective.
      remat: recompute each chunk's activations in the backward pass instead of storing them.
      param_dtype, dtype: master-weight and compute dtypes.
    """

    hidden_size: int
    vocab_size: int
    num_aux: int
    num_layers: int = 3
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 1536
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    block_size: int = 7
    markov_rank: int = 256
    mask_token_id: int | None = None
    attention: str = "xla"
    attention_block_q: int = DEFAULT_BLOCK_SIZES.block_q
    attention_block_k: int = DEFAULT_BLOCK_SIZES.block_k
    anchor_chunk: int = 16
    remat: bool = True
    param_dtype: str = "float32"
    dtype: str = "float32"

    # Filled in from the target, not from the config's `draft` section.
    TARGET_FIELDS: ClassVar[tuple[str, ...]] = (
        "hidden_size",
        "vocab_size",
        "num_aux",
        "rms_norm_eps",
        "rope_theta",
    )

    @classmethod
    def from_config(cls, draft: Mapping[str, Any], target, num_aux: int) -> DraftConfig:
        """The draft of a config's `draft` section (every key) for `target` (a `TargetConfig`)."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(draft) - names)
        if unknown:
            settable = sorted(names - set(cls.TARGET_FIELDS))
            raise ValueError(
                f"config.draft.{unknown[0]} is not a draft setting of {cls.__name__}; known: {settable}"
            )
        fixed = sorted(set(draft) & set(cls.TARGET_FIELDS))
        if fixed:
            raise ValueError(f"config.draft.{fixed[0]} comes from the target and cannot be set")
        return cls(
            **dict(draft),
            hidden_size=target.hidden_size,
            vocab_size=target.vocab_size,
            num_aux=num_aux,
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta,
        )

    def __post_init__(self):
        if self.mask_token_id is not None and self.mask_token_id < 0:
            object.__setattr__(self, "mask_token_id", None)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"draft {self.num_heads=} must be a multiple of {self.num_kv_heads=}")
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"draft mask_token_id={self.mask_token_id} outside the vocabulary [0, {self.vocab_size})"
            )

    def rope_inv_freq(self) -> np.ndarray:
        return 1.0 / self.rope_theta ** (np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim)


class DraftMemory(NamedTuple):
    """Extra key/value sources of each block (Draft Memory), visible to their own block only.

    `states_BxNxMxH` are already adapted (`MemoryAdapter`); every draft layer projects them with its own
    K/V weights. `positions_BxNxM` are their RoPE positions as row indices (like anchors: a packed
    block's sample start is subtracted); `valid_BxNxM` marks the slots that exist.
    """

    states_BxNxMxH: jax.Array
    positions_BxNxM: jax.Array
    valid_BxNxM: jax.Array


class DraftVocab(NamedTuple):
    """A draft vocabulary: the `K` token ids the draft may propose (ascending) and their columns of the
    target's LM head `[H, K]`, so the draft's logits read `K` of the `V` columns (in training, where the
    teacher keeps all `V`, and at decoding)."""

    ids_K: jax.Array
    lm_head_HxK: jax.Array


class FrozenTarget(NamedTuple):
    """The target's frozen embedding `[V, H]` and LM head `[H, V]` used by the draft, plus the frozen side
    inputs of the run's group (`{name: pytree}`, declared by `Experiment.run.side_inputs`; None: none), in
    online training the target's whole parameter state, which the step's feature pass runs (None
    offline: the states come from the cache), and an optional `DraftVocab`, the only tokens the draft's
    logits cover in training and at decoding (None: the whole vocabulary)."""

    embedding_VxH: jax.Array
    lm_head_HxV: jax.Array
    side_inputs: Any = None
    target_state: Any = None
    draft_vocab: DraftVocab | None = None


def make_draft_vocab(lm_head_HxV: jax.Array, ids_K, ids_sharding, head_sharding) -> DraftVocab:
    """The draft vocabulary of the token ids `ids_K` (sorted) and their columns of `lm_head_HxV`, placed
    with `ids_sharding` and `head_sharding`."""
    ids_K = jax.device_put(np.sort(np.asarray(ids_K)).astype(np.int32), ids_sharding)
    head_HxK = jax.jit(lambda head, ids: head[:, ids], out_shardings=head_sharding)(lm_head_HxV, ids_K)
    return DraftVocab(ids_K, head_HxK)


def vocab_columns(frozen: FrozenTarget) -> jax.Array | None:
    """The token ids of the draft's logits' columns: the draft vocabulary's `[K]`, None for all `V`."""
    return None if frozen.draft_vocab is None else frozen.draft_vocab.ids_K


class DraftLayer(DecoderBlock):
    """A Qwen3-style layer over keys/values `[context; memory; block]` under the block visibility rule."""

    def __init__(self, cfg: DraftConfig, *, rngs: nnx.Rngs, param_dtype: Dtype, dtype: Dtype):
        super().__init__(
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.intermediate_size,
            eps=cfg.rms_norm_eps,
            use_bias=False,
            qk_norm=True,
            rngs=rngs,
            param_dtype=param_dtype,
            dtype=dtype,
        )
        self.cfg = cfg

    def context_kv(self, ctx_BxTxH, positions_BxT, inv_freq) -> tuple[jax.Array, jax.Array]:
        """Keys (k-normed, RoPE at the context positions) and values of context features `c`.

        The features were normed once after `W_aux`; the layer's input norm does not apply.
        Inference caches these per layer and appends the newly accepted positions each cycle.
        """
        k_ctx, v_ctx = self.attn.keys_values(ctx_BxTxH)
        return apply_rope(k_ctx, positions_BxT, inv_freq), v_ctx

    def __call__(
        self,
        x_BxNxSxH,
        ctx_kv,
        anchors_BxN,
        inv_freq,
        memory: DraftMemory | None = None,
        starts_BxN=None,
    ):
        """One layer over `N` blocks of `S` slots; `ctx_kv = (k_BxTxGxD, v_BxTxGxD)` from `context_kv`.

        `memory`: per-block extra key/value sources (Draft Memory), through this layer's own K/V
        projections. `starts_BxN`: the first position of each block's sample in a packed row (None = 0):
        its context starts there and its RoPE positions count from there.
        """
        b, n, s, _ = x_BxNxSxH.shape
        start_BxN = 0 if starts_BxN is None else starts_BxN
        anchor_pos_BxN = anchors_BxN - start_BxN
        slot_pos_BxNS = (anchor_pos_BxN[:, :, None] + jnp.arange(s)).reshape(b, n * s)
        h_BxNSxH = self.input_norm(x_BxNxSxH).reshape(b, n * s, -1)
        q = apply_rope(self.attn.queries(h_BxNSxH), slot_pos_BxNS, inv_freq)
        k_blk, v_blk = self.attn.keys_values(h_BxNSxH)
        k_blk = apply_rope(k_blk, slot_pos_BxNS, inv_freq)
        k_ctx, v_ctx = ctx_kv
        memory_kv = None
        if memory is not None:
            m = memory.states_BxNxMxH.shape[2]
            k_mem, v_mem = self.attn.keys_values(memory.states_BxNxMxH.reshape(b, n * m, -1))
            mem_pos_BxNM = (memory.positions_BxNxM - jnp.asarray(start_BxN)[..., None]).reshape(b, n * m)
            memory_kv = BlockMemory(
                apply_rope(k_mem, mem_pos_BxNM, inv_freq).reshape(b, n, m, *k_mem.shape[2:]),
                v_mem.reshape(b, n, m, *v_mem.shape[2:]),
                memory.valid_BxNxM,
            )
        blocks = lambda t: t.reshape(b, n, s, *t.shape[2:])
        attend = functools.partial(
            block_attention,
            implementation=self.cfg.attention,
            anchor_chunk=self.cfg.anchor_chunk,
            remat=self.cfg.remat,
            block_sizes=BlockSizes(self.cfg.attention_block_q, self.cfg.attention_block_k),
        )
        if resolve_implementation(self.cfg.attention) == "pallas":  # XLA cannot partition a Mosaic kernel
            blk, ctx = ("batch", None, None, "kv_heads", None), ("batch", None, "kv_heads", None)
            mem = None if memory_kv is None else BlockMemory(blk, blk, ("batch", None, None))
            in_axes = (("batch", None, None, "heads", None), ctx, ctx, blk, blk, ("batch", None), mem)
            attend = sharding.per_shard(attend, (*in_axes, ("batch", None)), in_axes[0])
        kv_blk = blocks(k_blk), blocks(v_blk)
        out = attend(blocks(q), k_ctx, v_ctx, *kv_blk, anchors_BxN, memory_kv, starts_BxN)
        return self.finish(x_BxNxSxH, out)


class MarkovHead(nnx.Module):
    """Vanilla low-rank Markov head: `m = W1[t]`, logit bias `W2 m`."""

    def __init__(self, vocab: int, rank: int, *, rngs: nnx.Rngs, param_dtype: Dtype):
        self.w1 = nnx.Param(normal_init(rngs, (vocab, rank), param_dtype), axes=("vocab", "rank"))
        self.w2 = nnx.Param(normal_init(rngs, (rank, vocab), param_dtype), axes=("rank", "vocab"))
        # `on_columns`: W2 holds a draft vocabulary's columns, `column_at [V]` each id's column.
        self.column_at = nnx.data(None)

    def features(self, predecessors_x: jax.Array) -> jax.Array:
        """`m [..., R]` for predecessor token ids `[...]`."""
        return jnp.take(self.w1.get_value(), predecessors_x, axis=0)

    def on_columns(self, ids_K: jax.Array) -> MarkovHead:
        """This head over the vocabulary ids `ids_K` only (a draft vocabulary): `W2`'s columns gathered once,
        `W1` shared. Its `bias` takes those ids (`[K]`) as `columns_xK`; `columns` maps vocabulary ids to
        them (ids outside the vocabulary read NaN). A loss that runs the head per chunk of anchors under
        `jax.lax.scan` uses it so that the backward pass accumulates `W2`'s gradient over `K` columns and
        scatters it into `V` once instead of once per chunk (11% of the demo step)."""
        view = nnx.merge(*nnx.split(self))
        w2_RxV = self.w2.get_value()
        view.w2 = nnx.Param(jnp.take(w2_RxV, ids_K, axis=1), axes=("rank", "vocab"))
        k = ids_K.shape[0]
        view.column_at = nnx.Variable(jnp.full((w2_RxV.shape[1],), k, jnp.int32).at[ids_K].set(jnp.arange(k)))
        return view

    def columns(self, ids_xK: jax.Array) -> jax.Array:
        """`W2`'s columns of the vocabulary ids `ids_xK`, `[..., K, R]` (the ids' output embeddings)."""
        at_xK = ids_xK if self.column_at is None else self.column_at.get_value()[ids_xK]
        return jnp.moveaxis(jnp.take(self.w2.get_value(), at_xK, axis=1), 0, -1)  # gathers, no transpose

    def bias(self, m_xR: jax.Array, columns_xK: jax.Array | None = None) -> jax.Array:
        """Float32 vocabulary bias `[..., V]`, or `[..., K]` at the vocabulary ids `columns_xK` only: one
        row's own ids `[..., K]`, or ids `[K]` every row shares (a draft vocabulary)."""
        w2_RxV = self.w2.get_value().astype(m_xR.dtype)
        if self.column_at is not None and (columns_xK is None or columns_xK.ndim == 1):
            if columns_xK is None or columns_xK.shape[0] != w2_RxV.shape[1]:
                raise ValueError("a Markov head cut to a draft vocabulary takes that vocabulary's ids [K]")
            return jnp.einsum("...r,rk->...k", m_xR, w2_RxV, preferred_element_type=jnp.float32)
        if columns_xK is None or columns_xK.ndim == 1:
            w2_RxK = w2_RxV if columns_xK is None else jnp.take(w2_RxV, columns_xK, axis=1)
            return jnp.einsum("...r,rk->...k", m_xR, w2_RxK, preferred_element_type=jnp.float32)
        w2_xKxR = self.columns(columns_xK).astype(m_xR.dtype)
        return jnp.einsum("...r,...kr->...k", m_xR, w2_xKxR, preferred_element_type=jnp.float32)


class DSparkDraft(nnx.Module):
    """The baseline DSpark draft. Parameters in `param_dtype`, activations in `dtype` (default: `cfg`'s)."""

    def __init__(
        self,
        cfg: DraftConfig,
        *,
        rngs: nnx.Rngs,
        param_dtype: Dtype | None = None,
        dtype: Dtype | None = None,
    ):
        param_dtype = jnp.dtype(param_dtype or cfg.param_dtype)
        dtype = jnp.dtype(dtype or cfg.dtype)
        kw = dict(rngs=rngs, param_dtype=param_dtype, dtype=dtype)
        self.cfg = cfg
        self.dtype = dtype
        h = cfg.hidden_size
        self.aux_proj = Linear((cfg.num_aux * h,), (h,), ("aux", "embed"), **kw)
        self.aux_norm = RMSNorm(h, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.layers = nnx.List([DraftLayer(cfg, **kw) for _ in range(cfg.num_layers)])
        self.final_norm = RMSNorm(h, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.mask_embedding = (
            nnx.Param(normal_init(rngs, (h,), param_dtype), axes=("embed",))
            if cfg.mask_token_id is None
            else None
        )
        self.markov = MarkovHead(cfg.vocab_size, cfg.markov_rank, rngs=rngs, param_dtype=param_dtype)
        self.confidence = Linear((h + cfg.markov_rank,), (), ("embed",), use_bias=True, **kw)
        self.inv_freq = nnx.Variable(jnp.asarray(cfg.rope_inv_freq(), jnp.float32))

    def context(self, aux_BxTxAxH: jax.Array) -> jax.Array:
        """Context features `c [B, T, H]` from the cached aux layer outputs."""
        b, t, a, h = aux_BxTxAxH.shape
        return self.aux_norm(self.aux_proj(aux_BxTxAxH.reshape(b, t, a * h)))

    def mask_vector(self, frozen: FrozenTarget) -> jax.Array:
        if self.mask_embedding is None:
            return frozen.embedding_VxH[self.cfg.mask_token_id]
        return self.mask_embedding.get_value()

    def block_inputs(self, frozen: FrozenTarget, anchor_tokens_BxN: jax.Array) -> jax.Array:
        """Baseline block inputs `[E(x[a]), E(MASK) x (S-1)]`, `[B, N, S, H]` (a group's draft may build
        its own from more inputs)."""
        anchor_BxNxH = jnp.take(frozen.embedding_VxH, anchor_tokens_BxN, axis=0)
        b, n = anchor_tokens_BxN.shape
        mask_BxNxSxH = jnp.broadcast_to(
            self.mask_vector(frozen).astype(anchor_BxNxH.dtype),
            (b, n, self.cfg.block_size, self.cfg.hidden_size),
        )
        return mask_BxNxSxH.at[:, :, 0].set(anchor_BxNxH).astype(self.dtype)

    def context_kv(self, ctx_BxTxH: jax.Array, positions_BxT: jax.Array | None = None) -> list:
        """Per-layer context keys/values of features `c` at `positions` (default `0..T-1`)."""
        if positions_BxT is None:
            positions_BxT = jnp.broadcast_to(jnp.arange(ctx_BxTxH.shape[1]), ctx_BxTxH.shape[:2])
        inv_freq = self.inv_freq.get_value()
        return [layer.context_kv(ctx_BxTxH, positions_BxT, inv_freq) for layer in self.layers]

    def backbone(self, x_BxNxSxH, ctx_kvs, anchors_BxN, memory: DraftMemory | None = None, starts_BxN=None):
        """Final draft states `h [B, N, S, H]` (after the final RMSNorm); `ctx_kvs` from `context_kv`;
        `memory` and `starts_BxN` as in `DraftLayer.__call__` (the same memory states for every layer)."""
        inv_freq = self.inv_freq.get_value()
        for layer, ctx_kv in zip(self.layers, ctx_kvs, strict=True):
            x_BxNxSxH = layer(x_BxNxSxH, ctx_kv, anchors_BxN, inv_freq, memory, starts_BxN)
            x_BxNxSxH = sharding.constrain(x_BxNxSxH, ("batch", None, None, None))
        return self.final_norm(x_BxNxSxH)

    def base_logits(self, frozen: FrozenTarget, h_xH: jax.Array) -> jax.Array:
        """Float32 `h @ lm_head` (the frozen target head), `[..., V]`; `[..., K]` over the draft
        vocabulary's columns where `frozen.draft_vocab` is set (its ids: `vocab_columns`)."""
        vocab = frozen.draft_vocab
        return jnp.einsum(
            "...h,hv->...v",
            h_xH.astype(self.dtype),
            (frozen.lm_head_HxV if vocab is None else vocab.lm_head_HxK).astype(self.dtype),
            preferred_element_type=jnp.float32,
        )

    def on_columns(self, ids_K: jax.Array | None) -> DSparkDraft:
        """This draft with its Markov head over the vocabulary ids `ids_K` only (`MarkovHead.on_columns`;
        every other parameter shared); itself for None (the whole vocabulary)."""
        if ids_K is None:
            return self
        view = nnx.merge(*nnx.split(self))
        view.markov = self.markov.on_columns(ids_K)
        return view

    def markov_features(self, h_xH: jax.Array, predecessors_x: jax.Array) -> jax.Array:
        """The Markov representation `m = W1[t]` `[..., R]` of each prediction's predecessor `t` (a group's
        draft may add to it from more inputs)."""
        return self.markov.features(predecessors_x).astype(self.dtype)

    def corrected(
        self,
        base_logits_xV: jax.Array,
        h_xH: jax.Array,
        predecessors_x: jax.Array,
        columns_xK: jax.Array | None = None,
        m_xR: jax.Array | None = None,
    ) -> dict:
        """Markov-corrected logits `l = l0 + W2 m` and confidence logits `w_c . [h; m] + b_c`, with the
        Markov representation `m_xR` (default `markov_features(h, t)`).

        With `columns_xK` the base logits are those of the vocabulary ids `columns_xK` (`[..., K]`) and
        so are the corrected ones.
        """
        if m_xR is None:
            m_xR = self.markov_features(h_xH, predecessors_x)
        confidence = self.confidence(jnp.concatenate([h_xH.astype(self.dtype), m_xR], axis=-1))
        return {
            "logits": base_logits_xV + self.markov.bias(m_xR, columns_xK),
            "confidence_logit": confidence.astype(jnp.float32),
        }

    def heads(
        self,
        frozen: FrozenTarget,
        h_xSxH: jax.Array,
        predecessors_xS: jax.Array,
        m_xSxR: jax.Array | None = None,
    ) -> dict[str, jax.Array]:
        """Corrected logits (float32 `[..., S, V]`, `[..., S, K]` over a draft vocabulary) and confidence
        logits for teacher-forced predecessors (`m_xSxR` as `corrected`'s `m_xR`)."""
        base_xSxV = self.base_logits(frozen, h_xSxH)
        return self.corrected(base_xSxV, h_xSxH, predecessors_xS, vocab_columns(frozen), m_xSxR)
