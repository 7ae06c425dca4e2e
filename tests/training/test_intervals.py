"""The report's 95% intervals on synthetic cases whose answer is known in closed form."""

import numpy as np
import pytest

from dspark_jax.training import intervals
from dspark_jax.training.intervals import SampleSums


def test_a_mean_of_bernoulli_units_gets_the_normal_interval():
    """A ratio with unit denominators is a mean: for 2,000 Bernoulli(0.3) units its 95% interval is the
    normal one, p +- 1.96 sqrt(p (1 - p) / n), to 10% of its half-width."""
    rng = np.random.default_rng(0)
    x = (rng.random(2000) < 0.3).astype(float)
    got = intervals.ratio(x, np.ones_like(x))
    p = x.mean()
    half = 1.96 * np.sqrt(p * (1 - p) / len(x))
    assert got.estimate == pytest.approx(p)
    assert got.low == pytest.approx(p - half, abs=0.1 * half)
    assert got.high == pytest.approx(p + half, abs=0.1 * half)


def test_the_interval_covers_the_true_mean_95_percent_of_the_time():
    """300 repetitions of 100 skewed (exponential, mean 1) units: the interval holds 1.0 in 92%-98% of them
    (95% +- 2.4 binomial standard deviations; a 90% or 99% interval falls outside)."""
    covered = 0
    for seed in range(300):
        draw = np.random.default_rng(100 + seed).exponential(1.0, 100)
        interval = intervals.ratio(draw, np.ones_like(draw), seed=seed)
        covered += interval.low <= 1.0 <= interval.high
    assert 0.92 <= covered / 300 <= 0.98


def test_a_ratio_of_sums_interval_matches_the_delta_method():
    """Units of unequal size (blocks per sample): the interval of sum(num) / sum(den) is the delta method's,
    R +- 1.96 sqrt(sum((num - R den)^2)) / sum(den), to 10% of its half-width."""
    rng = np.random.default_rng(1)
    den = rng.integers(1, 20, 3000).astype(float)
    num = den * 1.5 + rng.normal(0, 1, 3000) * np.sqrt(den)
    got = intervals.ratio(num, den)
    r = num.sum() / den.sum()
    half = 1.96 * np.sqrt(np.sum((num - r * den) ** 2)) / den.sum()
    assert got.low == pytest.approx(r - half, abs=0.1 * half)
    assert got.high == pytest.approx(r + half, abs=0.1 * half)


def test_a_paired_difference_removes_the_spread_two_drafts_share():
    """Two drafts on the same samples whose per-sample figures vary widely but differ by a small shift with
    little noise: the paired interval is the shift's, mean(d) +- 1.96 sd(d) / sqrt(n), excludes zero, and is
    far narrower than the unpaired intervals, which overlap."""
    rng = np.random.default_rng(2)
    n = 1000
    shared = rng.normal(1.5, 0.5, n)
    a, b = shared + 0.02 + rng.normal(0, 0.05, n), shared
    ones = np.ones(n)
    got = intervals.paired_difference(a, ones, b, ones)
    d = a - b
    half = 1.96 * d.std(ddof=1) / np.sqrt(n)
    assert got.estimate == pytest.approx(d.mean())
    assert got.low == pytest.approx(d.mean() - half, abs=0.1 * half)
    assert got.high == pytest.approx(d.mean() + half, abs=0.1 * half)
    assert got.excludes_zero
    alone_a, alone_b = intervals.ratio(a, ones), intervals.ratio(b, ones)
    assert alone_a.low < alone_b.high  # unpaired, the two figures are not told apart


def _sums(keys, tau, blocks):
    k = len(keys)
    return SampleSums(
        np.asarray(keys), np.asarray(tau, float), np.asarray(blocks, float), np.ones((k, 2)), np.ones((k, 2))
    )


def test_identical_drafts_gain_exactly_zero_and_other_samples_are_refused():
    keys = [[0, 0, 0], [0, 1, 0], [0, 1, 9]]
    same = _sums(keys, [3.0, 2.0, 5.0], [2, 1, 3])
    gain = intervals.paired_gains(same, same)["tau_prob"]
    assert (gain.estimate, gain.low, gain.high) == (0.0, 0.0, 0.0) and not gain.excludes_zero
    with pytest.raises(ValueError, match="same validation samples"):
        intervals.paired_gains(same, _sums([[0, 0, 0], [0, 1, 0], [0, 1, 8]], [3, 2, 5], [2, 1, 3]))


def test_the_wilson_interval_of_a_bin_matches_its_closed_form_values():
    """0 of 10 gives [0, 0.2775] (not the normal interval's [0, 0]); 50 of 100 gives [0.4038, 0.5962]."""
    low, high = intervals.wilson(np.array([0.0, 0.5, 1.0]), np.array([10, 100, 3]))
    np.testing.assert_allclose(low, [0.0, 0.4038, 0.4385], atol=1e-4)
    np.testing.assert_allclose(high, [0.2775, 0.5962, 1.0], atol=1e-4)


def _seeded_runs():
    """Three training seeds of a draft and of its reference on the same 256 validation samples: per-seed
    offsets shared by both (-0.15 .. +0.2 tau_prob), the draft's paired gains +0.04, -0.03, +0.05, and
    sample noise far smaller than either (as `[S, K]` numerators and denominators)."""
    rng = np.random.default_rng(0)
    base_K, blocks_K = rng.uniform(1.5, 2.5, 256), rng.integers(5, 15, 256).astype(float)
    offsets, gains = [0.0, 0.2, -0.15], [0.04, -0.03, 0.05]
    run = lambda shift: (base_K + shift + rng.normal(0, 0.01, 256)) * blocks_K
    ours = np.stack([run(o + g) for o, g in zip(offsets, gains)])
    theirs = np.stack([run(o) for o in offsets])
    return ours, theirs, np.tile(blocks_K, (3, 1)), gains


def test_an_interval_over_seeds_covers_their_spread_where_one_over_samples_does_not():
    ours, theirs, den, gains = _seeded_runs()
    per_seed = [intervals.ratio(ours[s], den[s]).estimate for s in range(3)]
    samples_only = intervals.ratio(ours.reshape(-1), den.reshape(-1))  # the seeds' samples pooled
    assert not all(samples_only.low <= x <= samples_only.high for x in per_seed)
    both = intervals.seeds_ratio(ours, den)
    assert both.estimate == pytest.approx(np.mean(per_seed))
    assert all(both.low <= x <= both.high for x in per_seed)

    # The paired gain: every run alone, and the samples pooled, tell it apart from noise; with the spread
    # between seeds it is not told apart (the mark the report's tables print follows this interval).
    runs = [intervals.paired_difference(ours[s], den[s], theirs[s], den[s]) for s in range(3)]
    assert all(x.excludes_zero for x in runs)
    pooled = intervals.paired_difference(
        ours.reshape(-1), den.reshape(-1), theirs.reshape(-1), den.reshape(-1)
    )
    assert pooled.excludes_zero
    gain = intervals.seeds_difference(ours, den, theirs, den)
    assert gain.estimate == pytest.approx(np.mean(gains), abs=0.003)
    assert not gain.excludes_zero and all(gain.low <= x.estimate <= gain.high for x in runs)


def test_one_seed_gets_the_interval_over_samples_unchanged():
    ours, theirs, den, _ = _seeded_runs()
    assert intervals.seeds_ratio(ours[:1], den[:1]) == intervals.ratio(ours[0], den[0])
    assert intervals.seeds_difference(ours[0], den[0], theirs[0], den[0]) == intervals.paired_difference(
        ours[0], den[0], theirs[0], den[0]
    )
