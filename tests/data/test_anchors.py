"""Anchor sampling against hand-computed expectations (docs/design.md section 1)."""

import numpy as np
import pytest

from dspark_jax.data import anchors as A


def _mask(s: str) -> np.ndarray:
    return np.array([int(c) for c in s], dtype=np.uint8)


@pytest.mark.parametrize(
    ("mask", "expected"),
    [
        ("0001111", [3, 4, 5]),  # prompt then response: last response token is no anchor
        ("0001000", []),  # response of length 1
        ("0001100", [3]),  # response of length 2
        ("0011100111", [2, 3, 7, 8]),  # two turns with a gap
        ("11", [0]),  # anchor at T-2 = 0
        ("1", []),
        ("", []),
        ("0000", []),
    ],
)
def test_valid_anchor_positions(mask, expected):
    got = A.valid_anchor_positions(_mask(mask))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, expected)


def test_sample_anchors_takes_all_when_fewer_than_requested():
    mask = _mask("0011100111")
    anchors, keep = A.sample_anchors(mask, 10, np.random.default_rng(3))
    np.testing.assert_array_equal(anchors[:4], [2, 3, 7, 8])
    np.testing.assert_array_equal(keep, [1] * 4 + [0] * 6)
    assert anchors.dtype == np.int32 and anchors.shape == (10,)


def test_sample_anchors_no_valid_anchor_is_all_padding():
    anchors, keep = A.sample_anchors(_mask("0101010"), 3, np.random.default_rng(0))
    np.testing.assert_array_equal(anchors, [A.ANCHOR_PAD] * 3)
    np.testing.assert_array_equal(keep, [0, 0, 0])


def test_sample_anchors_uniform_sorted_unique():
    # 20 valid anchors (positions 0..19 of a 21-token response), draw 5: each is included
    # with probability 1/4. Also check pairs: P(both) = C(18,3)/C(20,5) = 5*4/(20*19).
    mask = np.ones(21, np.uint8)
    rng = np.random.default_rng(4)
    draws = 20000
    counts = np.zeros(20)
    pair_01 = 0
    for _ in range(draws):
        anchors, keep = A.sample_anchors(mask, 5, rng)
        assert keep.all()
        assert np.all(np.diff(anchors) > 0)  # sorted, no duplicates
        assert anchors.min() >= 0 and anchors.max() <= 19
        counts[anchors] += 1
        pair_01 += int(0 in anchors and 1 in anchors)
    p = 5 / 20
    sigma = np.sqrt(p * (1 - p) / draws)
    assert np.all(np.abs(counts / draws - p) < 5 * sigma), counts / draws
    q = 20 / 380
    assert abs(pair_01 / draws - q) < 5 * np.sqrt(q * (1 - q) / draws)


def test_sample_anchors_deterministic_given_rng_seed():
    mask = np.ones(100, np.uint8)
    a1, _ = A.sample_anchors(mask, 10, np.random.default_rng(7))
    a2, _ = A.sample_anchors(mask, 10, np.random.default_rng(7))
    np.testing.assert_array_equal(a1, a2)


def test_sample_anchors_rejects_bad_arguments():
    with pytest.raises(ValueError, match="num_anchors"):
        A.sample_anchors(np.ones(5, np.uint8), 0, np.random.default_rng(0))
    with pytest.raises(ValueError, match="1-D"):
        A.valid_anchor_positions(np.ones((2, 5), np.uint8))
