"""Packed rows: the plan, the row layout, and that packing changes no block's computation.

Two properties of the draft on a packed row, with the real pipeline (`prepare_row`) and the real
draft: no block sees another sample (perturbing one sample leaves every block of the other bitwise
unchanged, with both attention implementations), and the objective's sums of a packed row equal the
sums of its samples computed apart, each in its own row.
"""

import dataclasses
import pickle
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.data import pipeline
from dspark_jax.draft import blocks
from dspark_jax.draft.model import DraftConfig, DSparkDraft, FrozenTarget
from dspark_jax.groups.baseline import draft_sums
from tests.draft import test_reference

H, V, A, T, N = 32, 50, 3, 64, 12
CFG = dataclasses.replace(test_reference.CFG, vocab_size=V, anchor_chunk=4)


def _record(rng, length, prompt):
    loss_mask = np.zeros(length, np.uint8)
    loss_mask[prompt:] = 1
    return {
        "input_ids": rng.integers(0, V, length).astype(np.int32),
        "loss_mask": loss_mask,
        "aux_hidden": rng.normal(size=(length, A, H)).astype(np.float32),
        "last_hidden": rng.normal(size=(length, H)).astype(np.float32),
    }


def _config(**kw):
    return pipeline.PipelineConfig(max_length=T, num_anchors=N, batch_size=2, seed=0, pad_id=0, **kw)


def test_pack_plan_covers_every_record_once_per_epoch_within_max_length():
    lengths = np.random.default_rng(0).integers(5, 40, 50)
    lengths[7] = 100  # longer than a row: a row of its own (truncated when laid out)
    plan = pipeline.PackPlan(lengths, 64, seed=3, num_epochs=2)
    by_epoch = {0: [], 1: []}
    for row in range(len(plan)):
        epoch, indices = plan[row]
        by_epoch[epoch] += indices
        assert len(indices) == 1 or sum(lengths[i] for i in indices) <= 64
    assert sorted(by_epoch[0]) == sorted(by_epoch[1]) == list(range(50))
    assert by_epoch[0] != by_epoch[1]  # each epoch its own order
    again = pipeline.PackPlan(lengths, 64, seed=3, num_epochs=None)  # endless, planned lazily
    assert [again[r] for r in range(len(plan))] == [plan[r] for r in range(len(plan))]
    with pytest.raises(IndexError):
        plan[len(plan)]


