"""The grain input pipeline: order, sharding, padding, anchors, resume exactness, global arrays."""

import grain.checkpoint
import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest

from dspark_jax.data import anchors as anchors_lib
from dspark_jax.data import batch as batch_lib
from dspark_jax.data import pipeline as P

A_AUX, H = 2, 4


def _record(i: int, length: int, prompt: int = 2) -> dict[str, np.ndarray]:
    """Record `i`: ids `1000 * i + t`, response from `prompt` on, hidden states encode (i, t)."""
    t = np.arange(length)
    rec = {
        "input_ids": (1000 * i + t).astype(np.int32),
        "loss_mask": (t >= prompt).astype(np.uint8),
        "aux_hidden": np.broadcast_to((i + t / 64)[:, None, None], (length, A_AUX, H)).astype(
            ml_dtypes.bfloat16
        ),
        "last_hidden": np.broadcast_to((-i - t / 64)[:, None], (length, H)).astype(ml_dtypes.bfloat16),
    }
    return rec


def _source(n: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [_record(i, int(rng.integers(3, 24))) for i in range(n)]


def _config(**overrides) -> P.PipelineConfig:
    base = dict(max_length=16, num_anchors=5, batch_size=4, seed=3, pad_id=-7, num_epochs=None)
    return P.PipelineConfig(**{**base, **overrides})


def _take(it, n: int) -> list[dict[str, np.ndarray]]:
    return [next(it) for _ in range(n)]


def _record_ids(batch) -> list[int]:
    return [int(x) // 1000 for x in batch["input_ids"][:, 0]]


def _assert_batches_equal(xs, ys):
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys):
        assert x.keys() == y.keys()
        for k in x:
            assert x[k].dtype == y[k].dtype
            np.testing.assert_array_equal(x[k].view(np.uint8), y[k].view(np.uint8), err_msg=k)


def test_batch_layout_padding_and_truncation_count():
    source = [_record(0, 20), _record(1, 5), _record(2, 16), _record(3, 9)]
    config = _config(batch_size=4, num_epochs=1)
    it = P.make_iterator(source, config, process_index=0, process_count=1)
    (batch,) = list(it)
    assert sorted(batch) == sorted(f.name for f in batch_lib.FIELDS)
    shapes = {k: (v.shape, v.dtype) for k, v in batch.items()}
    assert shapes == {
        f.name: (s, f.dtype)
        for f, s in zip(batch_lib.FIELDS, batch_lib.shapes(4, batch_lib.Dims(16, A_AUX, H, 5)).values())
    }
    assert shapes["input_ids"] == ((4, 16), np.int32)
    assert shapes["loss_mask"] == ((4, 16), np.uint8)
    assert shapes["aux_hidden"] == ((4, 16, A_AUX, H), ml_dtypes.bfloat16)
    assert shapes["last_hidden"] == ((4, 16, H), ml_dtypes.bfloat16)
    assert shapes["anchors"] == ((4, 5), np.int32)
    assert shapes["block_keep"] == ((4, 5), np.uint8)
    assert shapes["seq_len"] == ((4,), np.int32)
    assert it.truncated_count == 1 and it.sample_count == 4  # only the 20-token record
    for row, i in enumerate(_record_ids(batch)):
        rec = source[i]
        kept = min(len(rec["input_ids"]), 16)
        assert batch["seq_len"][row] == kept
        np.testing.assert_array_equal(batch["input_ids"][row, :kept], rec["input_ids"][:kept])
        assert np.all(batch["input_ids"][row, kept:] == -7)
        np.testing.assert_array_equal(batch["loss_mask"][row, :kept], rec["loss_mask"][:kept])
        assert np.all(batch["loss_mask"][row, kept:] == 0)
        np.testing.assert_array_equal(batch["aux_hidden"][row, :kept], rec["aux_hidden"][:kept])
        assert np.all(batch["aux_hidden"][row, kept:].astype(np.float32) == 0)
        np.testing.assert_array_equal(batch["last_hidden"][row, :kept], rec["last_hidden"][:kept])
        # Anchors: valid, sorted, within the truncated sequence, padding marked.
        keep = batch["block_keep"][row].astype(bool)
        valid = anchors_lib.valid_anchor_positions(batch["loss_mask"][row])
        expected_count = min(len(valid), 5)
        assert keep.sum() == expected_count and np.all(keep[:expected_count])
        real = batch["anchors"][row][keep]
        assert np.all(np.isin(real, valid)) and np.all(np.diff(real) > 0) and np.all(real + 1 < kept)
        assert np.all(batch["anchors"][row][~keep] == anchors_lib.ANCHOR_PAD)


def test_epochs_are_permutations_with_different_orders():
    source = _source(12)
    it = P.make_iterator(source, _config(num_epochs=3), process_index=0, process_count=1)
    ids = [i for b in it for i in _record_ids(b)]
    epochs = [ids[0:12], ids[12:24], ids[24:36]]
    assert len(ids) == 36
    for e in epochs:
        assert sorted(e) == list(range(12))
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]


