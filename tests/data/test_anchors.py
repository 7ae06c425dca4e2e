"""Anchors and per-block arrays against hand-computed expectations (DESIGN.md section 2)."""

import itertools

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


def test_eval_mask_prompt_response_boundary_and_end_of_sequence():
    # T = 12, response = positions 3..11. Anchor 3: labels 4..10 all response -> all 1.
    # Anchor 8: labels 9, 10, 11 in range, 12.. out of range -> 1 1 1 0 0 0 0.
    # Anchor 10 (= T-2): only label 11 -> 1 0 0 0 0 0 0.
    mask = _mask("000111111111")
    anchors = np.array([3, 8, 10], np.int32)
    keep = np.ones(3, np.uint8)
    got = A.eval_mask(mask, anchors, keep)
    expected = [[1] * 7, [1, 1, 1, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0, 0]]
    np.testing.assert_array_equal(got, expected)
    assert got.shape == (3, 7) and got.dtype == np.uint8


def test_eval_mask_stops_at_turn_gap_and_does_not_resume():
    # Turn 1 = 2..5, gap 6..7, turn 2 = 8..12. Anchor 4: labels 5 (1), 6 (0) -> then all 0
    # even though labels 8.. are response again (cumulative product).
    mask = _mask("0011110011111")
    got = A.eval_mask(mask, np.array([4, 2, 8], np.int32), np.ones(3, np.uint8))
    np.testing.assert_array_equal(got, [[1, 0, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0]])


def test_eval_mask_padded_blocks_and_short_sequence():
    mask = _mask("0111")  # T = 4 < block size
    anchors, keep = A.sample_anchors(mask, 4, np.random.default_rng(0))
    np.testing.assert_array_equal(anchors, [1, 2, A.ANCHOR_PAD, A.ANCHOR_PAD])
    np.testing.assert_array_equal(keep, [1, 1, 0, 0])
    got = A.eval_mask(mask, anchors, keep)
    np.testing.assert_array_equal(got, [[1, 1, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0, 0]] + [[0] * 7] * 2)


def test_eval_mask_matches_loop_reference_on_random_masks():
    rng = np.random.default_rng(1)
    for _ in range(50):
        T = int(rng.integers(0, 30))
        mask = (rng.random(T) < 0.7).astype(np.uint8)
        anchors, keep = A.sample_anchors(mask, 5, rng)
        got = A.eval_mask(mask, anchors, keep, block_size=7)
        for n, i in itertools.product(range(5), range(7)):
            ok = keep[n] and all(anchors[n] + 1 + j < T and mask[anchors[n] + 1 + j] for j in range(i + 1))
            assert got[n, i] == int(bool(ok))


def test_block_arrays_hand_computed():
    ids = np.arange(100, 110, dtype=np.int32)  # T = 10, x[t] = 100 + t
    anchors = np.array([0, 5], np.int32)
    np.testing.assert_array_equal(
        A.block_labels(ids, anchors), [[101, 102, 103, 104, 105, 106, 107], [106, 107, 108, 109, 0, 0, 0]]
    )
    np.testing.assert_array_equal(
        A.markov_predecessors(ids, anchors),
        [[100, 101, 102, 103, 104, 105, 106], [105, 106, 107, 108, 109, 0, 0]],
    )
    np.testing.assert_array_equal(A.teacher_positions(anchors), [list(range(0, 7)), list(range(5, 12))])


def test_block_arrays_batched_leading_dims():
    rng = np.random.default_rng(2)
    ids_BT = rng.integers(1, 50, size=(3, 12)).astype(np.int32)
    mask_BT = (rng.random((3, 12)) < 0.8).astype(np.uint8)
    anchors_BN = rng.integers(0, 11, size=(3, 4)).astype(np.int32)
    keep_BN = rng.integers(0, 2, size=(3, 4)).astype(np.uint8)
    for fn, args in [
        (A.block_labels, (ids_BT, anchors_BN)),
        (A.markov_predecessors, (ids_BT, anchors_BN)),
        (A.eval_mask, (mask_BT, anchors_BN, keep_BN)),
    ]:
        batched = fn(*args)
        assert batched.shape == (3, 4, 7)
        for b in range(3):
            np.testing.assert_array_equal(batched[b], fn(*(x[b] for x in args)))


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