def test_pack_plan_is_thread_safe_and_picklable():
    """grain's prefetch threads read rows of a lazily planned plan at once: every row still carries the
    epoch the serial plan gives it (a race planned one epoch twice, mislabelling the later epochs)."""
    lengths = np.random.default_rng(0).integers(5, 40, 20_000)
    serial = pipeline.PackPlan(lengths, 64, seed=3, num_epochs=None)
    rows = range(0, 6 * 20_000 // 3, 997)  # into the sixth epoch or so
    expected = [serial[r] for r in rows]
    for _ in range(3):
        shared = pipeline.PackPlan(lengths, 64, seed=3, num_epochs=None)
        with ThreadPoolExecutor(16) as pool:
            assert list(pool.map(shared.__getitem__, rows)) == expected
    copy = pickle.loads(pickle.dumps(shared))
    assert [copy[r] for r in rows] == expected


def test_packed_row_layout_and_anchors_stay_inside_samples():
    rng = np.random.default_rng(1)
    records = [_record(rng, 20, 6), _record(rng, 30, 10), _record(rng, 9, 3)]
    row = pipeline.prepare_row(records, _config(), np.random.default_rng(0))
    np.testing.assert_array_equal(row["positions"][:59], np.r_[np.arange(20), np.arange(30), np.arange(9)])
    np.testing.assert_array_equal(row["input_ids"][20:50], records[1]["input_ids"])
    assert row["seq_len"] == 59 and row["num_samples"] == 3 and not row["_truncated"]
    sample_of = np.repeat([0, 1, 2], [20, 30, 9])
    for a in row["anchors"][row["block_keep"] == 1]:
        assert sample_of[a] == sample_of[a + 1]  # an anchor's first label is in its own sample


def _model_and_frozen():
    model = DSparkDraft(CFG, rngs=nnx.Rngs(0))
    keys = jax.random.split(jax.random.key(1))
    frozen = FrozenTarget(jax.random.normal(keys[0], (V, H)), 0.3 * jax.random.normal(keys[1], (H, V)))
    return model, frozen


def _device(batch):
    return {k: jnp.asarray(np.asarray(v)[None]) for k, v in batch.items() if not k.startswith("_")}


@pytest.mark.parametrize("attention", ["xla", "reference"])
def test_no_block_sees_another_samples_context(attention):
    cfg = DraftConfig(**{**CFG.__dict__, "attention": attention})
    model, frozen = DSparkDraft(cfg, rngs=nnx.Rngs(0)), _model_and_frozen()[1]
    rng = np.random.default_rng(2)
    first, second = _record(rng, 24, 4), _record(rng, 30, 5)
    row = _device(pipeline.prepare_row([first, second], _config(), np.random.default_rng(0)))
    other = _record(np.random.default_rng(9), 24, 4)  # the first sample, every value changed
    changed = _device(pipeline.prepare_row([other, second], _config(), np.random.default_rng(0)))

    def hidden(batch):
        anchors = batch["anchors"]
        targets = blocks.block_targets(
            batch["input_ids"], batch["loss_mask"], anchors, batch["block_keep"], 7, batch["positions"]
        )
        ctx = model.context_kv(model.context(batch["aux_hidden"]), batch["positions"])
        x = model.block_inputs(frozen, targets.predecessors[..., 0])
        starts = blocks.sample_starts(batch["positions"], anchors)
        return model.backbone(x, ctx, anchors, starts_BxN=starts)[0], targets

    h, targets = hidden(row)
    h_changed, targets_changed = hidden(changed)
    anchors = np.asarray(row["anchors"][0])
    in_second = (anchors >= 24) & (np.asarray(row["block_keep"][0]) == 1)
    assert in_second.sum() >= 3 and (~in_second & (np.asarray(row["block_keep"][0]) == 1)).sum() >= 3
    np.testing.assert_array_equal(np.asarray(h)[in_second], np.asarray(h_changed)[in_second])
    for got, want in zip(targets_changed, targets):
        np.testing.assert_array_equal(np.asarray(got)[0][in_second], np.asarray(want)[0][in_second])
    assert not np.allclose(np.asarray(h)[~in_second], np.asarray(h_changed)[~in_second])


def test_packed_sums_equal_the_sum_over_samples_computed_apart():
    model, frozen = _model_and_frozen()
    rng = np.random.default_rng(3)
    first, second = _record(rng, 26, 5), _record(rng, 33, 8)
    packed = pipeline.prepare_row([first, second], _config(), np.random.default_rng(0))
    keep = packed["block_keep"] == 1
    anchors = packed["anchors"][keep]
    apart = []
    for record, offset, mine in ((first, 0, anchors < 26), (second, 26, anchors >= 26)):
        row = pipeline.prepare_row([record], _config(), np.random.default_rng(0))
        count = int(mine.sum())
        assert count >= 3
        row["anchors"] = np.zeros(N, np.int32)
        row["anchors"][:count] = anchors[mine] - offset  # the packed row's blocks of this sample
        row["block_keep"] = (np.arange(N) < count).astype(np.uint8)
        apart.append(draft_sums(model, frozen, _device(row)))
    got = draft_sums(model, frozen, _device(packed))
    assert float(got["blocks"]) == keep.sum()
    for name, value in got.items():
        np.testing.assert_allclose(
            np.asarray(value), np.asarray(apart[0][name] + apart[1][name]), rtol=2e-5, atol=1e-5, err_msg=name
        )
