"""The prefix reranker draft (the seed's "Prefix reranker"): a block-causal prefix transformer rescoring the
Markov head's top-K candidates.

Prediction `i` (0-based; the seed's `i + 1`) has corrected logits `l_i = l0_i + W2 W1[t_i]` and candidates
`C_i = topK(l_i)` (K = 16). The Markov tables double as token tables: `E_in(t) = W1[t]` `[R]` and
`E_out(v)` = column `v` of `W2` `[R]`. The prefix `[t_0..t_i]` (the anchor and the tokens before the
prediction: reference tokens in training, the round's own choices at inference) passes an input projection
of `E_in` plus learned in-block positions and one pre-norm causal transformer layer (width W = 256, 4 heads,
FFN W -> 4W -> W with SiLU, output LayerNorm), giving `r_i`. Then

  `u_i = W_o SiLU(W_q [W_h h_i; r_i] + b_q)`,  `k_v = W_c E_out(v)`,  `s_i(v) = l_i(v) + u_i . k_v / sqrt(W)`

on `v in C_i`. `W_o` is zero-initialised and the candidates keep `l_i`'s order, so ties (and every score
at initialisation) keep the DSpark choice.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.draft.model import DraftConfig, DSparkDraft
from dspark_jax.nn import AttentionProjections, Dtype, LayerNorm, Linear, gqa_attention, normal_init


@dataclasses.dataclass(frozen=True)
class RerankerDraftConfig(DraftConfig):
    """`DraftConfig` plus the reranker's shape.

    Attributes:
      rerank_candidates: candidates per prediction (K, the seed's 16).
      rerank_width: width W of the prefix transformer and of the scoring vectors (256).
      rerank_heads: attention heads of the prefix layer (4).
      rerank_ffn: hidden width of its FFN (1024).
    """

    rerank_candidates: int = 16
    rerank_width: int = 256
    rerank_heads: int = 4
    rerank_ffn: int = 1024

    def __post_init__(self):
        super().__post_init__()
        if not 1 <= self.rerank_candidates <= self.vocab_size:
            raise ValueError(f"draft rerank_candidates={self.rerank_candidates} must be in [1, vocab_size]")
        if self.rerank_width % self.rerank_heads:
            raise ValueError(f"draft rerank_width={self.rerank_width} is not a multiple of rerank_heads")


class Reranked(NamedTuple):
    """Candidates `[..., S, K]` (vocabulary ids in `l_i`'s descending order) and their scores `s_i(v)`."""

    candidates_xSxK: jax.Array
    scores_xSxK: jax.Array


class PrefixReranker(nnx.Module):
    """The prefix transformer and the residual scorer (their parameters only; the Markov tables are the
    draft's)."""

    def __init__(self, cfg: RerankerDraftConfig, *, rngs: nnx.Rngs, param_dtype: Dtype, dtype: Dtype):
        kw = dict(rngs=rngs, param_dtype=param_dtype, dtype=dtype)
        w, r, h = cfg.rerank_width, cfg.markov_rank, cfg.hidden_size
        self.width = w
        self.in_proj = Linear((r,), (w,), ("rank", "rerank"), **kw)
        self.positions = nnx.Param(normal_init(rngs, (cfg.block_size, w), param_dtype), axes=(None, "rerank"))
        self.attn_norm = LayerNorm(w, param_dtype=param_dtype)
        self.attn = AttentionProjections(
            w,
            cfg.rerank_heads,
            cfg.rerank_heads,
            w // cfg.rerank_heads,
            eps=1e-6,
            use_bias=False,
            qk_norm=False,
            **kw,
        )
        self.ffn_norm = LayerNorm(w, param_dtype=param_dtype)
        self.ffn_in = Linear((w,), (cfg.rerank_ffn,), ("rerank", "mlp"), **kw)
        self.ffn_out = Linear((cfg.rerank_ffn,), (w,), ("mlp", "rerank"), **kw)
        self.out_norm = LayerNorm(w, param_dtype=param_dtype)
        self.w_h = Linear((h,), (w,), ("embed", "rerank"), **kw)
        self.w_q = Linear((2 * w,), (w,), (None, "rerank"), use_bias=True, **kw)
        self.w_o = Linear((w,), (w,), (None, "rerank"), zero_init=True, **kw)
        self.w_c = Linear((r,), (w,), ("rank", "rerank"), **kw)

    def prefix(self, e_in_xSxR: jax.Array) -> jax.Array:
        """`r [..., S, W]`: position `i` encodes the prefix `[t_0..t_i]` (causal within the block)."""
        lead, s = e_in_xSxR.shape[:-2], e_in_xSxR.shape[-2]
        x = self.in_proj(e_in_xSxR) + self.positions.get_value()[:s].astype(self.in_proj.dtype)
        x_BxSxW = x.reshape(-1, s, self.width)
        causal_BxSxS = jnp.broadcast_to(jnp.tril(jnp.ones((s, s), bool)), (x_BxSxW.shape[0], s, s))
        h = self.attn_norm(x_BxSxW)
        k, v = self.attn.keys_values(h)
        x_BxSxW = x_BxSxW + self.attn.o(gqa_attention(self.attn.queries(h), k, v, causal_BxSxS))
        x_BxSxW = x_BxSxW + self.ffn_out(jax.nn.silu(self.ffn_in(self.ffn_norm(x_BxSxW))))
        return self.out_norm(x_BxSxW).reshape(*lead, s, self.width)

    def step(self, e_in_BxR: jax.Array, i: int, kv: tuple[jax.Array, jax.Array]):
        """`prefix` one position at a time: `r_i` `[B, W]` from the token at in-block position `i` and the
        keys/values `[B, S, Q, D]` of positions `< i`; returns `r_i` and the keys/values with `i` added."""
        x_BxW = self.in_proj(e_in_BxR) + self.positions.get_value()[i].astype(self.in_proj.dtype)
        h_Bx1xW = self.attn_norm(x_BxW)[:, None]
        k_Bx1, v_Bx1 = self.attn.keys_values(h_Bx1xW)
        k_cache, v_cache = (c.at[:, i].set(n[:, 0].astype(c.dtype)) for c, n in zip(kv, (k_Bx1, v_Bx1)))
        s = k_cache.shape[1]
        visible_Bx1xS = jnp.broadcast_to(jnp.arange(s) <= i, (x_BxW.shape[0], 1, s))
        attended = gqa_attention(self.attn.queries(h_Bx1xW), k_cache, v_cache, visible_Bx1xS)
        x_BxW = x_BxW + self.attn.o(attended)[:, 0]
        x_BxW = x_BxW + self.ffn_out(jax.nn.silu(self.ffn_in(self.ffn_norm(x_BxW))))
        return self.out_norm(x_BxW), (k_cache, v_cache)

    def query_inputs(self, h_xH: jax.Array, r_xW: jax.Array) -> jax.Array:
        """The SiLU input `W_q [W_h h; r] + b_q` `[..., W]` (a unit whose input stays far below 0 is off)."""
        return self.w_q(jnp.concatenate([self.w_h(h_xH), r_xW], axis=-1))

    def queries(self, h_xH: jax.Array, r_xW: jax.Array) -> jax.Array:
        """`u = W_o SiLU(W_q [W_h h; r] + b_q)`."""
        return self.w_o(jax.nn.silu(self.query_inputs(h_xH, r_xW)))

    def deltas(self, u_xW: jax.Array, e_out_xKxR: jax.Array) -> jax.Array:
        """Float32 residual scores `u . W_c E_out(v) / sqrt(W)` of `K` candidates, `[..., K]`."""
        k_xKxW = self.w_c(e_out_xKxR)
        return (
            jnp.einsum("...w,...kw->...k", u_xW, k_xKxW, preferred_element_type=jnp.float32) / self.width**0.5
        )


class RerankerDraft(DSparkDraft):
    """The DSpark draft plus the prefix reranker over its top-K corrected candidates."""

    def __init__(self, cfg: RerankerDraftConfig, *, rngs: nnx.Rngs, param_dtype=None, dtype=None):
        super().__init__(cfg, rngs=rngs, param_dtype=param_dtype, dtype=dtype)
        self.reranker = PrefixReranker(
            cfg, rngs=rngs, param_dtype=jnp.dtype(param_dtype or cfg.param_dtype), dtype=self.dtype
        )

    def rerank(
        self, h_xSxH: jax.Array, logits_xSxV: jax.Array, predecessors_xS: jax.Array, columns_K=None
    ) -> Reranked:
        """Teacher-forced reranking of a whole block: `[t_0..t_i]` are the given predecessors; `columns_K`
        the vocabulary ids of the logits' columns where they cover a draft vocabulary."""
        r_xSxW = self.reranker.prefix(self.markov.features(predecessors_xS).astype(self.dtype))
        return self.score(h_xSxH, r_xSxW, logits_xSxV, columns_K)

    def score(self, h_xH: jax.Array, r_xW: jax.Array, logits_xV: jax.Array, columns_xV=None) -> Reranked:
        """The top-K candidates of `logits` (at vocabulary ids `columns`: each row's own `[..., V]`, or one
        draft vocabulary's `[V]` every row shares; default `0..V-1`) and their
        scores `l(v) + u . k_v / sqrt(W)` for draft states `h` and prefix representations `r`; `K` =
        `rerank_candidates`, or all of `logits` where it has fewer (a decoder's smaller `select_top_k` or
        draft vocabulary: each candidate's score is its own)."""
        top_xK, index_xK = jax.lax.top_k(logits_xV, min(self.cfg.rerank_candidates, logits_xV.shape[-1]))
        if columns_xV is None or columns_xV.ndim == 1:
            candidates_xK = index_xK if columns_xV is None else columns_xV[index_xK]
        else:
            candidates_xK = jnp.take_along_axis(columns_xV, index_xK, axis=-1)
        u_xW = self.reranker.queries(h_xH.astype(self.dtype), r_xW)
        e_out_xKxR = self.markov.columns(candidates_xK).astype(self.dtype)  # `E_out(v)`
        return Reranked(candidates_xK, top_xK + self.reranker.deltas(u_xW, e_out_xKxR))

    def online_rescorer(self, batch: int):
        """`engine.markov_select`'s `rescore` for one block of `batch` rows: the prefix keys/values grow by
        one position per slot (trace-time state) and start empty each cycle."""
        heads = self.cfg.rerank_heads
        shape = (batch, self.cfg.block_size, heads, self.cfg.rerank_width // heads)
        kv = [(jnp.zeros(shape, self.dtype), jnp.zeros(shape, self.dtype))]

        def rescore(i, h_BxH, predecessor_B, logits_BxC, columns_BxC):
            r_BxW, kv[0] = self.reranker.step(
                self.markov.features(predecessor_B).astype(self.dtype), i, kv[0]
            )
            candidates_BxK, scores_BxK = self.score(h_BxH, r_BxW, logits_BxC, columns_BxC)
            return scores_BxK, candidates_BxK

        return rescore
