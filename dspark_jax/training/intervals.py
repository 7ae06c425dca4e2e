"""95% intervals of the figures by resampling their units: validation samples for the offline metrics,
requests for decoding.

Every figure is a ratio of sums over units (tau_prob = summed block tau / blocks, accept_rate_i = summed
overlap / predictions at position i, MAL = accepted tokens / cycles), so an interval resamples the units with
replacement and recomputes the ratio (`scipy.stats.bootstrap`, bias-corrected and accelerated). Two drafts
measured on the same units (the same validation samples, the same prefixes) are compared by their paired
difference: each resample takes the same units for both, which removes the between-sample spread they share.
A row trained with several seeds is one figure, the seeds' mean, whose interval also covers the spread
between seeds (`seeds_ratio`, `seeds_difference`): a single run's interval over samples misses it.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping
from typing import NamedTuple

import numpy as np
from scipy import stats


class SampleSums(NamedTuple):
    """Per validation sample (`K` of them, ordered by key), the sums its tau_prob and accept rates are
    ratios of: tau_prob = `tau.sum() / blocks.sum()`, accept_rate_i = `accept[:, i].sum() /
    accept_count[:, i].sum()` (as `objective.metrics_from_sums` divides them)."""

    keys_Kx3: np.ndarray  # (micro-batch, row, first index in the row): pairs two drafts' samples
    tau_K: np.ndarray
    blocks_K: np.ndarray
    accept_KxS: np.ndarray
    accept_count_KxS: np.ndarray


def sample_sums(records: Mapping[str, np.ndarray], keys_BxNx3: np.ndarray) -> SampleSums:
    """`SampleSums` of block records (`[rows, N, S]`, micro-batches concatenated along rows; the acceptance
    is `figure_overlap`, what the group's own tau_prob counts) and their blocks' sample keys; a sample
    without a valid block keeps zero sums."""
    mask_XxS = records["eval_mask"].reshape(-1, records["eval_mask"].shape[-1]).astype(np.float64)
    accepted_XxS = records["figure_overlap"].reshape(mask_XxS.shape) * mask_XxS
    valid_X = mask_XxS[:, 0] > 0
    tau_X = np.where(valid_X, 1.0 + np.cumprod(accepted_XxS, axis=-1).sum(-1), 0.0)
    keys_Kx3, sample_X = np.unique(keys_BxNx3.reshape(-1, 3), axis=0, return_inverse=True)
    sample_X = sample_X.reshape(-1)
    total = lambda x_X: np.bincount(sample_X, weights=x_X, minlength=len(keys_Kx3))
    per_position = lambda x_XxS: np.stack([total(x_XxS[:, i]) for i in range(x_XxS.shape[1])], axis=1)
    blocks_K = total(valid_X.astype(np.float64))
    return SampleSums(keys_Kx3, total(tau_X), blocks_K, per_position(accepted_XxS), per_position(mask_XxS))


LEVEL = 0.95
RESAMPLES = 9999  # scipy's default: the endpoints' Monte Carlo error is ~1.5% of the half-width


@dataclasses.dataclass(frozen=True)
class Interval:
    """A figure and its interval `[low, high]` at `LEVEL`."""

    estimate: float
    low: float
    high: float

    @property
    def excludes_zero(self) -> bool:
        """For a difference: the interval lies on one side of 0 (told apart from noise at this level)."""
        return self.low > 0 or self.high < 0

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


def _bootstrap(arrays: tuple[np.ndarray, ...], statistic: Callable, seed: int) -> Interval:
    data = tuple(np.asarray(a, np.float64) for a in arrays)
    if len({len(a) for a in data}) != 1 or len(data[0]) < 2:
        raise ValueError(f"an interval needs two or more paired units, got lengths {[len(a) for a in data]}")
    estimate = float(statistic(*data, axis=-1))
    with warnings.catch_warnings():  # constant data: BCa is undefined, the interval is the point
        warnings.simplefilter("ignore")
        result = stats.bootstrap(
            data,
            statistic,
            paired=True,
            vectorized=True,
            n_resamples=RESAMPLES,
            batch=1000,  # resamples held at once (memory: 1000 x units per array)
            confidence_level=LEVEL,
            method="BCa",
            rng=np.random.default_rng(seed),
        )
    low, high = result.confidence_interval
    if not (np.isfinite(low) and np.isfinite(high)):
        low = high = estimate
    return Interval(estimate, float(low), float(high))


def _ratio(num, den, axis=-1):
    with np.errstate(invalid="ignore", divide="ignore"):  # a resample without a unit of weight: nan
        return np.sum(num, axis=axis) / np.sum(den, axis=axis)


def ratio(num_K: np.ndarray, den_K: np.ndarray, *, seed: int = 0) -> Interval:
    """`sum(num) / sum(den)` over `K` units, with its interval."""
    return _bootstrap((num_K, den_K), _ratio, seed)


def paired_difference(num_a_K, den_a_K, num_b_K, den_b_K, *, seed: int = 0) -> Interval:
    """`ratio(a) - ratio(b)` of two figures over the same `K` units, resampled together."""

    def difference(na, da, nb, db, axis=-1):
        return _ratio(na, da, axis) - _ratio(nb, db, axis)

    return _bootstrap((num_a_K, den_a_K, num_b_K, den_b_K), difference, seed)


def _seed_half_width(per_seed_S: np.ndarray) -> float:
    """The t half-width at `LEVEL` of the mean of `S` per-seed estimates (0 for one seed)."""
    s = len(per_seed_S)
    if s < 2:
        return 0.0
    return float(stats.t.ppf(0.5 + LEVEL / 2, s - 1) * np.std(per_seed_S, ddof=1) / np.sqrt(s))


def _over_seeds(arrays_SxK: tuple[np.ndarray, ...], statistic: Callable, seed: int) -> Interval:
    """The mean over `S` training seeds of `statistic` over the same `K` units each, with an interval that
    covers both sources of variation: the units' sampling (the seeds' mean resampled over units, the same
    units for every seed, BCa) and the seed-to-seed spread (the t half-width of the per-seed estimates'
    mean), combined in quadrature on each side. One seed: `_bootstrap`'s interval, unchanged."""
    arrays_SxK = tuple(np.atleast_2d(np.asarray(a, np.float64)) for a in arrays_SxK)
    seeds = len(arrays_SxK[0])
    if any(len(a) != seeds for a in arrays_SxK):
        raise ValueError(f"every array needs the same seeds, got {[len(a) for a in arrays_SxK]}")
    per_seed_S = np.asarray([statistic(*(a[s] for a in arrays_SxK), axis=-1) for s in range(seeds)])
    flat = tuple(a[s] for s in range(seeds) for a in arrays_SxK)  # seed-major, as `mean` unpacks them
    n = len(arrays_SxK)

    def mean(*units, axis=-1):
        return np.mean([statistic(*units[s * n : (s + 1) * n], axis=axis) for s in range(seeds)], axis=0)

    sample = _bootstrap(flat, mean, seed)
    t, est = _seed_half_width(per_seed_S), sample.estimate
    return Interval(
        est, est - float(np.hypot(est - sample.low, t)), est + float(np.hypot(sample.high - est, t))
    )


