"""Group 1, Baseline DSpark: the draft of docs/design.md section 1 trained from scratch."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax

from dspark_jax.draft import blocks, objective
from dspark_jax.draft.model import DraftMemory, DSparkDraft, FrozenTarget, vocab_columns
from dspark_jax.groups.registry import HIDE_CONTEXT, Batch, Design, Experiment, Model, Report, register


def block_states(
    model: DSparkDraft,
    frozen: FrozenTarget,
    batch: Batch,
    anchors_BxN: jax.Array,
    block_keep_BxN: jax.Array,
    memory: DraftMemory | None = None,
    block_inputs: Callable[[jax.Array], jax.Array] | None = None,
) -> tuple[blocks.BlockTargets, jax.Array]:
    """Block targets (derived on device) and final draft states `h [B, N, S, H]` of the blocks at
    `anchors_BxN` (kept where `block_keep_BxN`); `memory` adds per-block key/value sources;
    `block_inputs(anchor_tokens_BxN) -> [B, N, S, H]` builds the blocks' inputs (default the draft's
    `block_inputs`). With `batch[HIDE_CONTEXT]` (the context ablation) each block's context ends where it
    starts: it sees no target context, only its own slots and `memory` (RoPE is relative: nothing else
    moves)."""
    positions_BxT = batch["positions"]
    targets = blocks.block_targets(
        batch["input_ids"],
        batch["loss_mask"],
        anchors_BxN,
        block_keep_BxN,
        model.cfg.block_size,
        positions_BxT,
    )
    ctx_BxTxH = model.context(batch["aux_hidden"].astype(model.dtype))
    starts_BxN = blocks.sample_starts(positions_BxT, anchors_BxN)
    if batch.get(HIDE_CONTEXT, False):
        starts_BxN = anchors_BxN.astype(starts_BxN.dtype)
    h_BxNxSxH = model.backbone(
        (block_inputs or (lambda a_BxN: model.block_inputs(frozen, a_BxN)))(targets.predecessors[..., 0]),
        model.context_kv(ctx_BxTxH, positions_BxT),
        anchors_BxN,
        memory,
        starts_BxN=starts_BxN,
    )
    return targets, h_BxNxSxH


def objective_sums(
    model: DSparkDraft,
    frozen: FrozenTarget,
    batch: Batch,
    anchors_BxN: jax.Array,
    targets: blocks.BlockTargets,
    h_BxNxSxH: jax.Array,
    heads: Callable | None = None,
    extra_inputs: Mapping[str, jax.Array] | None = None,
) -> dict[str, jax.Array]:
    """Objective and metric sums of the blocks at `anchors_BxN` from their `block_states`. `heads(model,
    frozen, chunk)` replaces the draft's `heads` on one chunk of `{h, predecessors, **extra_inputs}`
    (per-block arrays `[B, N, ...]`, chunked with them): a group's own inputs and sums go there."""
    cfg = model.cfg
    inputs = {"h": h_BxNxSxH, "predecessors": targets.predecessors, **(extra_inputs or {})}
    heads = heads or (lambda m, f, chunk: m.heads(f, chunk["h"], chunk["predecessors"]))
    columns = vocab_columns(frozen)
    model = model.on_columns(columns)  # the draft vocabulary's W2 columns gathered once, not per chunk
    return objective.block_objective_sums(
        lambda chunk: heads(model, frozen, chunk),
        inputs,
        blocks.teacher_hidden(batch["last_hidden"], anchors_BxN, cfg.block_size),
        frozen.lm_head_HxV,
        targets.labels,
        targets.eval_mask,
        anchor_chunk=cfg.anchor_chunk,
        remat=cfg.remat,
        vocab_ids_K=columns,
    )


def draft_sums(model: DSparkDraft, frozen: FrozenTarget, batch: Batch) -> dict[str, jax.Array]:
    """Objective and metric sums of the DSpark draft on one (micro-)batch: the batch's own anchors."""
    anchors_BxN = batch["anchors"]
    targets, h_BxNxSxH = block_states(model, frozen, batch, anchors_BxN, batch["block_keep"])
    return objective_sums(model, frozen, batch, anchors_BxN, targets, h_BxNxSxH)


BASELINE = register(
    Experiment(
        name="baseline",
        model=Model(build_draft=DSparkDraft, train_sums=draft_sums),
        report=Report(
            label="Baseline",
            suites=("seed",),
            design=Design(
                initialisation="from scratch",
                updates="the whole draft (backbone, Markov head, confidence head), DSpark loss",
                adds="nothing: the reference",
                question="how far the original DSpark structure converges as the training budget grows",
            ),
        ),
    )
)
