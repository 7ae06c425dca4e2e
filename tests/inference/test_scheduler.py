"""The prefix scheduler equals a plain-loop numpy Algorithm 1; buckets and the throughput table."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.inference import scheduler

S = 7


def _algorithm1(a_BxS, active_B, sps_N):
    """DSpark Algorithm 1, one candidate at a time: highest survival first, stop at the first drop."""
    rows = [r for r in range(len(active_B)) if active_B[r]]
    candidates = sorted((-a_BxS[r, j], r, j) for r in rows for j in range(S))
    tau, tokens = float(len(rows)), len(rows)
    lengths = [0] * len(active_B)
    best = tau * sps_N[tokens]
    for neg_a, r, j in candidates:
        new = (tau - neg_a) * sps_N[tokens + 1]
        if not new > best:
            break
        assert j == lengths[r]  # a row's admitted proposals are a prefix
        tau, tokens, best = tau - neg_a, tokens + 1, new
        lengths[r] += 1
    return lengths


def _survival(rng, b):
    return np.cumprod(rng.uniform(0.2, 1.0, (b, S)), axis=1).astype(np.float32)


def _schedule(a_BxS, active_B, sps_N):
    fn = jax.jit(scheduler.schedule_lengths)
    return np.asarray(fn(jnp.asarray(a_BxS), jnp.asarray(active_B), jnp.asarray(sps_N, jnp.float32))).tolist()


def test_flat_throughput_admits_everything_and_steep_admits_nothing():
    a = _survival(np.random.default_rng(0), 3)
    active = np.ones(3, bool)
    n = np.arange(3 * (S + 1) + 1)
    assert _schedule(a, active, np.ones_like(n, float)) == [S] * 3  # memory-bound: verifying is free
    assert _schedule(a, active, 1.0 / np.maximum(n, 1) ** 2) == [0] * 3  # cost grows faster than tokens


def test_early_stop_at_the_first_drop():
    """A dip in SPS at 3 tokens stops admission there, although SPS recovers at 4 tokens (where a
    retrospective search would look) and later candidates would pay off."""
    a = np.array([[0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3]], np.float32)
    sps = np.ones(S + 2)
    sps[3] = 0.5  # tau*SPS: 1 (n=1), 1.9 (n=2), 2.7 * 0.5 = 1.35 (n=3): a drop
    assert _schedule(a, [True], sps) == [1] == _algorithm1(a, [True], sps)
    sps[3] = 1.0
    assert _schedule(a, [True], sps) == [S]


def test_ties_and_inactive_rows():
    a = np.full((3, S), 0.5, np.float32)  # every candidate ties: row-major order keeps prefixes
    a[1] = 0.9  # inactive row: its high survival must not be admitted or cost anything
    active = np.array([True, False, True])
    n = np.arange(3 * (S + 1) + 1)
    sps = 1.0 / (n + 4.0)
    got = _schedule(a, active, sps)
    assert got == _algorithm1(a, active, sps) and got[1] == 0
    assert _schedule(a, np.zeros(3, bool), sps) == [0, 0, 0]


@pytest.mark.parametrize("b", [1, 4, 32])
def test_random_cases_equal_the_reference(b):
    rng = np.random.default_rng(b)
    n = np.arange(b * (S + 1) + 1)
    for trial in range(40):
        a = _survival(rng, b)
        active = rng.random(b) < 0.8
        # A realistic shape: flat while memory-bound, then falling; noisy, so drops come early or late.
        knee = rng.uniform(1, 2 * b + 2)
        sps = 1.0 / np.maximum(1.0, n / knee) * rng.uniform(0.9, 1.1, n.shape)
        assert _schedule(a, active, sps) == _algorithm1(a, active, sps), trial


def test_buckets():
    assert scheduler.check_buckets([1, 2, 4, 8], S) == (1, 2, 4, 8)
    for bad in ([2, 4, 8], [1, 2, 4], [1, 4, 2, 8], []):
        with pytest.raises(ValueError, match=r"increase from 1 to the proposals per cycle \+ 1 = 8"):
            scheduler.check_buckets(bad, S)
    # A shorter block (`draft_len`): the defaults below its width, then the width itself.
    assert scheduler.default_buckets(7) == scheduler.DEFAULT_BUCKETS == (1, 2, 4, 8)
    assert scheduler.default_buckets(3) == (1, 2, 4)
    assert scheduler.default_buckets(2) == (1, 2, 3)
    assert scheduler.default_buckets(1) == (1, 2)
    assert scheduler.check_buckets(scheduler.default_buckets(3), 3) == (1, 2, 4)
    index = lambda lengths, active: int(
        scheduler.bucket_index(jnp.asarray(lengths), jnp.asarray(active), (1, 2, 4, 8))
    )
    assert index([0, 0], [True, True]) == 0
    assert index([1, 0], [True, True]) == 1
    assert index([2, 3], [True, True]) == 2
    assert index([7, 0], [False, True]) == 0  # an inactive row's length does not widen the batch
    assert index([4, 0], [True, True]) == 3


def test_sps_table_is_linear_between_measured_points_and_flat_beyond():
    table = scheduler.SpsTable(rows=2, max_len=64, tokens=(2, 4, 8, 16), sps=(100.0, 80.0, 40.0, 20.0))
    dense = table.dense(20)
    assert dense.shape == (21,) and dense.dtype == np.float32
    np.testing.assert_allclose(dense[[0, 2, 3, 4, 6, 16, 20]], [100, 100, 90, 80, 60, 20, 20])
    assert table.as_dict()["sps"] == [100.0, 80.0, 40.0, 20.0]
