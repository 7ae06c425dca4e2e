"""Groups 6 and 7, Prefix reranker: joint (the DSpark draft and the prefix reranker trained together from
scratch) and frozen baseline (a trained baseline checkpoint restored, only the reranker trained, with a
fresh optimizer and schedule; metrics on the cumulative step axis: `config.init.step` + new steps).

The objective is the baseline's on every valid prediction plus the rank loss: the candidate-set CE of the
teacher argmax `v* = argmax p_i` over the predictions where `v*` is among the candidates `C_i`, weighted
`exp(-i/4)` (0-based `i`; the seed's `exp(-(i-1)/4)`), normalised by the hit weight (zero without a hit).
Metrics (the seed's "评估口径"): `tau_prob` of the reranked distribution (softmax of the K scores, zero
outside the candidates; the teacher keeps its full-vocabulary `p`) and `pre_rerank_tau_prob` of the
full-vocabulary DSpark distribution, `rerank_tau_gain` (their difference), `rerank_target_agreement_gain`
(share of valid predictions whose greedy choice is `v*`, after minus before), `reranker/candidate_recall`
(share with `v*` in `C_i`), `rerank_teacher_forced_prefix_gain` (per valid block, the leading predictions
whose greedy choice equals the recorded token, after minus before), `rank_loss`; `accept_rate_i` are the
reranked choice's (the figure `tau_prob` counts), `pre_rerank_accept_rate_i` DSpark's.

Model pieces and formulas: `dspark_jax.groups.reranker.model`.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp

from dspark_jax.draft import objective
from dspark_jax.draft.model import FrozenTarget, vocab_columns
from dspark_jax.groups.baseline import block_states, objective_sums
from dspark_jax.groups.registry import Batch, Design, Experiment, Model, Report, Run, register
from dspark_jax.groups.reranker import model as reranker_lib
from dspark_jax.inference import engine

RERANK_LOSS: objective.LossTerms = {**objective.DSPARK_LOSS, "rank_weight": {"rank": 1.0}}


def rerank_sums(
    logits_xSxK: jax.Array,
    reranked: reranker_lib.Reranked,
    p_xSxV: jax.Array,
    labels_xS,
    mask_xS,
    columns_K: jax.Array | None = None,
) -> dict[str, jax.Array]:
    """The rank loss and rerank metric sums of teacher-forced blocks `[..., S]` (see the module doc); the
    draft's logits cover the vocabulary ids `columns_K` where a draft vocabulary is set (None: all)."""
    candidates_xSxK, scores_xSxK = reranked
    valid_xS = mask_xS > 0
    weight_xS = objective.position_weights(mask_xS)
    v_star_xS = jnp.argmax(p_xSxV, axis=-1).astype(candidates_xSxK.dtype)
    is_star_xSxK = candidates_xSxK == v_star_xS[..., None]
    hit_xS = jnp.any(is_star_xSxK, axis=-1) & valid_xS
    log_q_xSxK = jax.nn.log_softmax(scores_xSxK, axis=-1)
    rank_ce_xS = -jnp.sum(jnp.where(is_star_xSxK, log_q_xSxK, 0.0), axis=-1)
    p_cand_xSxK = jnp.take_along_axis(p_xSxV, candidates_xSxK, axis=-1)
    overlap_xS = jax.lax.stop_gradient(jnp.sum(jnp.minimum(p_cand_xSxK, jnp.exp(log_q_xSxK)), axis=-1))
    accepted_xS = jnp.where(valid_xS, overlap_xS * mask_xS, 0.0)
    valid_block_x = valid_xS[..., 0]
    tau_x = 1.0 + jnp.sum(jnp.cumprod(accepted_xS, axis=-1), axis=-1)
    best_xS = jnp.argmax(scores_xSxK, axis=-1)
    choice_xS = jnp.take_along_axis(candidates_xSxK, best_xS[..., None], axis=-1)[..., 0]
    before_xS = jnp.argmax(logits_xSxK, axis=-1)
    before_xS = (before_xS if columns_K is None else columns_K[before_xS]).astype(choice_xS.dtype)

    def agree(c_xS):
        return jnp.sum((c_xS == v_star_xS) & valid_xS)

    def prefix(c_xS):
        return jnp.sum(jnp.cumprod(((c_xS == labels_xS) & valid_xS).astype(jnp.int32), axis=-1))

    total = lambda x: jnp.sum(x).astype(jnp.float32)
    return {
        "rank": total(jnp.where(hit_xS, weight_xS * rank_ce_xS, 0.0)),
        "rank_weight": total(jnp.where(hit_xS, weight_xS, 0.0)),
        "rerank_tau": total(jnp.where(valid_block_x, tau_x, 0.0)),
        "rerank_accept": jnp.sum(accepted_xS.reshape(-1, accepted_xS.shape[-1]), axis=0),
        "hits": total(hit_xS),
        "agree_after": total(agree(choice_xS)),
        "agree_before": total(agree(before_xS)),
        "prefix_after": total(prefix(choice_xS)),
        "prefix_before": total(prefix(before_xS)),
        objective.FIGURE_OVERLAP: overlap_xS,  # the group's tau_prob is the reranked one
    }


