"""Sequential Temperature Scaling (STS) of the confidence head, and the calibration file of a checkpoint.

The confidence head gives, for proposal `i` of a block (`S` proposals, shape letters: the legend in
`dspark_jax/__init__.py`), a logit `z_i` whose sigmoid predicts that proposal `i` is accepted given that
every proposal before it was. The scheduler reads prefix survival probabilities `a_k = prod_{i<=k} c_i`.
STS (DSpark, section 3.2) fits one temperature `T_k` per position, left to right: with
`T_0..T_{k-1}` fixed, `T_k` is the point of a 1-D grid minimising the expected calibration error of
`prod_{i<=k} sigmoid(z_i / T_i)` against the measured cumulative acceptance `prod_{i<=k} y_i` over the
blocks whose position `k` exists. `T > 0` keeps the order of each position's scores.

ECE: `sum_b (n_b / n) |mean(pred in b) - mean(target in b)|` over `bins` equal-width bins of the
prediction on [0, 1] (a prediction of exactly 1 falls in the last bin). Targets may be soft (the
expected acceptance of sampling) or 0/1 (greedy exact match).

A checkpoint's calibration is one JSON file, `<workdir>/calibration/step_<N>/sts.json`, with the
temperatures for greedy and for sampled decoding (`MODES`), fitted by `python -m dspark_jax.calibrate`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence

import numpy as np
from etils import epath

# Acceptance measured under teacher forcing, per decoding mode: 'greedy' = the draft's argmax equals the
# target's (greedy verification); 'sampling' = the overlap sum_v min(p, q) (the acceptance probability of
# speculative sampling at temperature 1, the confidence head's own training target).
MODES = ("greedy", "sampling")
DEFAULT_GRID = tuple(float(t) for t in np.geomspace(1 / 16, 16, 161))  # includes 1.0 (index 80)
DEFAULT_BINS = 15


def ece(pred_N: np.ndarray, target_N: np.ndarray, bins: int = DEFAULT_BINS) -> float:
    """Expected calibration error of predictions in [0, 1] against (soft) targets; 0 for no sample."""
    pred_N, target_N = np.asarray(pred_N, np.float64), np.asarray(target_N, np.float64)
    if pred_N.size == 0:
        return 0.0
    index_N = np.minimum((pred_N * bins).astype(np.int64), bins - 1)
    gap = np.bincount(index_N, pred_N - target_N, minlength=bins)
    return float(np.abs(gap).sum() / pred_N.size)


def reliability(pred_N: np.ndarray, target_N: np.ndarray, bins: int = DEFAULT_BINS) -> dict[str, list]:
    """Per bin: `count`, mean prediction `confidence` and mean target `accuracy` (None for an empty bin)."""
    pred_N, target_N = np.asarray(pred_N, np.float64), np.asarray(target_N, np.float64)
    index_N = np.minimum((pred_N * bins).astype(np.int64), bins - 1)
    count = np.bincount(index_N, minlength=bins)
    mean = lambda x: [float(s / c) if c else None for s, c in zip(np.bincount(index_N, x, bins), count)]
    return {"count": count.tolist(), "confidence": mean(pred_N), "accuracy": mean(target_N)}


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * np.asarray(x, np.float64)))


def survival(logits_NxS: np.ndarray, temperatures_S: Sequence[float]) -> np.ndarray:
    """Prefix survival probabilities `a_k = prod_{i<=k} sigmoid(z_i / T_i)`: f64[N, S]."""
    return np.cumprod(sigmoid(np.asarray(logits_NxS) / np.asarray(temperatures_S, np.float64)), axis=1)


@dataclasses.dataclass(frozen=True)
class StsFit:
    """Fitted temperatures `[S]` and ECE per position before (`T = 1`) and after, on the fitting blocks."""

    temperatures: tuple[float, ...]
    ece_before: tuple[float, ...]
    ece_after: tuple[float, ...]
    blocks: tuple[int, ...]  # blocks whose position k exists


def _check(logits_NxS, accept_NxS, mask_NxS):
    logits_NxS, accept_NxS = np.asarray(logits_NxS, np.float64), np.asarray(accept_NxS, np.float64)
    mask_NxS = np.asarray(mask_NxS).astype(bool)
    if logits_NxS.ndim != 2 or logits_NxS.shape != accept_NxS.shape or logits_NxS.shape != mask_NxS.shape:
        raise ValueError(
            f"STS needs logits, acceptance and mask of one shape [N, S]; got {logits_NxS.shape}, "
            f"{accept_NxS.shape}, {mask_NxS.shape}"
        )
    return logits_NxS, accept_NxS, mask_NxS


def position_ece(
    logits_NxS, accept_NxS, mask_NxS, temperatures_S: Sequence[float], bins: int = DEFAULT_BINS
) -> list[float]:
    """ECE of the cumulative prediction against the cumulative acceptance, per position."""
    logits_NxS, accept_NxS, mask_NxS = _check(logits_NxS, accept_NxS, mask_NxS)
    pred_NxS = survival(logits_NxS, temperatures_S)
    measured_NxS = np.cumprod(accept_NxS, axis=1)
    return [ece(pred_NxS[m, k], measured_NxS[m, k], bins) for k, m in enumerate(mask_NxS.T)]


def fit_sts(
    logits_NxS: np.ndarray,
    accept_NxS: np.ndarray,
    mask_NxS: np.ndarray,
    grid: Sequence[float] = DEFAULT_GRID,
    bins: int = DEFAULT_BINS,
) -> StsFit:
    """Sequential temperature scaling: `T_k = argmin_{T in grid} ECE_k(T_0..T_{k-1}, T)`, left to right.

    `logits_NxS` are confidence logits of `N` teacher-forced blocks, `accept_NxS` the measured acceptance of
    each proposal given the true prefix, `mask_NxS` the positions that exist (a prefix of each block). Ties
    go to the first grid point. A position with no block keeps `T = 1`.
    """
    logits_NxS, accept_NxS, mask_NxS = _check(logits_NxS, accept_NxS, mask_NxS)
    grid_G = np.asarray(grid, np.float64)
    if grid_G.ndim != 1 or grid_G.size == 0 or np.any(grid_G <= 0):
        raise ValueError("the STS temperature grid must be a non-empty list of positive temperatures")
    measured_NxS = np.cumprod(accept_NxS, axis=1)
    prefix_N = np.ones(logits_NxS.shape[0])  # prod of the calibrated c_i of positions before k
    temperatures = []
    for k in range(logits_NxS.shape[1]):
        rows = mask_NxS[:, k]
        if not rows.any():
            temperatures.append(1.0)
            continue
        candidates_GxN = prefix_N[rows] * sigmoid(logits_NxS[rows, k][None] / grid_G[:, None])
        errors_G = [ece(c, measured_NxS[rows, k], bins) for c in candidates_GxN]
        temperatures.append(float(grid_G[int(np.argmin(errors_G))]))
        prefix_N = prefix_N * sigmoid(logits_NxS[:, k] / temperatures[-1])
    return StsFit(
        tuple(temperatures),
        tuple(position_ece(logits_NxS, accept_NxS, mask_NxS, [1.0] * len(temperatures), bins)),
        tuple(position_ece(logits_NxS, accept_NxS, mask_NxS, temperatures, bins)),
        tuple(int(n) for n in mask_NxS.sum(0)),
    )


def calibration_path(workdir: str | os.PathLike, step: int) -> epath.Path:
    """Where the calibration of checkpoint `step` of a work directory lives."""
    return epath.Path(workdir) / "calibration" / f"step_{step}" / "sts.json"


def save(path: str | os.PathLike, record: Mapping) -> None:
    """Writes a calibration record (`temperatures` per mode plus anything reported) as JSON, atomically."""
    path = epath.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / (path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    tmp.rename(path)


def load_temperatures(path: str | os.PathLike, mode: str, num_positions: int) -> tuple[float, ...]:
    """The STS temperatures of `mode` from a calibration file, checked against the draft's block size."""
    path = epath.Path(path)
    if mode not in MODES:
        raise ValueError(f"calibration mode must be one of {MODES}, got {mode!r}")
    if not path.exists():
        raise FileNotFoundError(path)
    temperatures = json.loads(path.read_text())["temperatures"][mode]
    if len(temperatures) != num_positions or min(temperatures) <= 0:
        raise ValueError(
            f"{path}: {mode} temperatures {temperatures} are not {num_positions} positive values; refit with "
            "python -m dspark_jax.calibrate"
        )
    return tuple(float(t) for t in temperatures)


def mode_of(temperature: float) -> str:
    """The calibration mode that matches a decoding temperature (0 = greedy)."""
    return "greedy" if temperature == 0 else "sampling"
