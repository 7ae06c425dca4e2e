"""Does a trained prefix reranker change choices? Per teacher-forced prediction: how far the reranker moves
the candidates' scores (`max |delta|`, `delta = score - base logit`), the base logit gap between the first
and second candidate, and whether the reranked choice differs from the DSpark one.

A choice moves only where some delta spread exceeds the gap: `max |delta| < gap / 2` leaves every argmax in
place, whatever the deltas' signs, so a reranker whose deltas stay below the gaps only re-weights the
candidates' probabilities (its `rerank_tau_gain`) without changing a greedy choice. The deltas are linear in
the query `u = W_o SiLU(W_q [W_h h; r] + b_q)`: where no SiLU input is above 0 (`live_units` 0), `u` is near 0
whatever `W_o`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.draft import objective
from dspark_jax.draft.model import FrozenTarget, vocab_columns
from dspark_jax.groups.baseline import block_states
from dspark_jax.groups.registry import Batch
from dspark_jax.groups.reranker.model import RerankerDraft


def choice_margins(model: RerankerDraft, frozen: FrozenTarget, batch: Batch) -> dict[str, jax.Array]:
    """f32 `[B, N, S]` per prediction of the batch's blocks: `max_abs_delta`, `gap` (top-1 minus top-2 base
    logit among the candidates), `changed` (1 where the reranked choice is not the DSpark argmax),
    `live_units` (the share of the query's SiLU inputs above 0) and `eval_mask`; the vocabulary-sized work
    runs `anchor_chunk` blocks at a time."""
    targets, h_BxNxSxH = block_states(model, frozen, batch, batch["anchors"], batch["block_keep"])

    def margins(chunk):
        logits = model.heads(frozen, chunk["h"], chunk["predecessors"])["logits"].astype(jnp.float32)
        top_xK = jax.lax.top_k(logits, model.cfg.rerank_candidates)[0]
        reranked = model.rerank(chunk["h"], logits, chunk["predecessors"], vocab_columns(frozen))
        scores_xK = reranked.scores_xSxK.astype(jnp.float32)
        delta_xK = scores_xK - top_xK
        r_xW = model.reranker.prefix(model.markov.features(chunk["predecessors"]).astype(model.dtype))
        query_inputs_xW = model.reranker.query_inputs(chunk["h"].astype(model.dtype), r_xW)
        return {
            "live_units": jnp.mean((query_inputs_xW > 0).astype(jnp.float32), axis=-1),
            "max_abs_delta": jnp.max(jnp.abs(delta_xK), axis=-1),
            "gap": top_xK[..., 0] - top_xK[..., 1],
            "changed": (jnp.argmax(scores_xK, axis=-1) != 0).astype(jnp.float32),
        }

    inputs = {"h": h_BxNxSxH, "predecessors": targets.predecessors}
    stacked = objective.scan_anchor_chunks(margins, inputs, model.cfg.anchor_chunk)
    out = {k: objective.from_anchor_chunks(v, h_BxNxSxH.shape[1]) for k, v in stacked.items()}
    return out | {"eval_mask": targets.eval_mask.astype(jnp.float32)}


def w_o_norms(params) -> dict[str, float]:
    """The output projection of the reranker's queries (zero at initialisation): Frobenius and max |w|."""
    w = np.asarray(jax.device_get(params["reranker"]["w_o"]["kernel"].get_value()), np.float64)
    return {"w_o_frobenius": float(np.linalg.norm(w)), "w_o_max_abs": float(np.abs(w).max())}


def summarise(margins: dict[str, np.ndarray], quantiles: int = 5) -> dict:
    """The valid predictions' margins: the share whose choice changes, the share of blocks with a changed
    choice, the mean share of live query units and the share of predictions with none, and per gap quantile
    bin the predictions, their `max |delta|` (median, 90th percentile, max) and the share changed."""
    mask = margins["eval_mask"] > 0
    gap, delta, changed, live = (margins[k][mask] for k in ("gap", "max_abs_delta", "changed", "live_units"))
    blocks = mask[..., 0]
    changed_blocks = np.any((margins["changed"] > 0) & mask, axis=-1)[blocks]
    edges = np.quantile(gap, np.linspace(0, 1, quantiles + 1)) if gap.size else np.zeros(2)
    bins = []
    for i in range(len(edges) - 1):
        inside = (gap >= edges[i]) & ((gap < edges[i + 1]) if i < len(edges) - 2 else (gap <= edges[i + 1]))
        d = delta[inside]
        bins.append(
            {
                "gap_from": float(edges[i]),
                "gap_to": float(edges[i + 1]),
                "predictions": int(inside.sum()),
                "max_abs_delta_median": float(np.median(d)) if d.size else 0.0,
                "max_abs_delta_p90": float(np.quantile(d, 0.9)) if d.size else 0.0,
                "max_abs_delta_max": float(d.max()) if d.size else 0.0,
                "changed": float(changed[inside].mean()) if d.size else 0.0,
            }
        )
    return {
        "predictions": int(mask.sum()),
        "blocks": int(blocks.sum()),
        "changed_predictions": float(changed.mean()) if changed.size else 0.0,
        "changed_blocks": float(changed_blocks.mean()) if changed_blocks.size else 0.0,
        "delta_below_half_gap": float(np.mean(delta < gap / 2)) if gap.size else 0.0,
        "live_units": float(live.mean()) if live.size else 0.0,
        "no_live_unit": float(np.mean(live == 0)) if live.size else 0.0,
        "by_gap": bins,
    }
