"""Group 5, Draft Memory: two-stage training and multi-round inference with last-round draft states.

Training, one jitted function per micro-batch (index math: `dspark_jax.groups.memory.model`):

  stage 1  the draft without memory on the batch's anchors, under `stop_gradient` (a parameter copy
           no gradient reaches): greedy leading matches `m` with the recorded tokens;
  stage 2  the draft on `a' = a + m + 1` with context `j < a'` and the adapted stage-1 states as
           memory; the baseline loss on stage 2 only. Dropped transitions carry no weight.

Inference keeps each request's last-round final states and feeds the suffix past the first rejection
to the next round (`MEMORY_PROPOSER`); `memory_source` picks the memory-conditioned states of the
round itself or one extra memory-free pass (what training sees); 'disabled' drafts without memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.draft import blocks, objective
from dspark_jax.draft.model import FrozenTarget
from dspark_jax.groups.baseline import block_states, objective_sums
from dspark_jax.groups.memory import model as memory_lib
from dspark_jax.groups.registry import (
    HIDE_CONTEXT,
    Ablation,
    Batch,
    DecodeOption,
    Design,
    Experiment,
    Model,
    Report,
    Run,
    register,
)
from dspark_jax.inference import engine

# The memory ablation: stage 2 without memory slots (the same stage 1, the same stage-2 blocks).
HIDE_MEMORY = "hide_memory"


def _stage1(stage1: memory_lib.MemoryDraft, frozen: FrozenTarget, batch: Batch):
    """Stage 1 on the batch's anchors (no memory, no gradient): its block targets, states `h1`, leading
    matches `m` and the transition to the stage-2 anchors `a' = a + m + 1`. It picks the blocks stage 2 is
    measured on, so it sees the target context under the context ablation too (stage 2 does not)."""
    anchors_BxN, keep_BxN = batch["anchors"], batch["block_keep"]
    batch = {**batch, HIDE_CONTEXT: False}
    targets1, h1_BxNxSxH = block_states(stage1, frozen, batch, anchors_BxN, keep_BxN)
    h1_BxNxSxH = jax.lax.stop_gradient(h1_BxNxSxH)
    matches_BxN = jax.lax.stop_gradient(memory_lib.leading_matches(stage1, frozen, h1_BxNxSxH, targets1))
    step = memory_lib.transition(anchors_BxN, matches_BxN, keep_BxN, batch["loss_mask"], batch["positions"])
    return targets1, h1_BxNxSxH, matches_BxN, step


def stage2_prefixes(
    model: memory_lib.MemoryDraft, frozen: FrozenTarget, batch: Batch
) -> tuple[jax.Array, jax.Array]:
    """The prefixes Draft Memory's figures are measured on: the stage-2 anchors `a' = a + m + 1` of the
    batch's blocks (`m` from this draft's own memory-free stage-1 pass) and which of them are kept, each
    `[B, N]`; block `n` stays in the sample of the batch's block `n`."""
    _, _, _, step = _stage1(model, frozen, batch)
    return step.anchors_BxN, step.keep_BxN


def two_stage_sums(
    stage1: memory_lib.MemoryDraft, model: memory_lib.MemoryDraft, frozen: FrozenTarget, batch: Batch
) -> dict[str, jax.Array]:
    """Stage-2 objective sums and the stage-1 / transition statistics of one micro-batch.

    `stage1` is the model stage 1 runs with (`memory_sums` passes a stop-gradient copy of `model`).
    Extra sums: `stage1_blocks` (stage-1 blocks with a valid first prediction), `stage1_matches` (their
    summed `m`), `stage1_match_hist` [S + 1] (those blocks per `m`), `transitions` (stage-2 blocks with
    a valid first prediction: the blocks the loss sees), `memory_blocks` (those with at least one memory
    slot) and `memory_slots` (their summed memory length).
    """
    anchors_BxN = batch["anchors"]
    targets1, h1_BxNxSxH, matches_BxN, step = _stage1(stage1, frozen, batch)
    sources_BxNxSxH = h1_BxNxSxH
    if model.cfg.memory_states == "target":  # the positive control: a perfect stage 1
        sources_BxNxSxH = blocks.teacher_hidden(batch["last_hidden"], anchors_BxN, model.cfg.block_size)
    memory = model.memory(sources_BxNxSxH, anchors_BxN, matches_BxN, step.keep_BxN)
    if batch.get(HIDE_MEMORY, False):
        memory = memory._replace(valid_BxNxM=jnp.zeros_like(memory.valid_BxNxM))
    targets2, h2_BxNxSxH = block_states(model, frozen, batch, step.anchors_BxN, step.keep_BxN, memory)
    sums = objective_sums(model, frozen, batch, step.anchors_BxN, targets2, h2_BxNxSxH)

    stage1_BxN = targets1.eval_mask[..., 0] != 0
    stage2_BxN = targets2.eval_mask[..., 0] != 0
    memory_len_BxN = jnp.sum(memory.valid_BxNxM, axis=-1)
    total = lambda x: jnp.sum(x).astype(jnp.float32)
    match_hist_BxNxS1 = jax.nn.one_hot(matches_BxN, model.cfg.block_size + 1) * stage1_BxN[..., None]
    return sums | {
        "stage1_blocks": total(stage1_BxN),
        "stage1_matches": total(jnp.where(stage1_BxN, matches_BxN, 0)),
        "stage1_match_hist": jnp.sum(match_hist_BxNxS1, axis=(0, 1)),
        "transitions": total(stage2_BxN),
        "memory_blocks": total(stage2_BxN & (memory_len_BxN > 0)),
        "memory_slots": total(jnp.where(stage2_BxN, memory_len_BxN, 0)),
    }


def memory_sums(model: memory_lib.MemoryDraft, frozen: FrozenTarget, batch: Batch) -> dict[str, jax.Array]:
    """`two_stage_sums` with stage 1 on a stop-gradient copy of `model`'s parameters."""
    graphdef, state = nnx.split(model)
    return two_stage_sums(nnx.merge(graphdef, jax.lax.stop_gradient(state)), model, frozen, batch)


def memory_metrics(sums: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """The baseline metrics of stage 2 plus the stage-1 and transition statistics.

    `stage1_mean_matches` and `stage1_matches_{k}` (share of stage-1 blocks with `m = k`);
    `transition_kept` (stage-2 blocks per stage-1 block); `memory_block_fraction` and
    `memory_mean_length` (over stage-2 blocks, empty memories included).
    """
    div = objective.safe_div
    stage1, transitions = sums["stage1_blocks"], sums["transitions"]
    hist = sums["stage1_match_hist"]
    return (
        objective.metrics_from_sums(sums)
        | {
            "stage1_mean_matches": div(sums["stage1_matches"], stage1),
            "transition_kept": div(transitions, stage1),
            "memory_block_fraction": div(sums["memory_blocks"], transitions),
            "memory_mean_length": div(sums["memory_slots"], transitions),
        }
        | {f"stage1_matches_{k}": div(hist[k], stage1) for k in range(hist.shape[0])}
    )


class MemoryCarry(NamedTuple):
    """Per request: the last round's final states `[B, S, H]`, its anchor and its accepted count (`S`
    before the first round: all accepted keeps no memory)."""

    h_BxSxH: jax.Array
    anchor_B: jax.Array
    matches_B: jax.Array


def _init_carry(draft: memory_lib.MemoryDraft, tokens_BxP, lengths_B) -> MemoryCarry:
    cfg, rows = draft.cfg, tokens_BxP.shape[0]
    h = jnp.zeros((rows, cfg.block_size, cfg.hidden_size), draft.dtype)
    return MemoryCarry(h, jnp.zeros((rows,), jnp.int32), jnp.full((rows,), cfg.block_size, jnp.int32))


def _draft_pass(draft: memory_lib.MemoryDraft, frozen: FrozenTarget, state: engine.SpecState) -> dict:
    """This round's states with the last round's memory, and the states the next round's memory comes
    from (the same ones, or one memory-free pass with `memory_source='no_memory'`)."""
    source = draft.cfg.memory_source
    if source == "disabled":
        h_BxSxH = engine.draft_hidden(draft, frozen, state)
        return {"h": h_BxSxH, "source": h_BxSxH, "anchor": state.target_cache.end_B}
    carry: MemoryCarry = state.carry
    to_blocks = lambda x_B: x_B[:, None]  # one block per row
    memory = draft.memory(
        *map(to_blocks, (carry.h_BxSxH, carry.anchor_B, carry.matches_B)),
        jnp.ones_like(carry.matches_B)[:, None],
    )
    h_BxSxH = engine.draft_hidden(draft, frozen, state, memory=memory)
    source_BxSxH = engine.draft_hidden(draft, frozen, state) if source == "no_memory" else h_BxSxH
    return {"h": h_BxSxH, "source": source_BxSxH, "anchor": state.target_cache.end_B}


def _select(draft, frozen, draft_out, state, rng, settings) -> engine.Proposals:
    return engine.markov_select(draft, frozen, draft_out["h"], state, rng, settings)


def _next_carry(draft, state: engine.SpecState, draft_out, proposals, num_accepted_B) -> MemoryCarry:
    """The next round's memory source: this round's states, anchor and accepted count (active rows)."""
    new = MemoryCarry(draft_out["source"], draft_out["anchor"], num_accepted_B)
    return engine.where_active(state, new)


MEMORY_PROPOSER = engine.Proposer(_draft_pass, _select, _init_carry, _next_carry)

MEMORY = register(
    Experiment(
        name="memory",
        model=Model(
            build_draft=memory_lib.MemoryDraft,
            train_sums=memory_sums,
            metrics=memory_metrics,
            proposer=MEMORY_PROPOSER,
            config_class=memory_lib.MemoryDraftConfig,
            prefixes=stage2_prefixes,
            prefixes_note="They are its stage-2 anchors a' = a + m + 1, after its stage-1 draft's first "
            "error on a uniformly drawn anchor a: the only blocks on which it has a memory (as in decoding). "
            "Its own figure is measured there, so every other row is too: the same-prefix columns ask what "
            "the memory adds where it exists, on equal blocks.",
        ),
        run=Run(
            resumable_keys=("draft.memory_source",),
            serving_gap="the last cycle's draft states past its first rejected slot kept per request and "
            "read through the memory adapter as extra context of the next block (the engines' draft reads "
            "the target's hidden states and its own block only)",
            decode_options=(
                DecodeOption(
                    "memory_source",
                    "draft.memory_source",
                    memory_lib.MEMORY_SOURCES,
                    "Draft Memory checkpoints: where the next round's memory comes from: 'with_memory' (this "
                    "round's states), 'no_memory' (one extra memory-free draft pass per round, as in "
                    "training) or 'disabled' (no memory); default: config.draft.memory_source.",
                ),
            ),
        ),
        report=Report(
            label="Draft Memory",
            design=Design(
                initialisation="from scratch",
                updates="the draft and the memory adapter, by the loss of stage 2 (stage 1: stop-gradient)",
                adds="a memory adapter M = RMSNorm(P h) over the last round's draft states past its first "
                "error",
                question="what the previous round's draft states do for the continuation at the new anchor",
            ),
            suites=("seed",),
            report_note="Draft Memory's own tau_prob is measured on its stage-2 anchors.",
            ablations=(Ablation("memory", HIDE_MEMORY),),
        ),
    )
)
