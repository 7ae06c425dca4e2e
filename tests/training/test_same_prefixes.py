"""Groups measured on the same prefixes (Draft Memory's stage-2 anchors); per-sample sums of the metrics."""

import numpy as np
import pytest
from flax import nnx

from dspark_jax import groups
from dspark_jax.draft.model import DSparkDraft
from dspark_jax.draft.objective import metrics_from_sums
from dspark_jax.groups.memory import group as memory
from dspark_jax.training.evaluation import evaluation_with_records
from dspark_jax.training.intervals import sample_sums
from tests.draft.test_reference import CFG, _forward, _metrics, _randomize
from tests.groups.test_memory import _model, _reference_two_stage, crafted_batch
from tests.groups.test_reranker import _setup as _reranker_setup


def test_baseline_and_memory_measured_on_the_same_prefixes_match_a_float64_reference():
    """The baseline on Draft Memory's stage-2 anchors `a' = a + m + 1` (picked by the memory draft's own
    stage-1 pass) against float64 NumPy: the reference finds `a'` from the seed's text, the baseline's metrics
    at `a'` and the memory draft's stage-2 metrics, and both groups' blocks are the same set."""
    mem_model, mem_params, frozen = _model(seed=7)
    batch = crafted_batch(mem_model, mem_params, frozen)
    base_model = DSparkDraft(CFG, rngs=nnx.Rngs(3))
    base_params = _randomize(base_model, np.random.default_rng(3))
    emb, lm_head = frozen.embedding_VxH, np.asarray(frozen.lm_head_HxV, np.float64)

    want_memory, _, (anchors, keep) = _reference_two_stage(
        mem_params, emb, lm_head, mem_params["mask_embedding"], batch
    )
    h = _forward(base_params, emb, base_params["mask_embedding"], batch, anchors)
    want_base = _metrics(base_params, h, lm_head, batch, anchors, keep)

    picked_anchors, picked_keep = memory.stage2_prefixes(mem_model, frozen, batch)
    np.testing.assert_array_equal(np.asarray(picked_keep), keep)
    np.testing.assert_array_equal(np.asarray(picked_anchors)[keep == 1], anchors[keep == 1])
    assert not np.array_equal(anchors, np.asarray(batch["anchors"]))  # other prefixes than the batch's

    picker, base_group = (memory.MEMORY, mem_model), groups.get("baseline")
    base_sums, base_records = evaluation_with_records(base_group, base_model, frozen, batch, picker)
    mem_sums, mem_records = evaluation_with_records(memory.MEMORY, mem_model, frozen, batch, picker)
    np.testing.assert_array_equal(base_records["eval_mask"], mem_records["eval_mask"])  # the same blocks
    for want, sums in ((want_base, base_sums), (want_memory, mem_sums)):
        got = metrics_from_sums(sums)
        assert float(got["valid_blocks"]) == want["valid_blocks"] == 6
        for name in ("tau_prob", "loss", *(f"accept_rate_{i}" for i in range(7))):
            np.testing.assert_allclose(float(got[name]), want[name], rtol=1e-4, atol=1e-5, err_msg=name)
    assert abs(want_base["tau_prob"] - want_memory["tau_prob"]) > 1e-3  # two drafts, told apart

    plain_sums, _ = evaluation_with_records(groups.get("baseline"), base_model, frozen, batch)
    assert abs(float(metrics_from_sums(plain_sums)["tau_prob"]) - want_base["tau_prob"]) > 1e-3


def test_sample_sums_add_up_to_the_metrics_and_split_packed_samples():
    """Per-sample sums of a batch with a packed row: the keys tell the samples apart, and their totals give
    the summed metrics' tau_prob and accept rates."""
    model, params, frozen = _model(seed=7)
    batch = crafted_batch(model, params, frozen)
    sums, records = evaluation_with_records(groups.get("baseline"), model, frozen, batch)
    anchors = np.asarray(batch["anchors"])
    starts = anchors - np.take_along_axis(np.asarray(batch["positions"]), anchors, axis=1)
    keys = np.stack([np.zeros_like(anchors), np.broadcast_to([[0], [1]], anchors.shape), starts], -1)
    per = sample_sums({k: np.asarray(v) for k, v in records.items()}, keys)
    np.testing.assert_array_equal(per.keys_Kx3, [[0, 0, 0], [0, 1, 0], [0, 1, 20]])
    np.testing.assert_array_equal(per.blocks_K, [4, 2, 2])
    metrics = metrics_from_sums(sums)
    np.testing.assert_allclose(per.tau_K.sum() / per.blocks_K.sum(), float(metrics["tau_prob"]), rtol=1e-6)
    rates = per.accept_KxS.sum(0) / per.accept_count_KxS.sum(0)
    np.testing.assert_allclose(rates, [float(metrics[f"accept_rate_{i}"]) for i in range(7)], rtol=1e-6)


def test_a_rerankers_sample_sums_count_its_own_reranked_tau():
    """The prefix reranker's tau_prob and accept_rate_i (what the report's tables and plot read) are the
    reranked distribution's: its per-sample sums add up to those figures, not to the pre-rerank ones
    (which differ once the reranker's weights are random)."""
    model, _, frozen, batch, *_ = _reranker_setup(5, k=8)
    sums, records = evaluation_with_records(groups.get("reranker_joint"), model, frozen, batch)
    metrics = groups.get("reranker_joint").model.metrics(sums)
    anchors = np.asarray(batch["anchors"])
    starts = anchors - np.take_along_axis(np.asarray(batch["positions"]), anchors, axis=1)
    keys = np.stack([np.zeros_like(anchors), np.broadcast_to([[0], [1]], anchors.shape), starts], -1)
    per = sample_sums({k: np.asarray(v) for k, v in records.items()}, keys)
    assert abs(float(metrics["tau_prob"]) - float(metrics["pre_rerank_tau_prob"])) > 1e-3
    np.testing.assert_allclose(per.tau_K.sum() / per.blocks_K.sum(), float(metrics["tau_prob"]), rtol=1e-6)
    rates = per.accept_KxS.sum(0) / per.accept_count_KxS.sum(0)
    want = [float(metrics[f"accept_rate_{i}"]) for i in range(7)]
    np.testing.assert_allclose(rates, want, rtol=1e-5, atol=1e-7)
    before = [float(metrics[f"pre_rerank_accept_rate_{i}"]) for i in range(7)]
    assert np.abs(np.asarray(before) - want).max() > 1e-3


def test_prefixes_from_a_group_that_picks_none_or_from_other_batches_are_refused():
    """Before any restore: a picker whose group has no prefixes of its own, or whose config would give other
    validation batches (another seed, other data), is a one-line error naming what differs."""
    from dspark_jax.errors import UsageError
    from dspark_jax.suite import plan
    from dspark_jax.training.evaluation import Validation, open_prefixes

    rows = {g.name: g for g in plan.groups("seed")}
    config = {name: plan.group_config(rows[name], "smoke") for name in ("baseline", "memory")}
    v = Validation(config["baseline"], groups.get("baseline"), *[None] * (len(Validation._fields) - 2))
    with pytest.raises(UsageError, match=r"'baseline' run, a group without prefixes of its own; .*'memory'"):
        open_prefixes(v, config["baseline"], "/nowhere")
    other = config["memory"].copy_and_resolve_references()
    other.seed += 1
    with pytest.raises(UsageError, match="trained with another seed than the draft measured on its prefixes"):
        open_prefixes(v, other, "/nowhere")
