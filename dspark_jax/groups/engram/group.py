"""Groups 2-4, the Engram groups: Engram-Markov, Engram-MASK gated residual, Engram-MASK replacement.

Training looks features up from the batch's token ids on device (the side input `TABLE`, a fitted
`dspark_jax.groups.engram.EngramTable`): Engram-Markov reads `e[a+i]` for prediction `i` (the teacher-forced
predecessor's prefix), Engram-MASK reads `e[a-1]` (zero when the anchor starts its sample or the block is
padding). Inference keeps each request's last `N` tokens (`N` = the largest order) and hashes the prefix
as it grows: Engram-MASK once per cycle from the pre-anchor prefix, Engram-Markov once per drafted token
inside the selection loop from the drafted prefix (the second token's n-gram ends in the first drafted
token, never in a reference). Model pieces and formulas: `dspark_jax.groups.engram.model`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dspark_jax.draft import blocks
from dspark_jax.draft.model import DSparkDraft, FrozenTarget, vocab_columns
from dspark_jax.groups.baseline import block_states, objective_sums
from dspark_jax.groups.engram import model as engram_lib
from dspark_jax.groups.engram import prepare
from dspark_jax.groups.engram.table import EngramTable
from dspark_jax.groups.registry import Batch, Design, Experiment, Model, Report, Run, register
from dspark_jax.inference import engine

FEATURES = "engram"  # the predecessors' features among the objective's per-block inputs
TABLE = "engram"  # the group's side input: the fitted table on device (`FrozenTarget.side_inputs[TABLE]`)


def table_of(frozen: FrozenTarget) -> EngramTable:
    """The run's Engram table among the frozen side inputs."""
    table = (frozen.side_inputs or {}).get(TABLE)
    if table is None:
        raise ValueError(f"this experiment group needs an Engram table (FrozenTarget.side_inputs[{TABLE!r}])")
    return table


def side_inputs(config, *, fingerprint, tokenizer_fingerprint, vocab_size, load_target) -> dict:
    """The config's table for this target on device, fitted first (with `load_target()`) when missing."""
    table = prepare.prepare_table(config, fingerprint, tokenizer_fingerprint, vocab_size, load_target)
    return {TABLE: table.to_device()}


def synthetic_side_inputs(config, vocab_size: int) -> dict:
    """A table of the config's shape: random rows, identity compression."""
    return {TABLE: prepare.synthetic_table(config, vocab_size)}


def features_at(frozen: FrozenTarget, batch: Batch, positions_BxNxK: jax.Array, valid_BxNxK) -> jax.Array:
    """Engram features `e[t]` `[B, N, K, U]` of the row positions `t` (zero where not `valid`)."""
    table = table_of(frozen)
    rows_BxTxZ = table.row_ids(batch["input_ids"], batch["positions"])
    b, n, k = positions_BxNxK.shape
    flat_BxNK = jnp.clip(positions_BxNxK, 0, rows_BxTxZ.shape[1] - 1).reshape(b, n * k)
    ids_BxNKxZ = jnp.take_along_axis(rows_BxTxZ, flat_BxNK[..., None], axis=1)
    e_BxNxKxU = jnp.take(table.rows_xW, ids_BxNKxZ, axis=0).reshape(b, n, k, table.dim)
    return jnp.where(valid_BxNxK[..., None], e_BxNxKxU, 0)


def pre_anchor_features(frozen: FrozenTarget, batch: Batch, anchors_BxN, keep_BxN) -> jax.Array:
    """`e[a-1]` `[B, N, U]`; zero when `a` is its sample's first position or the block is not kept."""
    anchor_pos_BxNx1, _ = blocks.gather_blocks(batch["positions"].astype(jnp.int32), anchors_BxN[..., None])
    valid_BxNx1 = (anchor_pos_BxNx1 >= 1) & (keep_BxN[..., None] != 0)
    return features_at(frozen, batch, anchors_BxN[..., None] - 1, valid_BxNx1)[:, :, 0]