def seeds_ratio(num_SxK: np.ndarray, den_SxK: np.ndarray, *, seed: int = 0) -> Interval:
    """The mean over training seeds of `sum(num) / sum(den)` over the same `K` units (`[S, K]`; `[K]` for
    one seed), its interval covering the units' sampling and the seed-to-seed spread (`_over_seeds`)."""
    return _over_seeds((num_SxK, den_SxK), _ratio, seed)


def seeds_difference(num_a_SxK, den_a_SxK, num_b_SxK, den_b_SxK, *, seed: int = 0) -> Interval:
    """The mean over training seeds of `ratio(a) - ratio(b)`, seed `s` of `a` paired with seed `s` of `b`
    over the same units; the interval as `seeds_ratio`'s (over the per-seed paired differences)."""

    def difference(na, da, nb, db, axis=-1):
        return _ratio(na, da, axis) - _ratio(nb, db, axis)

    return _over_seeds((num_a_SxK, den_a_SxK, num_b_SxK, den_b_SxK), difference, seed)


def metric_parts(sums: SampleSums) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """`{metric: (numerator per sample, denominator per sample)}` of tau_prob and each accept rate."""
    parts = {"tau_prob": (sums.tau_K, sums.blocks_K)}
    for i in range(sums.accept_KxS.shape[1]):
        parts[f"accept_rate_{i}"] = (sums.accept_KxS[:, i], sums.accept_count_KxS[:, i])
    return parts


def metric_intervals(sums: SampleSums, *, seed: int = 0) -> dict[str, Interval]:
    """Each offline metric of `metric_parts` with its interval over validation samples."""
    return {name: ratio(num, den, seed=seed) for name, (num, den) in metric_parts(sums).items()}


def paired_gains(sums: SampleSums, reference: SampleSums, *, seed: int = 0) -> dict[str, Interval]:
    """Each offline metric of `sums` minus the same metric of `reference`, paired over the validation samples
    both were measured on (refused when they are not the same samples)."""
    if not np.array_equal(sums.keys_Kx3, reference.keys_Kx3):
        raise ValueError(
            f"paired gains need the same validation samples: {len(sums.keys_Kx3)} and "
            f"{len(reference.keys_Kx3)} samples, or other keys (were both measured on one validation cache?)"
        )
    ours, theirs = metric_parts(sums), metric_parts(reference)
    return {name: paired_difference(*ours[name], *theirs[name], seed=seed) for name in ours}


def wilson(mean_N: np.ndarray, count_N: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`(low, high)` of the Wilson score interval at `LEVEL` of proportions `mean` over `count` trials (bins
    of a reliability diagram: exact coverage behaviour for 0/1 outcomes, conservative for means of values
    in [0, 1]); finite at 0 and 1 where the normal interval collapses."""
    z = stats.norm.ppf(0.5 + LEVEL / 2)
    mean, n = np.asarray(mean_N, np.float64), np.asarray(count_N, np.float64)
    centre = (mean + z * z / (2 * n)) / (1 + z * z / n)
    half = z * np.sqrt(mean * (1 - mean) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half
