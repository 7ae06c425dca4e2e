"""The acceptance rule of one speculative-decoding cycle, batched: greedy exact match or lossless sampling.

A cycle: the draft proposed `S` tokens `d_1..d_S` one after another, `d_{i+1}` drawn from the
draft's distribution `q_i` given the tokens chosen before it; the target scored
`[anchor, d_1..d_S]` in one forward, giving `S+1` next-token distributions `p_0..p_S` (`p_i`
predicts `d_{i+1}`; `p_S` is the bonus position after all S drafts). Shape letters: the legend
in `dspark_jax/__init__.py`. The cycle emits the
accepted drafts `d_1..d_m` (`m = num_accepted`) followed by `next_token`, so `m + 1` tokens.

`lengths_B` (optional, `0..S`) verifies only the first `l` drafts of a row, chosen before the target's
verdicts (a prefix scheduler): `m <= l`, and when all `l` are accepted `next_token` is the target's own
token at position `l` (its argmax, or a draw from `p_l`), exactly as if the block had `l` drafts.

Everything here has fixed shapes and is pure JAX: call it under `jax.jit` with `params` static.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dspark_jax.target.generate import SamplingParams, sample, sampling_logits

_UNTEMPERED = SamplingParams(temperature=1.0)


def _check_shapes(draft_BxS: jax.Array, target_logits_BxS1xV: jax.Array) -> None:
    b, s = draft_BxS.shape
    if target_logits_BxS1xV.ndim != 3 or target_logits_BxS1xV.shape[:2] != (b, s + 1):
        raise ValueError(
            f"target logits must be [B, S+1, V] = [{b}, {s + 1}, V] for drafts {draft_BxS.shape}, "
            f"got {target_logits_BxS1xV.shape}"
        )


def sampling_probabilities(logits_xV: jax.Array, params: SamplingParams) -> jax.Array:
    """float32 probabilities actually sampled from at each position: softmax of `sampling_logits`.

    This is `q_i` for draft logits and `p_i` for target logits (temperature > 0 only).
    """
    *lead, v = logits_xV.shape
    probs_xV = jax.nn.softmax(sampling_logits(logits_xV.reshape(-1, v), params), axis=-1)
    return probs_xV.reshape(*lead, v)


def _verified(draft_BxS: jax.Array, lengths_B: jax.Array | None) -> jax.Array:
    """int32 `[B, S]`: 1 where the draft is verified (all of them when `lengths_B` is None)."""
    b, s = draft_BxS.shape
    lengths_B = jnp.full((b,), s) if lengths_B is None else lengths_B
    return (jnp.arange(s) < lengths_B[:, None]).astype(jnp.int32)


def accept_greedy(
    draft_BxS: jax.Array, target_logits_BxS1xV: jax.Array, lengths_B: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """Exact-match acceptance: `(num_accepted_B, next_token_B)`, both int32.

    Accepts the longest prefix with `d_{i+1} == argmax p_i`; `next_token = argmax p_m` is the
    target's correction at the first mismatch, or the bonus token when all S match. The emitted
    tokens are exactly those target-only greedy decoding (`generate.sample` at temperature 0)
    produces from the same logits.
    """
    _check_shapes(draft_BxS, target_logits_BxS1xV)
    target_BxS1 = jnp.argmax(target_logits_BxS1xV, axis=-1).astype(jnp.int32)
    matches_BxS = (draft_BxS.astype(jnp.int32) == target_BxS1[:, :-1]) * _verified(draft_BxS, lengths_B)
    num_accepted_B = jnp.sum(jnp.cumprod(matches_BxS, axis=1), axis=1).astype(jnp.int32)
    next_token_B = jnp.take_along_axis(target_BxS1, num_accepted_B[:, None], axis=1)[:, 0]
    return num_accepted_B, next_token_B


def accept_sampling(
    draft_BxS: jax.Array,
    draft_logits_BxSxV: jax.Array,
    target_logits_BxS1xV: jax.Array,
    rng: jax.Array,
    params: SamplingParams,
    lengths_B: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Lossless speculative sampling (Leviathan et al.; Chen et al.): `(num_accepted_B, next_token_B)`.

    `p_i` and `q_i` are the distributions sampled from, `sampling_probabilities` of the target and
    draft logits under the same `params` (temperature, then top-p). In order, `d_{i+1}` is accepted
    with probability `min(1, p_i(d) / q_i(d))`; the first rejection at position `i` stops the cycle
    and `next_token` is drawn from `normalize(max(0, p_i - q_i))` (from `p_i` if that residual has
    no mass); when all S are accepted it is the bonus draw from `p_S`. The emitted tokens are then
    distributed exactly as target-only sampling with `params`.

    The caller must guarantee that `d_{i+1}` was drawn from exactly `q_i`, i.e. with
    `generate.sample(draft_logits_BxSxV[:, i], key, params)` given the previously chosen tokens;
    otherwise the output is biased. A draft token the target's nucleus excludes (`p_i(d) = 0`) is
    always rejected. At temperature 0 this is `accept_greedy` (`draft_logits_BxSxV` and `rng` unused).

    `rng` gives one uniform per row and position for the accept tests and an independent key for
    the next-token draw, so the result is a deterministic function of the inputs and `rng`.
    """
    if params.temperature == 0:
        return accept_greedy(draft_BxS, target_logits_BxS1xV, lengths_B)
    _check_shapes(draft_BxS, target_logits_BxS1xV)
    b, s = draft_BxS.shape
    if draft_logits_BxSxV.shape != (b, s, target_logits_BxS1xV.shape[2]):
        raise ValueError(
            f"draft logits must be [B, S, V] = {(b, s, target_logits_BxS1xV.shape[2])}, "
            f"got {draft_logits_BxSxV.shape}"
        )
    p_BxS1xV = sampling_probabilities(target_logits_BxS1xV, params)
    q_BxSxV = sampling_probabilities(draft_logits_BxSxV, params)
    draft_BxSx1 = draft_BxS.astype(jnp.int32)[:, :, None]
    p_draft_BxS = jnp.take_along_axis(p_BxS1xV[:, :s], draft_BxSx1, axis=-1)[..., 0]
    q_draft_BxS = jnp.take_along_axis(q_BxSxV, draft_BxSx1, axis=-1)[..., 0]

    accept_rng, token_rng = jax.random.split(rng)
    u_BxS = jax.random.uniform(accept_rng, (b, s), jnp.float32)
    # `u < p / q` without the division: `p = 0` always rejects, `q = 0 < p` always accepts, and
    # `p = q > 0` always accepts since `u < 1`.
    verified_BxS = _verified(draft_BxS, lengths_B)
    accepted_BxS = (u_BxS * q_draft_BxS < p_draft_BxS) * verified_BxS
    num_accepted_B = jnp.sum(jnp.cumprod(accepted_BxS, axis=1), axis=1).astype(jnp.int32)

    # Unverified positions (and S) have no draft: a zero `q` makes the residual `p`, the bonus distribution.
    q_BxS1xV = jnp.pad(q_BxSxV * verified_BxS[..., None], ((0, 0), (0, 1), (0, 0)))
    at_Bx1x1 = num_accepted_B[:, None, None]
    p_BxV = jnp.take_along_axis(p_BxS1xV, at_Bx1x1, axis=1)[:, 0]
    q_BxV = jnp.take_along_axis(q_BxS1xV, at_Bx1x1, axis=1)[:, 0]
    residual_BxV = jnp.maximum(p_BxV - q_BxV, 0.0)
    empty_Bx1 = jnp.sum(residual_BxV, axis=-1, keepdims=True) <= 0.0
    # Unnormalised is fine: categorical sampling normalises; log(0) = -inf excludes a token.
    next_BxV = jnp.where(empty_Bx1, p_BxV, residual_BxV)
    next_token_B = sample(jnp.log(next_BxV), token_rng, _UNTEMPERED)
    return num_accepted_B, next_token_B