def engram_markov_sums(model: DSparkDraft, frozen: FrozenTarget, batch: Batch) -> dict[str, jax.Array]:
    """The baseline objective with each prediction's Markov head reading `e[a+i]`."""
    anchors_BxN = batch["anchors"]
    targets, h_BxNxSxH = block_states(model, frozen, batch, anchors_BxN, batch["block_keep"])
    positions_BxNxS = blocks.teacher_positions(anchors_BxN, model.cfg.block_size)
    e_BxNxSxU = features_at(frozen, batch, positions_BxNxS, jnp.ones(positions_BxNxS.shape, bool))
    return objective_sums(
        model, frozen, batch, anchors_BxN, targets, h_BxNxSxH, _markov_heads, {FEATURES: e_BxNxSxU}
    )


def _markov_heads(model, frozen: FrozenTarget, chunk) -> dict[str, jax.Array]:
    """The draft's heads with each prediction's Markov representation read from its predecessor's
    features `e[a+i]`."""
    base_xSxV = model.base_logits(frozen, chunk["h"])  # the order `heads` computes them in: the same program
    m_xSxR = model.markov_features(chunk["h"], chunk["predecessors"], chunk[FEATURES])
    return model.corrected(base_xSxV, chunk["h"], chunk["predecessors"], vocab_columns(frozen), m_xSxR)


def engram_mask_sums(model: DSparkDraft, frozen: FrozenTarget, batch: Batch) -> dict[str, jax.Array]:
    """The baseline objective with block inputs built from `e[a-1]`."""
    anchors_BxN, keep_BxN = batch["anchors"], batch["block_keep"]
    e_BxNxU = pre_anchor_features(frozen, batch, anchors_BxN, keep_BxN)
    targets, h_BxNxSxH = block_states(
        model,
        frozen,
        batch,
        anchors_BxN,
        keep_BxN,
        block_inputs=lambda a_BxN: model.block_inputs(frozen, a_BxN, e_BxNxU),
    )
    return objective_sums(model, frozen, batch, anchors_BxN, targets, h_BxNxSxH)


# --- Inference: the request's recent tokens, hashed as the prefix grows. ---


class RecentTokens(NamedTuple):
    """Per request, the `N` tokens before the pending one, `x[p-N..p-1]` (`[B, N]`; entries before the
    sequence start are placeholders that hashing replaces by the pad id)."""

    tokens_BxN: jax.Array


class PrefixWindow:
    """The last `N` tokens of a growing prefix ending at position `end - 1`, and their Engram features.

    Trace-time state: `push` appends a token (the prefix grows by one) and returns the features of the
    prefix ending at it; `features` those of the current prefix.
    """

    def __init__(self, table: EngramTable, tokens_BxN: jax.Array, end_B: jax.Array):
        self.table, self.tokens_BxN, self.end_B = table, tokens_BxN, end_B

    def features(self) -> jax.Array:
        """`e [B, U]` of the prefix ending at the window's last token."""
        width = self.tokens_BxN.shape[1]
        positions_BxN = self.end_B[:, None] - width + jnp.arange(width)
        return self.table.features(self.tokens_BxN, positions_BxN)[:, -1]

    def push(self, token_B: jax.Array) -> jax.Array:
        self.tokens_BxN = jnp.concatenate([self.tokens_BxN[:, 1:], token_B[:, None]], axis=1)
        self.end_B = self.end_B + 1
        return self.features()


def init_recent(draft, tokens_BxP, lengths_B) -> RecentTokens:
    """The last `N` prompt tokens of each right-padded prompt."""
    width = draft.cfg.engram_order
    positions_BxN = lengths_B[:, None] - width + jnp.arange(width)
    taken_BxN = jnp.take_along_axis(tokens_BxP, jnp.clip(positions_BxN, 0, tokens_BxP.shape[1] - 1), axis=1)
    return RecentTokens(jnp.where(positions_BxN >= 0, taken_BxN, 0).astype(jnp.int32))


def next_recent(draft, state: engine.SpecState, draft_out, proposals, num_accepted_B) -> RecentTokens:
    """The `N` tokens before the next pending token: of the old window, the anchor and the `m` accepted
    drafts, the last `N`."""
    seq_BxL = jnp.concatenate([state.carry.tokens_BxN, state.pending_B[:, None], proposals.drafts_BxS], 1)
    take_BxN = num_accepted_B[:, None] + 1 + jnp.arange(draft.cfg.engram_order)
    return engine.where_active(state, RecentTokens(jnp.take_along_axis(seq_BxL, take_BxN, axis=1)))


