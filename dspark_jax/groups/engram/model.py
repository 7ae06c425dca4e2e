"""The Engram drafts (the seed's three Engram groups): n-gram features into the Markov head or the MASK slots.

`e[t]` is the raw Engram feature `[U]` of the prefix ending at `x[t]` (`dspark_jax.groups.engram`). With `N`
the RMSNorm without affine parameters:

  Engram-Markov   prediction `i` (predecessor `t_i = x[a+i]`) reads `e[a+i]`:
                  `q = N(W_Q N(h_i))`, `k = N(W_K N(e))`, `v = W_V N(e)` (rank R, `W_V` zero-init),
                  `s = q.k / sqrt(R)`, `g = sigmoid(sign(s) sqrt(max(|s|, 1e-6)))`,
                  `m_i = W1[t_i] + g v`; logits and confidence read `m_i` (+3 U R parameters).
  Engram-MASK     the block at anchor `a` reads the pre-anchor feature `e[a-1]` (zero when `a` starts
   gated          its sample or the block is padding): `z = N(P e)`, slots `[E(x[a]), E(MASK) +
                  tanh(theta_j) z]`, `theta` zero-init (+U H + S-1 parameters).
   replacement    slots `[E(x[a]), z x (S-1)]`, no MASK (+U H parameters, minus a learned MASK).

At initialisation Engram-Markov and gated Engram-MASK compute exactly what the baseline computes with
the same weights (`W_V = 0`, `theta = 0`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.draft.model import DraftConfig, DSparkDraft, FrozenTarget
from dspark_jax.nn import Linear, rms_norm

# The seed's floor under |s| in the gate's signed square root.
GATE_FLOOR = 1e-6


@dataclasses.dataclass(frozen=True)
class EngramDraftConfig(DraftConfig):
    """`DraftConfig` plus the shape of the Engram features the draft reads (set from `config.engram`).

    Attributes:
      engram_dim: feature width `U` (orders x heads x row width of the table).
      engram_order: the table's largest n-gram order `N` (inference keeps the last `N` tokens).
    """

    engram_dim: int = 576
    engram_order: int = 3

    def __post_init__(self):
        super().__post_init__()
        if self.engram_dim < 1 or self.engram_order < 2:
            raise ValueError(
                f"draft engram_dim={self.engram_dim} must be > 0 and engram_order={self.engram_order} >= 2"
            )


class EngramMarkovDraft(DSparkDraft):
    """The baseline draft whose Markov representation gains a gated Engram value (Engram-Markov)."""

    def __init__(self, cfg: EngramDraftConfig, *, rngs: nnx.Rngs, param_dtype=None, dtype=None):
        super().__init__(cfg, rngs=rngs, param_dtype=param_dtype, dtype=dtype)
        kw = dict(rngs=rngs, param_dtype=jnp.dtype(param_dtype or cfg.param_dtype), dtype=self.dtype)
        r, u = cfg.markov_rank, cfg.engram_dim
        self.engram_q = Linear((cfg.hidden_size,), (r,), ("embed", "rank"), **kw)
        self.engram_k = Linear((u,), (r,), ("engram", "rank"), **kw)
        self.engram_v = Linear((u,), (r,), ("engram", "rank"), zero_init=True, **kw)

    def markov_features(self, h_xH, predecessors_x, engram_xU=None):
        """`m = W1[t] + g v` (the gate and value of the predecessor prefix's features `engram_xU`)."""
        if engram_xU is None:
            raise ValueError("Engram-Markov needs the predecessors' Engram features")
        eps, r = self.cfg.rms_norm_eps, self.cfg.markov_rank
        e_xU = rms_norm(engram_xU.astype(self.dtype), eps)
        q_xR = rms_norm(self.engram_q(rms_norm(h_xH.astype(self.dtype), eps)), eps)
        k_xR = rms_norm(self.engram_k(e_xU), eps)
        s_x1 = jnp.sum(q_xR.astype(jnp.float32) * k_xR.astype(jnp.float32), -1, keepdims=True) / r**0.5
        g_x1 = jax.nn.sigmoid(jnp.sign(s_x1) * jnp.sqrt(jnp.maximum(jnp.abs(s_x1), GATE_FLOOR)))
        return super().markov_features(h_xH, predecessors_x) + (g_x1 * self.engram_v(e_xU)).astype(self.dtype)


class EngramMaskDraft(DSparkDraft):
    """The baseline draft whose MASK slots gain `tanh(theta_j) N(P e[a-1])` (gated Engram-MASK)."""

    GATED = True  # False: the slots are `z` itself (replacement), no gates

    def __init__(self, cfg: EngramDraftConfig, *, rngs: nnx.Rngs, param_dtype=None, dtype=None):
        super().__init__(cfg, rngs=rngs, param_dtype=param_dtype, dtype=dtype)
        param_dtype = jnp.dtype(param_dtype or cfg.param_dtype)
        self.engram_proj = Linear(
            (cfg.engram_dim,),
            (cfg.hidden_size,),
            ("engram", "embed"),
            rngs=rngs,
            param_dtype=param_dtype,
            dtype=self.dtype,
        )
        if self.GATED:
            self.engram_gates = nnx.Param(jnp.zeros((cfg.block_size - 1,), param_dtype), axes=(None,))

    def engram_inputs(self, engram_BxNxU: jax.Array | None) -> jax.Array:
        """`z = N(P e)` `[B, N, H]`: the projected pre-anchor features (zero features give zero)."""
        if engram_BxNxU is None:
            raise ValueError("Engram-MASK needs the pre-anchor Engram features")
        return rms_norm(self.engram_proj(engram_BxNxU.astype(self.dtype)), self.cfg.rms_norm_eps)

    def block_inputs(self, frozen: FrozenTarget, anchor_tokens_BxN, engram_BxNxU=None):
        z_BxNxH = self.engram_inputs(engram_BxNxU)
        x_BxNxSxH = super().block_inputs(frozen, anchor_tokens_BxN)
        gate_S = jnp.concatenate([jnp.zeros((1,)), jnp.tanh(self.engram_gates.get_value())]).astype(
            self.dtype
        )
        return x_BxNxSxH + gate_S[:, None] * z_BxNxH[:, :, None]


class EngramReplaceDraft(EngramMaskDraft):
    """Slots 1..S-1 are `N(P e[a-1])` itself: no MASK vector, no gates (Engram-MASK replacement)."""

    GATED = False

    def __init__(self, cfg: EngramDraftConfig, *, rngs: nnx.Rngs, param_dtype=None, dtype=None):
        super().__init__(cfg, rngs=rngs, param_dtype=param_dtype, dtype=dtype)
        self.mask_embedding = None  # the baseline's learned MASK (when it has one) is not used

    def block_inputs(self, frozen: FrozenTarget, anchor_tokens_BxN, engram_BxNxU=None):
        z_BxNxH = self.engram_inputs(engram_BxNxU)
        anchor_BxNxH = jnp.take(frozen.embedding_VxH, anchor_tokens_BxN, axis=0).astype(self.dtype)
        slots_BxNxSxH = jnp.broadcast_to(
            z_BxNxH[:, :, None], (*z_BxNxH.shape[:2], self.cfg.block_size, z_BxNxH.shape[-1])
        )
        return slots_BxNxSxH.at[:, :, 0].set(anchor_BxNxH)
