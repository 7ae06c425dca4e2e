"""Block index math on device vs hand-computed expectations and a loop reference (docs/design.md, 1)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.data import anchors as A
from dspark_jax.draft import blocks


def _mask(s: str) -> np.ndarray:
    return np.array([int(c) for c in s], dtype=np.uint8)


def _targets(ids, mask, anchors, keep, block_size=7) -> blocks.BlockTargets:
    """One sample's targets through the batched function (leading batch dim of 1)."""
    out = jax.jit(blocks.block_targets, static_argnums=4)(
        jnp.asarray(ids)[None],
        jnp.asarray(mask)[None],
        jnp.asarray(anchors)[None],
        jnp.asarray(keep)[None],
        block_size,
    )
    return blocks.BlockTargets(*(np.asarray(x[0]) for x in out))


def _eval_mask(mask, anchors, keep, block_size=7):
    ids = np.zeros(len(mask), np.int32)
    return _targets(ids, mask, anchors, keep, block_size).eval_mask


def test_eval_mask_prompt_response_boundary_and_end_of_sequence():
    # T = 12, response = positions 3..11. Anchor 3: labels 4..10 all response -> all 1.
    # Anchor 8: labels 9, 10, 11 in range, 12.. out of range -> 1 1 1 0 0 0 0.
    # Anchor 10 (= T-2): only label 11 -> 1 0 0 0 0 0 0.
    got = _eval_mask(_mask("000111111111"), np.array([3, 8, 10], np.int32), np.ones(3, np.uint8))
    expected = [[1] * 7, [1, 1, 1, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0, 0]]
    np.testing.assert_array_equal(got, expected)
    assert got.shape == (3, 7) and got.dtype == np.uint8


def test_eval_mask_stops_at_turn_gap_and_does_not_resume():
    # Turn 1 = 2..5, gap 6..7, turn 2 = 8..12. Anchor 4: labels 5 (1), 6 (0) -> then all 0
    # even though labels 8.. are response again (cumulative product).
    got = _eval_mask(_mask("0011110011111"), np.array([4, 2, 8], np.int32), np.ones(3, np.uint8))
    np.testing.assert_array_equal(got, [[1, 0, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0]])


def test_eval_mask_padded_blocks_and_short_sequence():
    mask = _mask("0111")  # T = 4 < block size
    anchors, keep = A.sample_anchors(mask, 4, np.random.default_rng(0))
    np.testing.assert_array_equal(anchors, [1, 2, A.ANCHOR_PAD, A.ANCHOR_PAD])
    np.testing.assert_array_equal(keep, [1, 1, 0, 0])
    got = _eval_mask(mask, anchors, keep)
    np.testing.assert_array_equal(got, [[1, 1, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0, 0]] + [[0] * 7] * 2)


def test_block_targets_match_loop_reference_on_random_masks():
    rng = np.random.default_rng(1)
    for _ in range(30):
        T = int(rng.integers(2, 30))
        ids = rng.integers(1, 99, T).astype(np.int32)
        mask = (rng.random(T) < 0.7).astype(np.uint8)
        anchors, keep = A.sample_anchors(mask, 5, rng)
        got = _targets(ids, mask, anchors, keep)
        for n, i in itertools.product(range(5), range(7)):
            a = anchors[n]
            ok = keep[n] and all(a + 1 + j < T and mask[a + 1 + j] for j in range(i + 1))
            assert got.eval_mask[n, i] == int(bool(ok))
            assert got.labels[n, i] == (ids[a + 1 + i] if a + 1 + i < T else 0)
            assert got.predecessors[n, i] == (ids[a + i] if a + i < T else 0)


def test_block_arrays_hand_computed():
    ids = np.arange(100, 110, dtype=np.int32)  # T = 10, x[t] = 100 + t
    anchors = np.array([0, 5], np.int32)
    got = _targets(ids, np.ones(10, np.uint8), anchors, np.ones(2, np.uint8))
    np.testing.assert_array_equal(
        got.labels, [[101, 102, 103, 104, 105, 106, 107], [106, 107, 108, 109, 0, 0, 0]]
    )
    np.testing.assert_array_equal(
        got.predecessors, [[100, 101, 102, 103, 104, 105, 106], [105, 106, 107, 108, 109, 0, 0]]
    )
    np.testing.assert_array_equal(
        blocks.teacher_positions(jnp.asarray(anchors), 7), [list(range(0, 7)), list(range(5, 12))]
    )


def test_batched_rows_are_independent():
    rng = np.random.default_rng(2)
    ids_BxT = rng.integers(1, 50, size=(3, 12)).astype(np.int32)
    mask_BxT = (rng.random((3, 12)) < 0.8).astype(np.uint8)
    anchors_BxN = rng.integers(0, 11, size=(3, 4)).astype(np.int32)
    keep_BxN = rng.integers(0, 2, size=(3, 4)).astype(np.uint8)
    batched = blocks.block_targets(ids_BxT, mask_BxT, anchors_BxN, keep_BxN, 7)
    for b in range(3):
        single = _targets(ids_BxT[b], mask_BxT[b], anchors_BxN[b], keep_BxN[b])
        for got, want in zip(batched, single):
            assert got.shape == (3, 4, 7)
            np.testing.assert_array_equal(got[b], want)


def test_teacher_hidden_gathers_s_at_a_plus_i():
    rng = np.random.default_rng(3)
    last_BxTxH = rng.normal(size=(2, 9, 4)).astype(np.float32)
    anchors_BxN = np.array([[0, 4], [3, 7]], np.int32)
    got = np.asarray(blocks.teacher_hidden(jnp.asarray(last_BxTxH), jnp.asarray(anchors_BxN), 7))
    for b, n, i in itertools.product(range(2), range(2), range(7)):
        np.testing.assert_array_equal(got[b, n, i], last_BxTxH[b, min(anchors_BxN[b, n] + i, 8)])