def _window(frozen: FrozenTarget, state: engine.SpecState) -> PrefixWindow:
    """The pre-anchor prefix `x[..p-1]` of each request."""
    return PrefixWindow(table_of(frozen), state.carry.tokens_BxN, state.target_cache.end_B)


def _mask_draft_pass(draft, frozen: FrozenTarget, state: engine.SpecState) -> jax.Array:
    """One lookup per cycle (the pre-anchor prefix), then the draft pass."""
    e_Bx1xU = _window(frozen, state).features()[:, None]
    return engine.draft_hidden(
        draft, frozen, state, draft.block_inputs(frozen, state.pending_B[:, None], e_Bx1xU)
    )


def _markov_select(draft, frozen: FrozenTarget, h_BxSxH, state: engine.SpecState, rng, settings):
    """Markov selection where slot `i` looks up the drafted prefix ending at its predecessor: the anchor
    for the first slot, then each drafted token as it is chosen."""
    window = _window(frozen, state)
    markov = lambda h_BxH, token_B: draft.markov_features(h_BxH, token_B, window.push(token_B))
    return engine.markov_select(draft, frozen, h_BxSxH, state, rng, settings, markov)


_HASHING = "the group's n-gram hash tables (a side input of the draft) and hashing of the drafted prefix, "


def _register(
    name, label, design, build, sums, serving_gap, draft_pass=engine.draft_hidden, select=engine.markov_select
):
    proposer = engine.Proposer(draft_pass, select, init_recent, next_recent)
    return register(
        Experiment(
            name=name,
            model=Model(
                build_draft=build,
                train_sums=sums,
                proposer=proposer,
                config_class=engram_lib.EngramDraftConfig,
            ),
            run=Run(
                shape_keys=("draft.engram_dim", "draft.engram_order", "engram"),
                path_keys=(("engram", "table_path"),),
                source_keys=(("engram", "fit_source"),),
                sharding_rules=(("engram", None),),
                check_config=prepare.check_config,
                side_inputs=side_inputs,
                synthetic_side_inputs=synthetic_side_inputs,
                serving_gap=_HASHING + serving_gap,
            ),
            report=Report(label=label, design=design, suites=("seed",)),
        )
    )


ENGRAM_MARKOV = _register(
    "engram_markov",
    "Engram-Markov",
    Design(
        initialisation="from scratch",
        updates="the draft and the Engram projections W_Q, W_K, W_V jointly",
        adds="n-gram features of the drafted prefix in the Markov head (W_V zero-initialised: starts as the "
        "vanilla Markov head)",
        question="how n-gram conditioning of the Markov head changes acceptance length",
    ),
    engram_lib.EngramMarkovDraft,
    engram_markov_sums,
    "fed through W_Q, W_K, W_V into the Markov head at every slot (the engines' Markov head is the vanilla "
    "low-rank one, markov_head_type 'vanilla', 'gated' or 'rnn')",
    select=_markov_select,
)
ENGRAM_MASK_GATED = _register(
    "engram_mask_gated",
    "Engram-MASK gated",
    Design(
        initialisation="from scratch",
        updates="the draft, the input projection P and the per-slot scalar gates jointly",
        adds="a prefix-feature residual on the MASK embedding, one zero-initialised gate per block slot",
        question="what gated injection of prefix features does while keeping the MASK embedding",
    ),
    engram_lib.EngramMaskDraft,
    engram_mask_sums,
    "projected by P and added through per-slot gates to the MASK embedding (the engines feed "
    "embed_tokens[mask_token_id] unchanged)",
    draft_pass=_mask_draft_pass,
)
ENGRAM_MASK_REPLACE = _register(
    "engram_mask_replace",
    "Engram-MASK replace",
    Design(
        initialisation="from scratch",
        updates="the draft and the input projection P jointly",
        adds="content-dependent block inputs (projected prefix features) replacing the MASK embedding",
        question="what content-dependent inputs do in place of the fixed MASK embedding",
    ),
    engram_lib.EngramReplaceDraft,
    engram_mask_sums,
    "projected by P into the block's slots in place of the MASK embedding (the engines feed "
    "embed_tokens[mask_token_id])",
    draft_pass=_mask_draft_pass,
)
