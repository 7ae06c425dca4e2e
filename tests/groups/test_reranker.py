"""The prefix reranker (joint group, offline): DSpark's choice at initialisation (ties included), the
reranked tau as a top-K truncation, and every rerank metric and the rank loss against NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.draft import blocks
from dspark_jax.draft.model import FrozenTarget
from dspark_jax.groups import baseline
from dspark_jax.groups.reranker import diagnosis
from dspark_jax.groups.reranker import group as reranker_group
from dspark_jax.groups.reranker.model import RerankerDraft, RerankerDraftConfig
from tests.draft.test_reference import CFG, S, _batch, _randomize

H, V = CFG.hidden_size, CFG.vocab_size


def _cfg(k=16, width=16):
    return RerankerDraftConfig(
        **CFG.__dict__, rerank_candidates=k, rerank_width=width, rerank_heads=4, rerank_ffn=4 * width
    )


def _frozen(rng):
    emb, lm_head = rng.normal(size=(V, H)), 0.5 * rng.normal(size=(H, V))
    return FrozenTarget(jnp.asarray(emb, jnp.float32), jnp.asarray(lm_head, jnp.float32))


def _jbatch(batch):
    return {k: jnp.asarray(v) for k, v in batch.items()}


def _layer_norm(x, scale, bias, eps=1e-5):
    c = x - x.mean(-1, keepdims=True)
    return c / np.sqrt((c * c).mean(-1, keepdims=True) + eps) * scale + bias


def _silu(x):
    return x / (1 + np.exp(-x))


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _numpy_rerank(p, h_SxH, logits_SxV, predecessors_S, k):
    """Candidates and scores of one block, float64, written from the seed's formulas."""
    g = lambda name: p[f"reranker/{name}"]
    cand = np.argsort(-logits_SxV, axis=-1, kind="stable")[:, :k]
    x = p["markov/w1"][predecessors_S] @ g("in_proj/kernel") + g("positions")[:S]
    hn = _layer_norm(x, g("attn_norm/scale"), g("attn_norm/bias"))
    q = np.einsum("sw,whd->shd", hn, g("attn/q/kernel"))
    kk = np.einsum("sw,whd->shd", hn, g("attn/k/kernel"))
    v = np.einsum("sw,whd->shd", hn, g("attn/v/kernel"))
    att = np.einsum("shd,thd->hst", q, kk) / np.sqrt(q.shape[-1])
    att = np.where(np.tril(np.ones((S, S), bool)), att, -np.inf)
    o = np.einsum("hst,thd->shd", _softmax(att), v)
    x = x + np.einsum("shd,hdw->sw", o, g("attn/o/kernel"))
    f = _layer_norm(x, g("ffn_norm/scale"), g("ffn_norm/bias"))
    x = x + _silu(f @ g("ffn_in/kernel")) @ g("ffn_out/kernel")
    r = _layer_norm(x, g("out_norm/scale"), g("out_norm/bias"))
    query_inputs = np.concatenate([h_SxH @ g("w_h/kernel"), r], -1) @ g("w_q/kernel") + g("w_q/bias")
    u = _silu(query_inputs) @ g("w_o/kernel")
    keys = np.einsum("skr,rw->skw", p["markov/w2"].T[cand], g("w_c/kernel"))
    scores = np.take_along_axis(logits_SxV, cand, -1) + np.einsum("sw,skw->sk", u, keys) / np.sqrt(
        u.shape[-1]
    )
    return cand, scores, query_inputs


def _setup(seed, k, randomize=True):
    rng = np.random.default_rng(seed)
    model = RerankerDraft(_cfg(k), rngs=nnx.Rngs(seed))
    params = _randomize(model, rng) if randomize else None
    frozen = _frozen(rng)
    batch = _batch(rng)
    jb = _jbatch(batch)
    targets, h = baseline.block_states(model, frozen, jb, jb["anchors"], jb["block_keep"])
    logits = model.heads(frozen, h, targets.predecessors)["logits"]
    teacher = blocks.teacher_hidden(jb["last_hidden"], jb["anchors"], S)
    p = np.asarray(
        _softmax(
            np.einsum(
                "bnsh,hv->bnsv", np.asarray(teacher, np.float64), np.asarray(frozen.lm_head_HxV, np.float64)
            )
        )
    )
    return model, params, frozen, jb, targets, h, logits, p


