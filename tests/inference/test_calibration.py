"""STS: fitted temperatures and ECE equal a plain-loop numpy grid search on a known miscalibration."""

import json

import numpy as np
import pytest

from dspark_jax.inference import calibration

S = 7
TRUE_T = np.array([0.5, 2.0, 1.0, 3.0, 0.7, 1.5, 0.4])  # the head's logits are z = T_true * true logit
GRID = np.geomspace(0.25, 4.0, 33)


def _crafted(n=3000, seed=0):
    """Blocks whose true acceptance is sigmoid(z / T_true): raw scores are over- or under-confident."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(2.0, 1.5, size=(n, S)) * TRUE_T  # survival stays well above 0
    accept = (rng.random((n, S)) < 1 / (1 + np.exp(-logits / TRUE_T))).astype(np.float64)
    lengths = rng.integers(1, S + 1, n)  # positions that exist: a prefix of each block
    mask = np.arange(S)[None] < lengths[:, None]
    return logits, accept, mask


def _reference_ece(pred, target, bins):
    """ECE by explicit bins: [b/bins, (b+1)/bins), the last one closed."""
    total = 0.0
    for b in range(bins):
        lo, hi = b / bins, (b + 1) / bins
        members = [i for i, p in enumerate(pred) if lo <= p < hi or (b == bins - 1 and p == 1.0)]
        if members:
            gap = sum(pred[i] for i in members) / len(members) - sum(target[i] for i in members) / len(
                members
            )
            total += len(members) / len(pred) * abs(gap)
    return total


def _reference_sts(logits, accept, mask, grid, bins):
    """Position by position: try every grid temperature with the earlier ones fixed, keep the first best."""
    temperatures = []
    for k in range(logits.shape[1]):
        rows = [n for n in range(logits.shape[0]) if mask[n, k]]
        best, best_t = None, 1.0
        for t in grid:
            pred, target = [], []
            for n in rows:
                p, y = 1.0, 1.0
                for i in range(k + 1):
                    ti = t if i == k else temperatures[i]
                    p *= 1 / (1 + np.exp(-logits[n, i] / ti))
                    y *= accept[n, i]
                pred.append(p)
                target.append(y)
            error = _reference_ece(pred, target, bins)
            if best is None or error < best - 1e-12:
                best, best_t = error, t
        temperatures.append(float(best_t))
    return temperatures


def test_sts_equals_a_numpy_grid_search_and_recovers_the_miscalibration():
    logits, accept, mask = _crafted(n=600)
    fit = calibration.fit_sts(logits, accept, mask, grid=GRID, bins=10)
    assert list(fit.temperatures) == _reference_sts(logits, accept, mask, GRID, 10)
    pred = calibration.survival(logits, fit.temperatures)
    measured = np.cumprod(accept, axis=1)
    for k in range(S):
        rows = mask[:, k]
        assert fit.ece_after[k] == pytest.approx(
            _reference_ece(pred[rows, k], measured[rows, k], 10), abs=1e-12
        )
        raw = calibration.survival(logits, np.ones(S))
        assert fit.ece_before[k] == pytest.approx(
            _reference_ece(raw[rows, k], measured[rows, k], 10), abs=1e-12
        )
        assert fit.ece_after[k] <= fit.ece_before[k]
    assert fit.blocks == tuple(int(x) for x in mask.sum(0))


def test_sts_finds_the_true_temperatures_and_keeps_the_order_of_scores():
    logits, accept, mask = _crafted(n=20_000, seed=1)
    fit = calibration.fit_sts(logits, accept, mask)
    ratio = np.asarray(fit.temperatures) / TRUE_T
    assert np.all((ratio > 0.7) & (ratio < 1.4)), fit.temperatures
    strongly_off = [k for k in range(S) if abs(np.log(TRUE_T[k])) > 0.6]
    for k in strongly_off:
        assert fit.ece_after[k] < 0.7 * fit.ece_before[k], (k, fit.ece_before[k], fit.ece_after[k])
    scaled = calibration.sigmoid(logits / np.asarray(fit.temperatures))
    for k in range(S):  # temperature scaling is monotone: each position's ranking is unchanged
        np.testing.assert_array_equal(
            np.argsort(scaled[:, k], kind="stable"), np.argsort(logits[:, k], kind="stable")
        )


def test_ece_edges_and_reliability():
    assert calibration.ece([], []) == 0.0
    assert calibration.ece([1.0, 0.0], [1.0, 0.0]) == 0.0  # 1.0 falls in the last bin
    assert calibration.ece([0.75] * 4, [1, 1, 0, 1]) == 0.0
    table = calibration.reliability([0.05, 0.95, 0.96], [0, 1, 0], bins=10)
    assert table["count"][0] == 1 and table["count"][9] == 2 and table["count"][5] == 0
    assert table["accuracy"][9] == 0.5 and table["confidence"][5] is None


def test_calibration_file_roundtrip_and_errors(tmp_path):
    path = calibration.calibration_path(tmp_path, 300)
    assert path == tmp_path / "calibration" / "step_300" / "sts.json"
    calibration.save(path, {"temperatures": {"greedy": [1.0] * S, "sampling": [0.5] * S}, "step": 300})
    assert calibration.load_temperatures(path, "sampling", S) == (0.5,) * S
    assert json.loads(path.read_text())["step"] == 300
    with pytest.raises(ValueError, match="are not 6 positive values"):
        calibration.load_temperatures(path, "greedy", 6)
    with pytest.raises(ValueError, match="mode must be one of"):
        calibration.load_temperatures(path, "beam", S)
    with pytest.raises(FileNotFoundError):
        calibration.load_temperatures(tmp_path / "missing.json", "greedy", S)
    with pytest.raises(ValueError, match="one shape"):
        calibration.fit_sts(np.zeros((3, S)), np.zeros((3, S - 1)), np.ones((3, S)))
    with pytest.raises(ValueError, match="positive temperatures"):
        calibration.fit_sts(np.zeros((3, S)), np.zeros((3, S)), np.ones((3, S)), grid=[0.0, 1.0])
    assert calibration.mode_of(0.0) == "greedy" and calibration.mode_of(0.7) == "sampling"
