"""Acceptance of a speculative cycle: greedy exact match, and sampling proven lossless by chi-square tests."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import chi2, chisquare

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


def biased_at_position_3(draft_BxS, draft_logits_BxSxV, target_logits_BxS1xV, rng, params, lengths_B=None):
    """A deliberately defective rule for power checks: `accept_sampling`, except that a draft rejected
    at position 3 (the fourth) is accepted anyway half of the time, the next token then drawn from `p_4`."""
    num_B, next_B = accept_sampling(
        draft_BxS, draft_logits_BxSxV, target_logits_BxS1xV, rng, params, lengths_B
    )
    flip_B = (num_B == 3) & jax.random.bernoulli(jax.random.fold_in(rng, 99), 0.5, num_B.shape)
    bonus_B = sample(target_logits_BxS1xV[:, 4], jax.random.fold_in(rng, 98), params)
    return jnp.where(flip_B, 4, num_B), jnp.where(flip_B, bonus_B, next_B)


def residual_biased_from_position_3(
    draft_BxS, draft_logits_BxSxV, target_logits_BxS1xV, rng, params, lengths_B=None
):
    """A deliberately defective rule for power checks: `accept_sampling`, except that a rejection at draft
    position 3 or later draws the next token from `p_i` instead of the residual `max(0, p_i - q_i)`."""
    num_B, next_B = accept_sampling(
        draft_BxS, draft_logits_BxSxV, target_logits_BxS1xV, rng, params, lengths_B
    )
    cap_B = jnp.full_like(num_B, draft_BxS.shape[1]) if lengths_B is None else lengths_B
    rejected_B = (num_B >= 3) & (num_B < cap_B)
    at_B = jnp.minimum(num_B, target_logits_BxS1xV.shape[1] - 1)
    wrong_B = sample(
        target_logits_BxS1xV[jnp.arange(num_B.shape[0]), at_B], jax.random.fold_in(rng, 97), params
    )
    return num_B, jnp.where(rejected_B, wrong_B, next_B)


def summed_chi_square_p(draws) -> float:
    """The p-value of the chi-square statistics of several goodness-of-fit tests summed (their degrees of
    freedom too): `draws` yields `(tokens, probabilities [V])` pairs; pairs of fewer than 50 tokens skipped;
    0 where a token outside a distribution's support was drawn."""
    stat, dof = 0.0, 0
    for tokens, probs in draws:
        if tokens.size < 50:
            continue
        probs = np.asarray(probs, np.float64) / np.sum(probs, dtype=np.float64)
        counts = np.bincount(tokens, minlength=probs.size)
        if counts[probs == 0].any():  # a token the distribution cannot emit: no fit at all
            return 0.0
        live = probs > 0
        expected = probs[live] * tokens.size
        stat += float((((counts[live] - expected) ** 2) / expected).sum())
        dof += int(live.sum()) - 1
    return float(chi2.sf(stat, dof)) if dof else 1.0


def per_position_pvalues(streams_RxN: np.ndarray, conditional) -> list[float]:
    """For each position `j` of `N` sampled tokens per row, the p-value of token `j` given its row's
    `j`-token prefix against `conditional(prefix) -> probabilities [V]`, over every prefix seen (a test per
    position: a bias at one position is not diluted over the `V ** N` joint cells)."""
    out = []
    for j in range(streams_RxN.shape[1]):
        prefixes, inverse = np.unique(streams_RxN[:, :j], axis=0, return_inverse=True)
        inverse = inverse.reshape(-1)
        draws = ((streams_RxN[inverse == i, j], conditional(tuple(x))) for i, x in enumerate(prefixes))
        out.append(summed_chi_square_p(draws))
    return out