def test_at_initialisation_the_reranked_choice_is_dspark_s_including_ties():
    model, _, _, _, targets, h, logits, _ = _setup(0, 16, randomize=False)
    tied = np.asarray(logits).copy()
    top = tied.max(-1, keepdims=True)
    rng = np.random.default_rng(1)
    for _ in range(20):  # exact ties with the maximum, at later and earlier vocabulary ids
        b, n, s = rng.integers(0, tied.shape[0]), rng.integers(0, tied.shape[1]), rng.integers(0, S)
        tied[b, n, s, rng.integers(0, V, 3)] = top[b, n, s, 0]
    for case in (np.asarray(logits), tied):
        out = model.rerank(h, jnp.asarray(case), targets.predecessors)
        choice = np.take_along_axis(
            np.asarray(out.candidates_xSxK), np.asarray(jnp.argmax(out.scores_xSxK, -1))[..., None], -1
        )[..., 0]
        np.testing.assert_array_equal(choice, np.argmax(case, -1))
        np.testing.assert_array_equal(np.asarray(out.scores_xSxK), -np.sort(-case, -1)[..., :16])


def test_at_initialisation_reranked_tau_is_the_top_k_truncation():
    model, _, frozen, jb, targets, _, logits, p = _setup(0, 16, randomize=False)
    metrics = reranker_group.reranker_metrics(reranker_group.reranker_sums(model, frozen, jb))
    lg = np.asarray(logits, np.float64)
    cand = np.argsort(-lg, -1, kind="stable")[..., :16]
    q_top = _softmax(np.take_along_axis(lg, cand, -1))
    q_full = _softmax(lg)
    mask = np.asarray(targets.eval_mask, np.float64)

    def tau(overlap):
        acc = overlap * mask
        valid = mask[..., 0] > 0
        return np.sum((1 + np.cumprod(acc, -1).sum(-1))[valid]) / valid.sum()

    want_top = tau(np.minimum(np.take_along_axis(p, cand, -1), q_top).sum(-1))
    want_full = tau(np.minimum(p, q_full).sum(-1))
    np.testing.assert_allclose(float(metrics["tau_prob"]), want_top, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["pre_rerank_tau_prob"]), want_full, rtol=1e-5)
    assert (
        float(metrics["rerank_target_agreement_gain"]) == 0
        and float(metrics["rerank_teacher_forced_prefix_gain"]) == 0
    )


def test_rerank_metrics_and_rank_loss_match_numpy():
    """Trained-like (random) weights, K = 2 so some predictions and one whole block miss `v*`."""
    k = 2
    model, params, frozen, jb, targets, h, logits, p = _setup(3, k)
    sums = reranker_group.reranker_sums(model, frozen, jb)
    metrics = reranker_group.reranker_metrics(sums)
    labels, mask = np.asarray(targets.labels), np.asarray(targets.eval_mask, np.float64)
    preds = np.asarray(targets.predecessors)
    lg, hh = np.asarray(logits, np.float64), np.asarray(h, np.float64)
    w = np.exp(-np.arange(S) / 4)
    rank_num = rank_den = hits = agree_gain = prefix_gain = tau_sum = 0.0
    blocks_valid = blocks_no_hit = 0
    for b in range(lg.shape[0]):
        for n in range(lg.shape[1]):
            cand, scores, _ = _numpy_rerank(params, hh[b, n], lg[b, n], preds[b, n], k)
            np.testing.assert_allclose(
                np.asarray(model.rerank(h[b, n], logits[b, n], targets.predecessors[b, n]).scores_xSxK),
                scores,
                rtol=2e-4,
                atol=2e-4,
            )
            m = mask[b, n]
            v_star = p[b, n].argmax(-1)
            q = _softmax(scores)
            after = cand[np.arange(S), scores.argmax(-1)]
            before = lg[b, n].argmax(-1)
            block_hits = 0
            for i in range(S):
                if m[i] == 0:
                    continue
                hit = v_star[i] in cand[i]
                block_hits += hit
                hits += hit
                if hit:
                    j = list(cand[i]).index(v_star[i])
                    rank_num += w[i] * -np.log(q[i, j])
                    rank_den += w[i]
                agree_gain += int(after[i] == v_star[i]) - int(before[i] == v_star[i])
            if m[0] > 0:
                blocks_valid += 1
                blocks_no_hit += block_hits == 0
                overlap = np.minimum(p[b, n][np.arange(S)[:, None], cand], q).sum(-1) * m
                tau_sum += 1 + np.cumprod(overlap).sum()
                ok = lambda c, ref=labels[b, n], m=m: (c == ref) & (m > 0)
                prefix_gain += np.cumprod(ok(after)).sum() - np.cumprod(ok(before)).sum()
    predictions = mask.sum()
    assert blocks_no_hit >= 1 and 0 < hits < predictions
    np.testing.assert_allclose(float(metrics["rank_loss"]), rank_num / rank_den, rtol=1e-4)
    np.testing.assert_allclose(float(sums["rank_weight"]), rank_den, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["reranker/candidate_recall"]), hits / predictions, rtol=1e-6)
    np.testing.assert_allclose(
        float(metrics["rerank_target_agreement_gain"]), agree_gain / predictions, atol=1e-6
    )
    np.testing.assert_allclose(
        float(metrics["rerank_teacher_forced_prefix_gain"]), prefix_gain / blocks_valid, atol=1e-6
    )
    np.testing.assert_allclose(float(metrics["tau_prob"]), tau_sum / blocks_valid, rtol=1e-4)
    np.testing.assert_allclose(
        float(metrics["rerank_tau_gain"]),
        tau_sum / blocks_valid - float(metrics["pre_rerank_tau_prob"]),
        rtol=1e-4,
    )
    base_loss = float(reranker_group.objective.loss_from_sums(sums))
    np.testing.assert_allclose(float(metrics["loss"]), base_loss + rank_num / rank_den, rtol=1e-4)