def _reranked_heads(model: reranker_lib.RerankerDraft, frozen: FrozenTarget, chunk) -> dict:
    out = model.heads(frozen, chunk["h"], chunk["predecessors"])
    columns_K = vocab_columns(frozen)
    reranked = model.rerank(chunk["h"], out["logits"], chunk["predecessors"], columns_K)
    return out | {
        "teacher_sums": lambda p, labels, mask: rerank_sums(
            out["logits"], reranked, p, labels, mask, columns_K
        )
    }


def reranker_sums(
    model: reranker_lib.RerankerDraft, frozen: FrozenTarget, batch: Batch
) -> dict[str, jax.Array]:
    """The baseline sums of the batch's blocks plus the reranker's (`rerank_sums`)."""
    anchors_BxN = batch["anchors"]
    targets, h_BxNxSxH = block_states(model, frozen, batch, anchors_BxN, batch["block_keep"])
    return objective_sums(model, frozen, batch, anchors_BxN, targets, h_BxNxSxH, heads=_reranked_heads)


def reranker_metrics(sums: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """The baseline metrics with `tau_prob` and `accept_rate_i` of the reranked distribution (DSpark's as
    `pre_rerank_*`), plus the rerank metrics."""
    div = objective.safe_div
    base = objective.metrics_from_sums(sums)
    tau = div(sums["rerank_tau"], sums["blocks"])
    accept_S = div(sums["rerank_accept"], sums["accept_count"])
    return (
        base
        | {
            "loss": objective.loss_from_sums(sums, RERANK_LOSS),
            "tau_prob": tau,
            "pre_rerank_tau_prob": base["tau_prob"],
            "rerank_tau_gain": tau - base["tau_prob"],
            "rerank_target_agreement_gain": div(
                sums["agree_after"] - sums["agree_before"], sums["predictions"]
            ),
            "reranker/candidate_recall": div(sums["hits"], sums["predictions"]),
            "rerank_teacher_forced_prefix_gain": div(
                sums["prefix_after"] - sums["prefix_before"], sums["blocks"]
            ),
            "rank_loss": div(sums["rank"], sums["rank_weight"]),
        }
        | {f"pre_rerank_accept_rate_{i}": base[f"accept_rate_{i}"] for i in range(accept_S.shape[0])}
        | {f"accept_rate_{i}": accept_S[i] for i in range(accept_S.shape[0])}
    )


def reranked_select(draft: reranker_lib.RerankerDraft, frozen, h_BxSxH, state, rng, settings):
    """Markov selection with each slot's choice drawn from its reranked candidates (greedy: the best
    score; sampling: the softmax of the K scores, which the proposals carry for lossless acceptance)."""
    rescore = draft.online_rescorer(h_BxSxH.shape[0])
    return engine.markov_select(draft, frozen, h_BxSxH, state, rng, settings, rescore=rescore)


RERANKER_PROPOSER = engine.Proposer(engine.draft_hidden, reranked_select)


def reranker_only(params):
    """The frozen group's trainable mask: the reranker's parameters."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: getattr(path[0], "key", None) == "reranker", params
    )


REPORT_COLUMNS = (
    ("rerank_tau_gain", "rerank tau gain"),
    ("rerank_target_agreement_gain", "agreement gain"),
    ("reranker/candidate_recall", "candidate recall"),
    ("rerank_teacher_forced_prefix_gain", "prefix gain"),
)


RERANKER_RUN = Run(
    shape_keys=("draft.rerank_width", "draft.rerank_heads", "draft.rerank_ffn"),
    sharding_rules=(("rerank", None),),
    serving_gap="a reranking pass over each slot's top-k candidates conditioned on the drafted prefix, after "
    "the Markov correction (the engines choose each slot's token from the Markov-corrected logits alone)",
)


def _register(name: str, label: str, design: Design, **model) -> Experiment:
    """A reranker group; `model` adds to its `Model` (a frozen part, a warm start)."""
    return register(
        Experiment(
            name=name,
            model=Model(
                build_draft=reranker_lib.RerankerDraft,
                train_sums=reranker_sums,
                loss_terms=RERANK_LOSS,
                metrics=reranker_metrics,
                proposer=RERANKER_PROPOSER,
                config_class=reranker_lib.RerankerDraftConfig,
                **model,
            ),
            run=RERANKER_RUN,
            report=Report(label=label, design=design, suites=("seed",), report_columns=REPORT_COLUMNS),
        )
    )


_ADDS = "a prefix-conditioned reranker over the top-k candidates of each slot (W_o zero-initialised)"
RERANKER_JOINT = _register(
    "reranker_joint",
    "Prefix reranker joint",
    design=Design(
        initialisation="from scratch",
        updates="the draft and the reranker jointly",
        adds=_ADDS,
        question="the gain of prefix-conditioned reranking over an independently trained baseline",
    ),
)
RERANKER_FROZEN = _register(
    "reranker_frozen",
    "Prefix reranker frozen",
    trainable=reranker_only,
    init_from="baseline",
    design=Design(
        initialisation="the baseline's final checkpoint; a new optimizer and schedule",
        updates="the reranker only (backbone, Markov and confidence heads frozen)",
        adds=_ADDS,
        question="with the proposals fixed, how much the reranking module adds",
    ),
)