def test_finite_epochs_drop_the_tail_that_does_not_fill_a_global_batch():
    source = _source(10)
    config = _config(num_epochs=1, batch_size=4)
    assert len(list(P.make_iterator(source, config, process_index=0, process_count=1))) == 2
    for p in range(2):
        assert len(list(P.make_iterator(source, config, process_index=p, process_count=2))) == 2


def test_two_processes_see_disjoint_samples_covering_the_epoch_and_the_same_global_batches():
    source = _source(16)
    config = _config(num_epochs=1, batch_size=4)
    single = list(P.make_iterator(source, config, process_index=0, process_count=1))
    halves = [list(P.make_iterator(source, config, process_index=p, process_count=2)) for p in range(2)]
    ids = [[i for b in h for i in _record_ids(b)] for h in halves]
    assert not set(ids[0]) & set(ids[1])
    assert sorted(ids[0] + ids[1]) == list(range(16))
    # Global step s is the same records (and anchors) whatever the process count.
    for step, whole in enumerate(single):
        joined = {k: np.concatenate([halves[0][step][k], halves[1][step][k]]) for k in whole}
        _assert_batches_equal([whole], [joined])


def test_anchor_rng_independent_of_process_count_and_reproducible():
    source = _source(8)
    a = list(P.make_iterator(source, _config(num_epochs=2), process_index=0, process_count=1))
    b = list(P.make_iterator(source, _config(num_epochs=2), process_index=0, process_count=1))
    _assert_batches_equal(a, b)
    c = list(P.make_iterator(source, _config(num_epochs=2, seed=4), process_index=0, process_count=1))
    assert any(not np.array_equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, c))


def test_record_without_anchor_gives_all_padding_blocks():
    source = [_record(i, 6, prompt=5) for i in range(4)]  # response of one token: no anchor
    (batch,) = list(P.make_iterator(source, _config(num_epochs=1), process_index=0, process_count=1))
    assert np.all(batch["block_keep"] == 0)
    assert np.all(batch["anchors"] == anchors_lib.ANCHOR_PAD)


def test_errors_are_clear():
    with pytest.raises(ValueError, match="empty"):
        P.make_iterator([], _config(), process_index=0, process_count=1)
    with pytest.raises(ValueError, match="not divisible by the process count 3"):
        P.make_iterator(_source(8), _config(batch_size=4), process_index=0, process_count=3)
    with pytest.raises(ValueError, match="less than one global batch"):
        P.make_iterator(_source(3), _config(batch_size=4, num_epochs=1), process_index=0, process_count=1)
    with pytest.raises(ValueError, match="lacks fields"):
        P.make_iterator([{"input_ids": np.zeros(3, np.int32)}], _config(), process_index=0, process_count=1)
    with pytest.raises(ValueError, match="max_length"):
        _config(max_length=0)
    bad = _source(4)
    bad[2]["last_hidden"] = bad[2]["last_hidden"][:-1]
    with pytest.raises(ValueError, match=r"bad record 2 .*last_hidden"):
        list(P.make_iterator(bad, _config(num_epochs=1), process_index=0, process_count=1))


