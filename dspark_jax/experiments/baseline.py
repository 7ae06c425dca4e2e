"""Group 1, Baseline DSpark: the draft of DESIGN.md section 2 trained from scratch."""

from __future__ import annotations

import jax

from dspark_jax.draft import blocks, objective
from dspark_jax.draft.model import DSparkDraft, FrozenTarget
from dspark_jax.experiments.registry import Batch, Experiment, register


def draft_sums(model: DSparkDraft, frozen: FrozenTarget, batch: Batch) -> dict[str, jax.Array]:
    """Objective and metric sums of the DSpark draft on one (micro-)batch, block targets derived on device."""
    cfg = model.cfg
    anchors_BxN = batch["anchors"]
    positions_BxT = batch["positions"]
    targets = blocks.block_targets(
        batch["input_ids"],
        batch["loss_mask"],
        anchors_BxN,
        batch["block_keep"],
        cfg.block_size,
        positions_BxT,
    )
    ctx_BxTxH = model.context(batch["aux_hidden"].astype(model.dtype))
    h_BxNxSxH = model.backbone(
        model.block_inputs(frozen, targets.predecessors[..., 0]),
        model.context_kv(ctx_BxTxH, positions_BxT),
        anchors_BxN,
        starts_BxN=blocks.sample_starts(positions_BxT, anchors_BxN),
    )
    return objective.block_objective_sums(
        lambda chunk: model.heads(frozen, chunk["h"], chunk["predecessors"]),
        {"h": h_BxNxSxH, "predecessors": targets.predecessors},
        blocks.teacher_hidden(batch["last_hidden"], anchors_BxN, cfg.block_size),
        frozen.lm_head_HxV,
        targets.labels,
        targets.eval_mask,
        anchor_chunk=cfg.anchor_chunk,
        remat=cfg.remat,
    )


BASELINE = register(Experiment(name="baseline", build_draft=DSparkDraft, train_sums=draft_sums))