@functools.partial(jax.jit, static_argnames=("params", "s", "accept", "capped"))
def _cycle(anchor_B, rng, target_VxV, draft_VxV, params, s=S, accept=accept_sampling, capped=False):
    """One cycle per row: sample `s` drafts sequentially from the Markov draft, then accept; `capped`
    verifies a random number `0..s` of them per row (a prefix scheduler's cap, chosen before the verdicts).
    Returns the accepted counts, the `s + 1` emitted slots (-1 past the emitted ones) and the caps."""
    draft_rng, accept_rng, cap_rng = jax.random.split(rng, 3)
    tokens, draft_logits = [anchor_B], []
    for i in range(s):
        draft_logits.append(draft_VxV[tokens[-1]])
        tokens.append(sample(draft_logits[-1], jax.random.fold_in(draft_rng, i), params))
    seq_BxS1 = jnp.stack(tokens, axis=1)
    lengths_B = jax.random.randint(cap_rng, anchor_B.shape, 0, s + 1) if capped else None
    num_B, next_B = accept(
        seq_BxS1[:, 1:], jnp.stack(draft_logits, axis=1), target_VxV[seq_BxS1], accept_rng, params, lengths_B
    )
    position_S1 = jnp.arange(s + 1)
    drafts_BxS1 = jnp.pad(seq_BxS1[:, 1:], ((0, 0), (0, 1)), constant_values=-1)
    last_BxS1 = jnp.where(position_S1 == num_B[:, None], next_B[:, None], -1)
    emitted_BxS1 = jnp.where(position_S1 < num_B[:, None], drafts_BxS1, last_BxS1)
    return num_B, emitted_BxS1, jnp.full_like(num_B, s) if lengths_B is None else lengths_B


def chi_square_p(samples: np.ndarray, probs: np.ndarray) -> float:
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


def joint_cells(streams_RxN: np.ndarray, v: int) -> np.ndarray:
    """Each row's `N` tokens as one cell of the `v ** N` joint outcomes (first token most significant)."""
    return streams_RxN.astype(np.int64) @ (v ** np.arange(streams_RxN.shape[1])[::-1])


CASES = {
    "t1.0": (SamplingParams(1.0), False),
    "t0.7_p0.9": (SamplingParams(0.7, 0.9), False),
    "identical_draft": (SamplingParams(1.0), True),
}
V_JOINT, S_JOINT, B_JOINT = 3, 4, 60_000  # 3 ** 5 joint outcomes of a whole cycle's S + 1 tokens


def _markov_pair(seed=1, identical=False, v=V_JOINT):
    rng = np.random.default_rng(seed)
    target_VxV = rng.normal(scale=1.5, size=(v, v)).astype(np.float32)
    draft_VxV = target_VxV if identical else rng.normal(scale=1.5, size=(v, v)).astype(np.float32)
    return target_VxV, draft_VxV


def _speculated_stream(target_VxV, draft_VxV, params, n, accept=accept_sampling, capped=False):
    """The first `n` tokens after the anchor, `[B_JOINT, n]`, by speculative cycles from each row's last
    token (the first cycle alone emits up to S + 1 = n of them); and the first cycle's accepted counts and
    verification caps."""
    stream = np.full((B_JOINT, n + S_JOINT + 1), -1)
    count, last = np.zeros(B_JOINT, int), jnp.full((B_JOINT,), ANCHOR)
    rows, first = np.arange(B_JOINT), None
    for c in range(n):
        num, emitted, lengths = _cycle(
            last,
            jax.random.key(c),
            jnp.asarray(target_VxV),
            jnp.asarray(draft_VxV),
            params,
            S_JOINT,
            accept,
            capped,
        )
        num, emitted = np.asarray(num), np.asarray(emitted)
        first = (num, np.asarray(lengths)) if first is None else first
        for k in range(S_JOINT + 1):
            write = (k <= num) & (count + k < stream.shape[1])
            stream[rows[write], (count + k)[write]] = emitted[write, k]
        count += num + 1
        last = jnp.asarray(emitted[rows, num])
    return stream[:, :n], *first