def _resume_roundtrip(tmp_path, source, config, k: int, n: int):
    """Uninterrupted batches k..n vs batches after an orbax save at k and restore into a fresh pipeline."""
    it = P.make_iterator(source, config, process_index=0, process_count=1)
    _take(it, k)
    truncated_at_k = it.truncated_count
    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
        mngr.save(
            k,
            args=ocp.args.Composite(
                data_iter=grain.checkpoint.CheckpointSave(it), meta=ocp.args.JsonSave({"step": k})
            ),
        )
        mngr.wait_until_finished()
    expected = _take(it, n - k)
    it.close()

    fresh = P.make_iterator(source, config, process_index=0, process_count=1)
    _take(fresh, 1)  # a used iterator must be reset by the restore, not continue
    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
        assert mngr.latest_step() == k
        restored = mngr.restore(
            k, args=ocp.args.Composite(data_iter=grain.checkpoint.CheckpointRestore(fresh))
        )
    assert restored.data_iter is fresh
    assert fresh.truncated_count == truncated_at_k
    _assert_batches_equal(_take(fresh, n - k), expected)
    fresh.close()


def test_resume_exact_after_orbax_checkpoint(tmp_path):
    _resume_roundtrip(tmp_path, _source(20), _config(batch_size=4), k=2, n=4)


@pytest.mark.parametrize("worker_count", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_resume_exact_across_epoch_boundary(tmp_path, worker_count):
    # 10 records, batch 4: the epoch ends inside step 2; save at 2, run to 8 (3+ epochs).
    _resume_roundtrip(tmp_path, _source(10), _config(batch_size=4, worker_count=worker_count), k=2, n=8)


def test_worker_processes_give_identical_batches():
    source = _source(12)
    plain = list(P.make_iterator(source, _config(num_epochs=2), process_index=0, process_count=1))
    it = P.make_iterator(source, _config(num_epochs=2, worker_count=2), process_index=0, process_count=1)
    try:
        with_workers = list(it)
    finally:
        it.close()
    _assert_batches_equal(plain, with_workers)


def test_to_global_on_mesh8(mesh8):
    source = _source(8)
    (batch,) = list(
        P.make_iterator(source, _config(num_epochs=1, batch_size=8), process_index=0, process_count=1)
    )
    arrays = P.to_global(batch, mesh8)
    for name, local in batch.items():
        arr = arrays[name]
        assert arr.shape == local.shape and arr.dtype == local.dtype
        assert arr.sharding.spec[0] == ("data", "fsdp")
        assert len(arr.addressable_shards) == 8
        assert arr.addressable_shards[0].data.shape[0] == 2  # 8 rows over data x fsdp = 4
        np.testing.assert_array_equal(np.asarray(jax.device_get(arr)).view(np.uint8), local.view(np.uint8))


def test_packed_resume_exact_across_epochs_and_processes_agree(tmp_path):
    """Packed rows: an orbax save/restore continues exactly across epoch boundaries, every record appears
    once per epoch, and two processes split each global batch of packed rows as one process does."""
    source = _source(12)
    _resume_roundtrip(tmp_path, source, _config(batch_size=2, max_length=32, pack=True), k=2, n=9)
    config = _config(batch_size=2, max_length=32, pack=True, num_epochs=2)
    single = list(P.make_iterator(source, config, process_index=0, process_count=1))
    halves = [list(P.make_iterator(source, config, process_index=p, process_count=2)) for p in range(2)]
    for step, whole in enumerate(single):
        joined = {k: np.concatenate([halves[0][step][k], halves[1][step][k]]) for k in whole}
        _assert_batches_equal([whole], [joined])
    starts = [
        int(x) // 1000
        for b in P.make_iterator(source, _config(batch_size=1, max_length=32, pack=True, num_epochs=1))
        for row, positions in zip(b["input_ids"], b["positions"])
        for x in row[(positions == 0) & (np.arange(32) < b["seq_len"][0])]
    ]
    assert sorted(starts) == list(range(12))  # each record once in the epoch, starting at position 0
