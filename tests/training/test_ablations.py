"""Evaluation's ablations: the same weights on the same blocks without the target context (every group) or
without Draft Memory's memory, against the float64 NumPy references of the draft and of the two stages."""

import numpy as np
import pytest
from flax import nnx

from dspark_jax import groups
from dspark_jax.draft.model import DSparkDraft
from dspark_jax.draft.objective import metrics_from_sums
from dspark_jax.groups.memory import group as memory
from dspark_jax.training import evaluation, intervals
from tests.draft.test_reference import CFG, _forward, _metrics, _randomize
from tests.groups.test_memory import _model, _reference_two_stage, crafted_batch

NAMES = ("tau_prob", "loss", *(f"accept_rate_{i}" for i in range(7)))


def _assert_metrics(sums, want, metrics=metrics_from_sums):
    got = metrics(sums)
    for name in NAMES:
        np.testing.assert_allclose(float(got[name]), want[name], rtol=1e-4, atol=1e-5, err_msg=name)


def test_the_context_ablation_hides_every_context_position_of_every_block():
    """The baseline as trained and without context against the reference with and without the context
    positions; the two figures differ (the ablation removes something) on the same blocks."""
    _, _, frozen = _model(seed=7)
    batch = crafted_batch(*_model(seed=7))
    model = DSparkDraft(CFG, rngs=nnx.Rngs(3))
    params = _randomize(model, np.random.default_rng(3))
    emb, lm_head = frozen.embedding_VxH, np.asarray(frozen.lm_head_HxV, np.float64)
    anchors, keep = np.asarray(batch["anchors"]), np.asarray(batch["block_keep"])
    variants = evaluation.measured_variants(groups.get("baseline"), model, frozen, batch)
    assert set(variants) == {evaluation.AS_TRAINED, "context"}
    want = {
        name: _metrics(
            params,
            _forward(params, emb, params["mask_embedding"], batch, anchors, context=seen),
            lm_head,
            batch,
            anchors,
            keep,
        )
        for name, seen in ((evaluation.AS_TRAINED, True), ("context", False))
    }
    for name, (sums, _) in variants.items():
        _assert_metrics(sums, want[name])
    np.testing.assert_array_equal(variants[""][1]["eval_mask"], variants["context"][1]["eval_mask"])
    assert abs(want[""]["tau_prob"] - want["context"]["tau_prob"]) > 1e-3


def test_draft_memorys_ablations_keep_stage_one_and_its_blocks():
    """Draft Memory without context (stage 2 only: stage 1 picks the blocks with the context) and without
    its memory slots, against the two-stage reference: the same stage-2 blocks, three different figures."""
    model, params, frozen = _model(seed=7)
    batch = crafted_batch(model, params, frozen)
    emb, lm_head = frozen.embedding_VxH, np.asarray(frozen.lm_head_HxV, np.float64)
    variants = evaluation.measured_variants(memory.MEMORY, model, frozen, batch)
    assert set(variants) == {evaluation.AS_TRAINED, "context", "memory"}
    settings = {"": {}, "context": {"context2": False}, "memory": {"memory2": False}}
    taus = {}
    for name, kwargs in settings.items():
        want, _, _ = _reference_two_stage(params, emb, lm_head, params["mask_embedding"], batch, **kwargs)
        sums, records = variants[name]
        _assert_metrics(sums, want, memory.memory_metrics)
        np.testing.assert_array_equal(records["eval_mask"], variants[""][1]["eval_mask"])
        taus[name] = want["tau_prob"]
    assert min(abs(taus[""] - taus["context"]), abs(taus[""] - taus["memory"])) > 1e-3


@pytest.mark.parametrize("shift", [0.0, 0.25])
def test_an_ablations_gain_is_the_paired_difference_with_its_interval(shift):
    """`ablation_metrics`: tau_prob without the input, and the gain over it with the paired interval,
    which excludes zero for a per-sample gain and holds zero for none."""
    rng = np.random.default_rng(0)
    blocks = rng.integers(4, 12, size=64).astype(float)
    tau = blocks * rng.uniform(1.2, 2.5, size=64)
    keys = np.stack([np.zeros(64), np.zeros(64), np.arange(64)], 1)
    sums = lambda t: intervals.SampleSums(keys, t, blocks, np.zeros((64, 7)), np.ones((64, 7)))
    without = tau - shift * blocks * rng.uniform(0.5, 1.5, size=64)
    out = evaluation.ablation_metrics(
        groups.get("baseline"),
        sums(tau),
        {"context": ({"tau_prob": without.sum() / blocks.sum()}, sums(without))},
    )
    np.testing.assert_allclose(out["tau_prob_without_context"], without.sum() / blocks.sum())
    np.testing.assert_allclose(out["context_gain"], (tau.sum() - without.sum()) / blocks.sum(), atol=1e-12)
    assert out["context_gain_low95"] <= out["context_gain"] <= out["context_gain_high95"]
    told_apart = out["context_gain_low95"] > 0
    assert told_apart == (shift > 0)
