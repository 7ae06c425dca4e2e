"""Acceptance of a speculative cycle: greedy exact match, and sampling proven lossless by chi-square tests."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import chisquare

from dspark_jax.inference.acceptance import accept_greedy, accept_sampling, sampling_probabilities
from dspark_jax.target.generate import SamplingParams, sample

V, S, B = 5, 3, 20_000  # vocabulary, drafts per cycle, rows of the Monte Carlo batch
ANCHOR = 0
P_MIN = 1e-3


def _one_hot_logits(tokens_BxT: np.ndarray, v: int) -> jnp.ndarray:
    return jnp.asarray(np.eye(v, dtype=np.float32)[tokens_BxT] * 4.0)


def test_greedy_accepts_longest_matching_prefix():
    target_BxS1 = np.array([[1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [6, 0, 7, 1, 2], [3, 3, 3, 3, 3]])
    draft_BxS = np.array([[0, 2, 3, 4], [1, 2, 0, 4], [6, 0, 7, 1], [3, 3, 3, 2]])
    num, nxt = jax.jit(accept_greedy)(jnp.asarray(draft_BxS), _one_hot_logits(target_BxS1, 8))
    np.testing.assert_array_equal(num, [0, 2, 4, 3])
    np.testing.assert_array_equal(nxt, [1, 3, 2, 3])  # correction, correction, bonus, correction
    # Temperature 0 sampling is the greedy rule.
    num0, nxt0 = accept_sampling(
        jnp.asarray(draft_BxS),
        jnp.zeros((4, 4, 8)),
        _one_hot_logits(target_BxS1, 8),
        jax.random.key(0),
        SamplingParams(),
    )
    np.testing.assert_array_equal(num0, num)
    np.testing.assert_array_equal(nxt0, nxt)


def test_greedy_speculation_reproduces_target_greedy_decoding():
    rng = np.random.default_rng(0)
    target_VxV = rng.normal(size=(16, 16)).astype(np.float32)  # a Markov-chain "target"
    draft_VxV = target_VxV + rng.normal(size=(16, 16)).astype(np.float32)  # an imperfect draft
    reference = [3]
    for _ in range(40):
        reference.append(int(np.argmax(target_VxV[reference[-1]])))
    emitted, cycles = [3], 0
    while len(emitted) < len(reference):
        draft = [emitted[-1]]
        for _ in range(4):
            draft.append(int(np.argmax(draft_VxV[draft[-1]])))
        num, nxt = accept_greedy(jnp.asarray([draft[1:]]), jnp.asarray(target_VxV[draft][None]))
        emitted += [*draft[1 : 1 + int(num[0])], int(nxt[0])]
        cycles += 1
    assert emitted[: len(reference)] == reference
    assert cycles < len(reference) - 1  # some drafts were accepted


def _nucleus_probs(logits_BxV: np.ndarray, params: SamplingParams) -> np.ndarray:
    """numpy reference of the sampled distribution: temperature, then keep the top-p nucleus (ties kept)."""
    scaled = logits_BxV.astype(np.float64) / params.temperature
    probs = np.exp(scaled - scaled.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.zeros_like(probs)
    for row, p in enumerate(probs):
        order = np.argsort(-p, kind="stable")
        before = np.cumsum(p[order]) - p[order]
        threshold = p[order][before < params.top_p].min()
        out[row] = np.where(p >= threshold, p, 0.0)
    return out / out.sum(-1, keepdims=True)


@functools.partial(jax.jit, static_argnames="params")
def _cycle(anchor_B, rng, target_VxV, draft_VxV, params):
    """One cycle per row: sample S drafts sequentially from the Markov draft, then accept."""
    draft_rng, accept_rng = jax.random.split(rng)
    tokens, draft_logits = [anchor_B], []
    for i in range(S):
        draft_logits.append(draft_VxV[tokens[-1]])
        tokens.append(sample(draft_logits[-1], jax.random.fold_in(draft_rng, i), params))
    seq_BxS1 = jnp.stack(tokens, axis=1)
    num_B, next_B = accept_sampling(
        seq_BxS1[:, 1:], jnp.stack(draft_logits, axis=1), target_VxV[seq_BxS1], accept_rng, params
    )
    position_S1 = jnp.arange(S + 1)
    drafts_BxS1 = jnp.pad(seq_BxS1[:, 1:], ((0, 0), (0, 1)), constant_values=-1)
    last_BxS1 = jnp.where(position_S1 == num_B[:, None], next_B[:, None], -1)
    emitted_BxS1 = jnp.where(position_S1 < num_B[:, None], drafts_BxS1, last_BxS1)
    return num_B, emitted_BxS1


def _chi_square_p(samples: np.ndarray, probs: np.ndarray) -> float:
    """Goodness of fit of `samples` (ints) to `probs`; cells with expected count < 5 are pooled."""
    probs = np.asarray(probs, np.float64) / np.sum(probs, dtype=np.float64)
    counts = np.bincount(samples, minlength=probs.size)
    assert counts[probs == 0].sum() == 0, "a token outside the target's support was emitted"
    expected = probs * samples.size
    big = expected >= 5
    observed, wanted = counts[big], expected[big]
    if expected[~big].sum() > 0:
        observed, wanted = np.append(observed, counts[~big].sum()), np.append(wanted, expected[~big].sum())
    return float(chisquare(observed, wanted * observed.sum() / wanted.sum()).pvalue)


CASES = {
    "t1.0": (SamplingParams(1.0), False),
    "t0.7_p0.9": (SamplingParams(0.7, 0.9), False),
    "identical_draft": (SamplingParams(1.0), True),
}


@pytest.mark.parametrize("case", CASES)
def test_sampling_is_lossless(case):
    params, identical = CASES[case]
    rng = np.random.default_rng(1)
    target_VxV = rng.normal(scale=1.5, size=(V, V)).astype(np.float32)
    draft_VxV = target_VxV if identical else rng.normal(scale=1.5, size=(V, V)).astype(np.float32)
    key1, key2 = jax.random.split(jax.random.key(7))
    num1, emitted1 = _cycle(
        jnp.full((B,), ANCHOR), key1, jnp.asarray(target_VxV), jnp.asarray(draft_VxV), params
    )
    # A second cycle from the emitted token where the first emitted only one.
    _, emitted2 = _cycle(emitted1[:, 0], key2, jnp.asarray(target_VxV), jnp.asarray(draft_VxV), params)
    num1, emitted1, emitted2 = np.asarray(num1), np.asarray(emitted1), np.asarray(emitted2)
    first = emitted1[:, 0]
    second = np.where(num1 >= 1, emitted1[:, 1], emitted2[:, 0])

    p_VxV = _nucleus_probs(target_VxV, params)  # row: previous token
    p_first = p_VxV[ANCHOR]
    p_pair = (p_first[:, None] * p_VxV).ravel()
    p_values = (_chi_square_p(first, p_first), _chi_square_p(first * V + second, p_pair))
    print(
        f"{case}: chi-square p first={p_values[0]:.4f} pair={p_values[1]:.4f} mean accepted={num1.mean():.3f}"
    )
    assert min(p_values) > P_MIN

    # The first draft is accepted with probability sum_x min(p_0(x), q_0(x)).
    accept_rate = np.minimum(p_first, _nucleus_probs(draft_VxV, params)[ANCHOR]).sum()
    assert abs((num1 >= 1).mean() - accept_rate) < 5 * np.sqrt(accept_rate * (1 - accept_rate) / B) + 1e-6
    if identical:
        assert (num1 == S).mean() > 0.999


def test_draft_token_outside_target_nucleus_is_always_rejected():
    params = SamplingParams(1.0, top_p=0.5)
    target_BxS1xV = jnp.tile(jnp.array([3.0, 0.0, 0.0, 0.0, 0.0]), (1000, 3, 1))  # nucleus {0}
    draft_BxSxV = jnp.tile(jnp.array([0.0, 0.0, 1.0, 0.0, 0.0]), (1000, 2, 1))  # q(2) = 0.4
    assert float(sampling_probabilities(draft_BxSxV, params)[0, 0, 2]) > 0.3
    num, nxt = accept_sampling(jnp.full((1000, 2), 2), draft_BxSxV, target_BxS1xV, jax.random.key(1), params)
    np.testing.assert_array_equal(num, 0)
    np.testing.assert_array_equal(nxt, 0)  # the residual max(0, p - q) is all on token 0


def test_zero_mass_residual_falls_back_to_target():
    # p == q, and the draft token lies outside both supports: rejected, and max(0, p - q) is all zeros.
    logits_V = jnp.array([1.0, 0.0, 0.5, -jnp.inf])
    num, nxt = accept_sampling(
        jnp.full((4000, 1), 3),
        jnp.tile(logits_V, (4000, 1, 1)),
        jnp.tile(logits_V, (4000, 2, 1)),
        jax.random.key(2),
        SamplingParams(1.0),
    )
    np.testing.assert_array_equal(num, 0)
    p = np.asarray(jax.nn.softmax(logits_V))
    assert _chi_square_p(np.asarray(nxt), p) > P_MIN


def test_sampling_is_deterministic_per_rng():
    rng = np.random.default_rng(3)
    draft_logits = jnp.asarray(rng.normal(size=(64, S, V)), jnp.float32)
    target_logits = jnp.asarray(rng.normal(size=(64, S + 1, V)), jnp.float32)
    draft = jnp.asarray(rng.integers(0, V, size=(64, S)))
    params = SamplingParams(0.8, 0.95)
    run = jax.jit(accept_sampling, static_argnames="params")
    a = run(draft, draft_logits, target_logits, jax.random.key(5), params)
    b = run(draft, draft_logits, target_logits, jax.random.key(5), params)
    c = run(draft, draft_logits, target_logits, jax.random.key(6), params)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert any(not np.array_equal(x, y) for x, y in zip(a, c))
    assert a[0].dtype == a[1].dtype == jnp.int32


def test_shape_mismatch_is_rejected():
    with pytest.raises(ValueError, match="target logits"):
        accept_greedy(jnp.zeros((2, 3), jnp.int32), jnp.zeros((2, 3, 5)))
    with pytest.raises(ValueError, match="draft logits"):
        accept_sampling(
            jnp.zeros((2, 3), jnp.int32),
            jnp.zeros((2, 4, 5)),
            jnp.zeros((2, 4, 5)),
            jax.random.key(0),
            SamplingParams(1.0),
        )