def test_no_hit_anywhere_gives_a_zero_rank_loss():
    model, _, frozen, jb, *_ = _setup(0, 1, randomize=False)
    sums = reranker_group.reranker_sums(model, frozen, {**jb, "block_keep": jnp.zeros_like(jb["block_keep"])})
    assert float(sums["rank_weight"]) == 0 and float(reranker_group.reranker_metrics(sums)["rank_loss"]) == 0


def test_over_a_draft_vocabulary_it_reranks_as_the_whole_vocabulary_with_the_rest_excluded():
    """Logits over a draft vocabulary's ids (`train.draft_vocab`) give the candidates (as vocabulary ids),
    scores and rerank sums of the whole vocabulary's logits with every other id at -1e30; so does the draft
    cut to that vocabulary (`on_columns`, what the chunked loss runs: its `W2` holds those columns only)."""
    model, _, _, _, targets, h, logits, _ = _setup(5, 8)
    vocab = np.sort(np.random.default_rng(5).choice(V, V // 2, replace=False))
    masked = np.full(logits.shape, -1e30, np.float32)
    masked[..., vocab] = np.asarray(logits)[..., vocab]
    restricted = jnp.asarray(np.asarray(logits)[..., vocab])
    whole = model.rerank(h, jnp.asarray(masked), targets.predecessors)
    part = model.rerank(h, restricted, targets.predecessors, jnp.asarray(vocab))
    np.testing.assert_array_equal(part.candidates_xSxK, whole.candidates_xSxK)
    np.testing.assert_allclose(part.scores_xSxK, whole.scores_xSxK, rtol=1e-6)
    cut = model.on_columns(jnp.asarray(vocab)).rerank(h, restricted, targets.predecessors, jnp.asarray(vocab))
    np.testing.assert_allclose(cut.scores_xSxK, part.scores_xSxK, rtol=1e-6)
    # A teacher that agrees with the draft's greedy choice: the agreement sums count ids, not columns.
    teacher = jax.nn.softmax(jnp.asarray(masked), axis=-1)
    args = teacher, targets.labels, targets.eval_mask.astype(jnp.float32)
    want = reranker_group.rerank_sums(jnp.asarray(masked), whole, *args)
    got = reranker_group.rerank_sums(restricted, part, *args, jnp.asarray(vocab))
    assert want["agree_before"] == jnp.sum(targets.eval_mask > 0) > 0
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-6, err_msg=name)


@pytest.mark.parametrize("bad", [{"rerank_candidates": 0}, {"rerank_width": 30}])
def test_bad_reranker_shapes_are_refused(bad):
    with pytest.raises(ValueError, match="rerank_"):
        RerankerDraftConfig(**{**_cfg().__dict__, **bad})


def test_online_prefix_steps_equal_the_teacher_forced_block():
    """The engine's per-slot rescorer (prefix keys/values growing one position at a time) gives the same
    candidates and scores as the training path's causal pass over the whole block."""
    model, _, _, _, targets, h, logits, _ = _setup(4, 16)
    offline = model.rerank(h, logits, targets.predecessors)
    b, n = h.shape[:2]
    flat = lambda x: x.reshape(b * n, *x.shape[2:])
    rescore = model.online_rescorer(b * n)
    for i in range(S):
        scores, candidates = rescore(
            i, flat(h)[:, i], flat(targets.predecessors)[:, i], flat(logits)[:, i], None
        )
        np.testing.assert_array_equal(candidates, flat(offline.candidates_xSxK)[:, i])
        np.testing.assert_allclose(scores, flat(offline.scores_xSxK)[:, i], rtol=1e-5, atol=1e-5)


def test_choice_margins_match_numpy_and_a_zero_output_projection_changes_nothing():
    """The diagnosis per prediction against the NumPy reranker (random weights: deltas that do move some
    choices); with W_o zero, as initialised, every delta is 0 and no choice changes."""
    k = 4
    model, params, frozen, jb, targets, h, logits, _ = _setup(3, k)
    got = {key: np.asarray(x) for key, x in diagnosis.choice_margins(model, frozen, jb).items()}
    lg, hh, preds = (
        np.asarray(logits, np.float64),
        np.asarray(h, np.float64),
        np.asarray(targets.predecessors),
    )
    for b, n in np.ndindex(lg.shape[:2]):
        cand, scores, query_inputs = _numpy_rerank(params, hh[b, n], lg[b, n], preds[b, n], k)
        top = np.take_along_axis(lg[b, n], cand, -1)
        np.testing.assert_allclose(
            got["live_units"][b, n], (query_inputs > 0).mean(-1), atol=1.5 / model.cfg.rerank_width
        )  # one unit near 0 may flip
        np.testing.assert_allclose(
            got["max_abs_delta"][b, n], np.abs(scores - top).max(-1), rtol=1e-3, atol=1e-4
        )
        np.testing.assert_allclose(got["gap"][b, n], top[:, 0] - top[:, 1], rtol=1e-4, atol=1e-5)
        np.testing.assert_array_equal(got["changed"][b, n], scores.argmax(-1) != 0)
    summary = diagnosis.summarise(got)
    assert 0 < summary["changed_predictions"] < 1 and summary["predictions"] == int(got["eval_mask"].sum())
    assert 0 < summary["live_units"] < 1
    assert sum(b["predictions"] for b in summary["by_gap"]) == summary["predictions"]

    state = nnx.state(model, nnx.Param)
    state["reranker"]["w_o"]["kernel"].set_value(
        jnp.zeros_like(state["reranker"]["w_o"]["kernel"].get_value())
    )
    nnx.update(model, state)
    zero = diagnosis.choice_margins(model, frozen, jb)
    assert float(jnp.max(zero["max_abs_delta"])) == 0.0 and float(jnp.max(zero["changed"])) == 0.0
    assert diagnosis.w_o_norms(nnx.state(model, nnx.Param)) == {"w_o_frobenius": 0.0, "w_o_max_abs": 0.0}


def test_summarise_counts_changes_per_gap_bin():
    """Four predictions in two blocks, gaps 0.1 .. 0.4, the smallest-gap one changed: one bin per quantile."""
    margins = {
        "eval_mask": np.array([[[1.0, 1.0], [1.0, 1.0]]]),
        "gap": np.array([[[0.1, 0.2], [0.3, 0.4]]]),
        "max_abs_delta": np.array([[[0.3, 0.01], [0.02, 0.03]]]),
        "changed": np.array([[[1.0, 0.0], [0.0, 0.0]]]),
        "live_units": np.array([[[0.5, 0.0], [0.25, 0.0]]]),
    }
    summary = diagnosis.summarise(margins, quantiles=2)
    assert summary["changed_predictions"] == 0.25 and summary["changed_blocks"] == 0.5
    assert summary["delta_below_half_gap"] == 0.75
    assert summary["live_units"] == 0.1875 and summary["no_live_unit"] == 0.5
    assert [b["predictions"] for b in summary["by_gap"]] == [2, 2]
    assert [b["changed"] for b in summary["by_gap"]] == [0.5, 0.0]
