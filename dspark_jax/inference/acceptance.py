"""The acceptance rule of one speculative-decoding cycle, batched: greedy exact match or lossless sampling.

A cycle: the draft proposed `K` tokens `d_1..d_K` one after another, `d_{i+1}` drawn from the
draft's distribution `q_i` given the tokens chosen before it; the target scored
`[anchor, d_1..d_K]` in one forward, giving `K+1` next-token distributions `p_0..p_K` (`p_i`
predicts `d_{i+1}`; `p_K` is the bonus position after all K drafts). The cycle emits the
accepted drafts `d_1..d_m` (`m = num_accepted`) followed by `next_token`, so `m + 1` tokens.

Everything here has fixed shapes and is pure JAX: call it under `jax.jit` with `params` static.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dspark_jax.target.generate import SamplingParams, sample, sampling_logits

_UNTEMPERED = SamplingParams(temperature=1.0)


def _check_shapes(draft_BxK: jax.Array, target_logits_BxK1xV: jax.Array) -> None:
    b, k = draft_BxK.shape
    if target_logits_BxK1xV.ndim != 3 or target_logits_BxK1xV.shape[:2] != (b, k + 1):
        raise ValueError(
            f"target logits must be [B, K+1, V] = [{b}, {k + 1}, V] for drafts {draft_BxK.shape}, "
            f"got {target_logits_BxK1xV.shape}"
        )


def sampling_probabilities(logits_BxNxV: jax.Array, params: SamplingParams) -> jax.Array:
    """float32 probabilities actually sampled from at each position: softmax of `sampling_logits`.

    This is `q_i` for draft logits and `p_i` for target logits (temperature > 0 only).
    """
    *lead, v = logits_BxNxV.shape
    probs_MxV = jax.nn.softmax(sampling_logits(logits_BxNxV.reshape(-1, v), params), axis=-1)
    return probs_MxV.reshape(*lead, v)


def accept_greedy(draft_BxK: jax.Array, target_logits_BxK1xV: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Exact-match acceptance: `(num_accepted_B, next_token_B)`, both int32.

    Accepts the longest prefix with `d_{i+1} == argmax p_i`; `next_token = argmax p_m` is the
    target's correction at the first mismatch, or the bonus token when all K match. The emitted
    tokens are exactly those target-only greedy decoding (`generate.sample` at temperature 0)
    produces from the same logits.
    """
    _check_shapes(draft_BxK, target_logits_BxK1xV)
    target_BxK1 = jnp.argmax(target_logits_BxK1xV, axis=-1).astype(jnp.int32)
    matches_BxK = (draft_BxK.astype(jnp.int32) == target_BxK1[:, :-1]).astype(jnp.int32)
    num_accepted_B = jnp.sum(jnp.cumprod(matches_BxK, axis=1), axis=1).astype(jnp.int32)
    next_token_B = jnp.take_along_axis(target_BxK1, num_accepted_B[:, None], axis=1)[:, 0]
    return num_accepted_B, next_token_B


def accept_sampling(
    draft_BxK: jax.Array,
    draft_logits_BxKxV: jax.Array,
    target_logits_BxK1xV: jax.Array,
    rng: jax.Array,
    params: SamplingParams,
) -> tuple[jax.Array, jax.Array]:
    """Lossless speculative sampling (Leviathan et al.; Chen et al.): `(num_accepted_B, next_token_B)`.

    `p_i` and `q_i` are the distributions sampled from, `sampling_probabilities` of the target and
    draft logits under the same `params` (temperature, then top-p). In order, `d_{i+1}` is accepted
    with probability `min(1, p_i(d) / q_i(d))`; the first rejection at position `i` stops the cycle
    and `next_token` is drawn from `normalize(max(0, p_i - q_i))` (from `p_i` if that residual has
    no mass); when all K are accepted it is the bonus draw from `p_K`. The emitted tokens are then
    distributed exactly as target-only sampling with `params`.

    The caller must guarantee that `d_{i+1}` was drawn from exactly `q_i`, i.e. with
    `generate.sample(draft_logits_BxKxV[:, i], key, params)` given the previously chosen tokens;
    otherwise the output is biased. A draft token the target's nucleus excludes (`p_i(d) = 0`) is
    always rejected. At temperature 0 this is `accept_greedy` (`draft_logits_BxKxV` and `rng` unused).

    `rng` gives one uniform per row and position for the accept tests and an independent key for
    the next-token draw, so the result is a deterministic function of the inputs and `rng`.
    """
    if params.temperature == 0:
        return accept_greedy(draft_BxK, target_logits_BxK1xV)
    _check_shapes(draft_BxK, target_logits_BxK1xV)
    b, k = draft_BxK.shape
    if draft_logits_BxKxV.shape != (b, k, target_logits_BxK1xV.shape[2]):
        raise ValueError(
            f"draft logits must be [B, K, V] = {(b, k, target_logits_BxK1xV.shape[2])}, "
            f"got {draft_logits_BxKxV.shape}"
        )
    p_BxK1xV = sampling_probabilities(target_logits_BxK1xV, params)
    q_BxKxV = sampling_probabilities(draft_logits_BxKxV, params)
    draft_BxKx1 = draft_BxK.astype(jnp.int32)[:, :, None]
    p_draft_BxK = jnp.take_along_axis(p_BxK1xV[:, :k], draft_BxKx1, axis=-1)[..., 0]
    q_draft_BxK = jnp.take_along_axis(q_BxKxV, draft_BxKx1, axis=-1)[..., 0]

    accept_rng, token_rng = jax.random.split(rng)
    u_BxK = jax.random.uniform(accept_rng, (b, k), jnp.float32)
    # `u < p / q` without the division: `p = 0` always rejects, `q = 0 < p` always accepts, and
    # `p = q > 0` always accepts since `u < 1`.
    accepted_BxK = (u_BxK * q_draft_BxK < p_draft_BxK).astype(jnp.int32)
    num_accepted_B = jnp.sum(jnp.cumprod(accepted_BxK, axis=1), axis=1).astype(jnp.int32)

    # Position K has no draft: a zero `q_K` makes its residual `p_K`, the bonus distribution.
    q_BxK1xV = jnp.pad(q_BxKxV, ((0, 0), (0, 1), (0, 0)))
    at_Bx1x1 = num_accepted_B[:, None, None]
    p_BxV = jnp.take_along_axis(p_BxK1xV, at_Bx1x1, axis=1)[:, 0]
    q_BxV = jnp.take_along_axis(q_BxK1xV, at_Bx1x1, axis=1)[:, 0]
    residual_BxV = jnp.maximum(p_BxV - q_BxV, 0.0)
    empty_Bx1 = jnp.sum(residual_BxV, axis=-1, keepdims=True) <= 0.0
    # Unnormalised is fine: categorical sampling normalises; log(0) = -inf excludes a token.
    next_BxV = jnp.where(empty_Bx1, p_BxV, residual_BxV)
    next_token_B = sample(jnp.log(next_BxV), token_rng, _UNTEMPERED)
    return num_accepted_B, next_token_B