def _joint_pvalue(target_VxV, draft_VxV, params, accept=accept_sampling, capped=False):
    """Chi-square p-value of the joint distribution of the S + 1 tokens after the anchor against the Markov
    target's, `p(x_1..x_5) = prod p(x_k | x_{k-1})`; the per-position p-values (`per_position_pvalues`,
    then the residual draw at each draft position); and the first cycle's accepted counts."""
    n = S_JOINT + 1
    stream, num, caps = _speculated_stream(target_VxV, draft_VxV, params, n, accept, capped)
    p_VxV = _nucleus_probs(target_VxV, params)  # row: previous token
    joint = p_VxV[ANCHOR]  # over x_1; each step appends x_k as the least significant digit
    for _ in range(n - 1):
        joint = (joint[:, None] * p_VxV[np.arange(joint.size) % V_JOINT]).ravel()
    positions = per_position_pvalues(stream, lambda prefix: p_VxV[(ANCHOR, *prefix)[-1]])
    # The first cycle's draw after a rejection at draft position k (k < its cap), given the token before it,
    # against the residual `max(0, p - q)` (`p` where that has no mass).
    q_VxV = _nucleus_probs(draft_VxV, params)
    residual_VxV = np.maximum(p_VxV - q_VxV, 0.0)
    residual_VxV = np.where(residual_VxV.sum(-1, keepdims=True) > 0, residual_VxV, p_VxV)
    previous = np.concatenate([np.full((B_JOINT, 1), ANCHOR), stream[:, :-1]], axis=1)
    for k in range(S_JOINT):
        rows = (num == k) & (k < caps)
        draws = ((stream[rows & (previous[:, k] == t), k], residual_VxV[t]) for t in range(V_JOINT))
        positions.append(summed_chi_square_p(draws))
    return chi_square_p(joint_cells(stream, V_JOINT), joint), positions, num


@pytest.mark.parametrize("capped", [False, True], ids=["all_verified", "capped"])
@pytest.mark.parametrize("case", CASES)
def test_sampling_is_lossless_jointly_over_a_whole_cycle(case, capped):
    """All S + 1 tokens a cycle can emit, jointly (243 cells), follow the target: every accepted-length
    path, the residual draws and the bonus draw, and with a per-row verification cap the bonus at the cap."""
    params, identical = CASES[case]
    target_VxV, draft_VxV = _markov_pair(identical=identical)
    p_value, positions, num = _joint_pvalue(target_VxV, draft_VxV, params, capped=capped)
    print(
        f"{case} capped={capped}: joint chi-square p={p_value:.4f}, per position {np.round(positions, 4)}, "
        f"accepted {np.bincount(num, minlength=5)}"
    )
    assert p_value > P_MIN and min(positions) > P_MIN / len(positions)
    if identical and not capped:
        assert (num == S_JOINT).mean() > 0.999
    else:
        assert np.all(np.bincount(num, minlength=S_JOINT + 1) > 0.02 * B_JOINT)  # every path well sampled
    if not capped:
        # The first draft is accepted with probability sum_x min(p_0(x), q_0(x)).
        accept_rate = np.minimum(
            _nucleus_probs(target_VxV, params)[ANCHOR], _nucleus_probs(draft_VxV, params)[ANCHOR]
        ).sum()
        bound = 5 * np.sqrt(accept_rate * (1 - accept_rate) / B_JOINT) + 1e-6
        assert abs((num >= 1).mean() - accept_rate) < bound


@pytest.mark.parametrize(
    "rule", [biased_at_position_3, residual_biased_from_position_3], ids=lambda f: f.__name__
)
@pytest.mark.parametrize("capped", [False, True], ids=["all_verified", "capped"])
def test_the_sampling_tests_reject_a_rule_biased_from_position_3(capped, rule):
    """Power check of the tests above: the same statistics on the same draws flag a rule that accepts a
    rejected fourth draft half of the time (the joint test), and one that draws the token after a
    rejection at draft position 3 or later from `p_i` instead of the residual (the per-position tests: with
    per-row caps, few rows reach a rejection at position 3, and only the residual's own test sees it)."""
    target_VxV, draft_VxV = _markov_pair()
    p_value, positions, _ = _joint_pvalue(target_VxV, draft_VxV, SamplingParams(1.0), rule, capped)
    print(f"{rule.__name__} capped={capped}: joint p={p_value:.2e}, per position {positions}")
    assert min(p_value, *positions) < 1e-6, (p_value, positions)


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
    assert chi_square_p(np.asarray(nxt), p) > P_MIN


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
