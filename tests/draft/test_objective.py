"""The DSpark objective and offline metrics against an independent float64 numpy computation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.draft import objective

S = 7  # predictions per block


def _reference_np(logits, conf_logit, teacher_hidden, lm_head, labels, eval_mask, vocab=None):
    """docs/design.md section 1, dense float64 with explicit loops: (sums, metrics). With `vocab` (a draft
    vocabulary's ids) `logits` are over those ids only: `q` is 0 at every other id, and a label outside
    them has no CE term."""
    B, N = labels.shape[:2]
    logits, conf_logit = np.float64(logits), np.float64(conf_logit)
    teacher_logits = np.float64(teacher_hidden) @ np.float64(lm_head)
    vocab = np.arange(teacher_logits.shape[-1]) if vocab is None else np.asarray(vocab)
    keys = ("ce", "l1", "bce", "weight", "tau", "blocks", "conf_abs_err", "conf_bias", "conf_cumprod_bias")
    s = dict.fromkeys(keys, 0.0)
    accept, accept_count = np.zeros(S), np.zeros(S)
    for b in range(B):
        for n in range(N):
            prod, tau = 1.0, 1.0
            conf_prefix, accept_prefix = 1.0, 1.0  # cumprod_i(sigmoid(s_i) m_i), cumprod_i(a_i m_i)
            for i in range(S):
                p = np.exp(teacher_logits[b, n, i] - teacher_logits[b, n, i].max())
                p /= p.sum()
                q = np.zeros_like(p)
                q[vocab] = np.exp(logits[b, n, i] - logits[b, n, i].max())
                q /= q.sum()
                a = np.minimum(p, q).sum()
                m = float(eval_mask[b, n, i])
                prod *= a * m
                tau += prod
                sig = 1.0 / (1.0 + np.exp(-conf_logit[b, n, i]))
                conf_prefix *= sig * m
                accept_prefix *= a * m
                if m == 0:
                    continue
                w = np.exp(-i / 4.0)
                s["ce"] += w * -np.log(q[labels[b, n, i]]) if labels[b, n, i] in vocab else 0.0
                s["l1"] += w * np.abs(p - q).sum()
                s["bce"] += w * -(a * np.log(sig) + (1 - a) * np.log(1 - sig))
                s["weight"] += w
                s["conf_abs_err"] += w * abs(sig - a)
                s["conf_bias"] += w * (sig - a)
                s["conf_cumprod_bias"] += w * (conf_prefix - accept_prefix)
                accept[i] += a
                accept_count[i] += 1
            if eval_mask[b, n, 0] == 1:
                s["tau"] += tau
                s["blocks"] += 1
    preds = accept_count.sum()
    metrics = {
        "loss": (0.1 * s["ce"] + 0.9 * s["l1"] + s["bce"]) / s["weight"] if s["weight"] else 0.0,
        "tau_prob": s["tau"] / s["blocks"] if s["blocks"] else 0.0,
        **{
            f"confidence_{metric}": s[key] / s["weight"] if s["weight"] else 0.0
            for metric, key in (
                ("abs_error", "conf_abs_err"),
                ("bias", "conf_bias"),
                ("cumprod_bias", "conf_cumprod_bias"),
            )
        },
        "valid_blocks": s["blocks"],
        "valid_predictions": preds,
        **{f"accept_rate_{i}": accept[i] / accept_count[i] if accept_count[i] else 0.0 for i in range(S)},
    }
    return s | {"accept": accept, "accept_count": accept_count, "predictions": preds}, metrics


def _mask_from_lengths(lengths_BxN):
    """Cumulative eval mask: the first `length` predictions of each block are valid."""
    return (np.arange(S) < np.asarray(lengths_BxN)[..., None]).astype(np.float32)


def _random_problem(seed, B=2, N=5, H=16, V=40):
    rng = np.random.default_rng(seed)
    return {
        "logits": rng.normal(0, 2.0, (B, N, S, V)).astype(np.float32),
        "conf": rng.normal(0, 1.5, (B, N, S)).astype(np.float32),
        "teacher_hidden": rng.normal(0, 1.0, (B, N, S, H)).astype(np.float32),
        "lm_head": rng.normal(0, 0.5, (H, V)).astype(np.float32),
        "labels": rng.integers(0, V, (B, N, S)).astype(np.int32),
    }


def _passthrough(x):
    return {"logits": x["logits"], "confidence_logit": x["conf"]}


def _sums_of(prob, eval_mask, chunk, vocab=None):
    inputs = {"logits": prob["logits"], "conf": prob["conf"]}
    return objective.block_objective_sums(
        _passthrough,
        inputs,
        prob["teacher_hidden"],
        prob["lm_head"],
        prob["labels"],
        eval_mask,
        anchor_chunk=chunk,
        vocab_ids_K=None if vocab is None else jnp.asarray(vocab, jnp.int32),
    )


# Full blocks, short blocks (1..6 valid), padded blocks (0), in both samples.
LENGTHS = [[7, 3, 0, 1, 6], [0, 7, 7, 2, 0]]


@pytest.mark.parametrize("lengths", [LENGTHS, [[0] * 5, [0] * 5]], ids=["mixed", "all_invalid"])
def test_sums_and_metrics_match_float64_reference(lengths):
    prob = _random_problem(0)
    eval_mask = _mask_from_lengths(lengths)
    sums = _sums_of(prob, eval_mask, chunk=2)
    ref_sums, ref_metrics = _reference_np(
        prob["logits"], prob["conf"], prob["teacher_hidden"], prob["lm_head"], prob["labels"], eval_mask
    )
    for name, value in ref_sums.items():
        np.testing.assert_allclose(sums[name], value, rtol=2e-5, atol=1e-5, err_msg=name)
    metrics = objective.metrics_from_sums(sums)
    for name, value in ref_metrics.items():
        np.testing.assert_allclose(metrics[name], value, rtol=2e-5, atol=1e-5, err_msg=name)
    assert all(np.isfinite(v) for v in metrics.values())
    np.testing.assert_allclose(objective.loss_from_sums(sums), ref_metrics["loss"], rtol=2e-5, atol=1e-6)
    w = objective.position_weights(jnp.asarray(eval_mask))
    np.testing.assert_allclose(w.sum(), ref_sums["weight"], rtol=1e-6)


def test_a_draft_vocabulary_sums_equal_the_reference_with_q_zero_outside_it():
    """Draft logits over 24 of the 40 ids (`train.draft_vocab`): the sums are those of `q` = 0 at the other
    16 ids against the whole-vocabulary teacher (L1 and overlap over all 40 ids in the reference), the
    labels outside the 24 adding no CE; the recorded greedy choice is the vocabulary's id, not its column."""
    prob = _random_problem(3)
    V = prob["lm_head"].shape[1]
    vocab = np.sort(np.random.default_rng(3).choice(V, 24, replace=False))
    prob["logits"] = prob["logits"][..., vocab]
    eval_mask = _mask_from_lengths(LENGTHS)
    assert 0 < np.isin(prob["labels"], vocab).mean() < 1  # labels inside and outside
    with objective.recording_blocks() as records:
        sums = _sums_of(prob, eval_mask, chunk=2, vocab=vocab)
    ref_sums, ref_metrics = _reference_np(
        prob["logits"],
        prob["conf"],
        prob["teacher_hidden"],
        prob["lm_head"],
        prob["labels"],
        eval_mask,
        vocab,
    )
    for name, value in ref_sums.items():
        np.testing.assert_allclose(sums[name], value, rtol=2e-5, atol=1e-5, err_msg=name)
    metrics = objective.metrics_from_sums(sums)
    for name, value in ref_metrics.items():
        np.testing.assert_allclose(metrics[name], value, rtol=2e-5, atol=1e-5, err_msg=name)
    teacher = np.float64(prob["teacher_hidden"]) @ np.float64(prob["lm_head"])
    greedy = vocab[prob["logits"].argmax(-1)] == teacher.argmax(-1)
    assert greedy.any()
    np.testing.assert_array_equal(records[0]["greedy_accept"], greedy)


def test_recorded_blocks_equal_a_numpy_computation_and_leave_the_sums_unchanged():
    """`recording_blocks` (what STS calibration reads): per block and position, the confidence logit, greedy
    acceptance (draft argmax = teacher argmax), overlap and mask, in anchor order, from a chunked scan."""
    prob = _random_problem(2, N=5)
    eval_mask = _mask_from_lengths(LENGTHS)
    plain = _sums_of(prob, eval_mask, chunk=2)
    with objective.recording_blocks() as records:
        recorded_sums = _sums_of(prob, eval_mask, chunk=2)
    assert len(records) == 1
    for name in plain:
        np.testing.assert_array_equal(recorded_sums[name], plain[name], err_msg=name)
    teacher = np.float64(prob["teacher_hidden"]) @ np.float64(prob["lm_head"])
    p = np.exp(teacher - teacher.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    q = np.exp(np.float64(prob["logits"]) - prob["logits"].max(-1, keepdims=True))
    q /= q.sum(-1, keepdims=True)
    want = {
        "confidence_logit": prob["conf"],
        "greedy_accept": prob["logits"].argmax(-1) == teacher.argmax(-1),
        "overlap": np.minimum(p, q).sum(-1),
        "eval_mask": eval_mask,
        "figure_overlap": np.minimum(p, q).sum(-1),  # a head without its own figure: the overlap
    }
    assert set(records[0]) == set(want)
    for name, value in want.items():
        assert records[0][name].shape == value.shape, name
        np.testing.assert_allclose(records[0][name], value, rtol=2e-5, atol=1e-6, err_msg=name)


def test_chunking_invariance():
    prob = _random_problem(1, N=7)
    eval_mask = _mask_from_lengths([[7, 3, 0, 1, 6, 7, 2], [0, 7, 7, 2, 0, 5, 4]])
    sums = [_sums_of(prob, eval_mask, chunk) for chunk in (1, 3, 7, 100)]
    for other in sums[1:]:
        for name in sums[0]:
            np.testing.assert_allclose(other[name], sums[0][name], rtol=1e-5, atol=1e-6, err_msg=name)


def _toy_params(seed, H, V, R=8):
    rng = np.random.default_rng(seed)
    return {
        "w1": jnp.asarray(rng.normal(0, 1.0, (V, R)), jnp.float32),
        "w2": jnp.asarray(rng.normal(0, 0.3, (R, V)), jnp.float32),
        "wc": jnp.asarray(rng.normal(0, 0.3, (H + R,)), jnp.float32),
        "bc": jnp.asarray(0.1, jnp.float32),
    }


def _toy_head(params, lm_head):
    """logits = h @ lm_head + W2 W1[pred]; confidence = wc . [h; m] + bc; extra sum of masked |m|^2."""

    def head_fn(x):
        h, m = x["h"], params["w1"][x["pred"]]
        return {
            "logits": h @ lm_head + m @ params["w2"],
            "confidence_logit": jnp.concatenate([h, m], axis=-1) @ params["wc"] + params["bc"],
            "extra_sums": {"markov_sq": jnp.sum(x["mask"][..., None] * m**2)},
        }

    return head_fn


def _dense_loss(params, h, pred, teacher_hidden, lm_head, labels, eval_mask):
    """The whole loss written densely in jnp (no chunking, no scan)."""
    m = params["w1"][pred]
    logits = h @ lm_head + m @ params["w2"]
    s = jnp.concatenate([h, m], axis=-1) @ params["wc"] + params["bc"]
    p = jax.nn.softmax(teacher_hidden @ lm_head, axis=-1)
    log_q = jax.nn.log_softmax(logits, axis=-1)
    q = jnp.exp(log_q)
    a = jax.lax.stop_gradient(jnp.minimum(p, q).sum(-1))
    ce = -jnp.take_along_axis(log_q, labels[..., None], axis=-1)[..., 0]
    bce = -(a * jax.nn.log_sigmoid(s) + (1 - a) * jax.nn.log_sigmoid(-s))
    term = 0.1 * ce + 0.9 * jnp.abs(p - q).sum(-1) + bce
    w = jnp.exp(-jnp.arange(S) / 4.0) * eval_mask
    return jnp.sum(w * term) / jnp.sum(w)


def _toy_problem(seed, B=2, N=5, H=16, V=40):
    prob = _random_problem(seed, B, N, H, V)
    rng = np.random.default_rng(seed + 100)
    prob["h"] = rng.normal(0, 1.0, (B, N, S, H)).astype(np.float32)
    prob["pred"] = rng.integers(0, V, (B, N, S)).astype(np.int32)
    return prob, _toy_params(seed, H, V)


def _chunked_loss(params, h, prob, eval_mask, chunk):
    inputs = {"h": h, "pred": prob["pred"], "mask": eval_mask}
    sums = objective.block_objective_sums(
        _toy_head(params, prob["lm_head"]),
        inputs,
        prob["teacher_hidden"],
        prob["lm_head"],
        prob["labels"],
        eval_mask,
        anchor_chunk=chunk,
    )
    return objective.loss_from_sums(sums), sums


def test_gradients_match_dense_loss():
    prob, params = _toy_problem(2)
    eval_mask = _mask_from_lengths(LENGTHS)
    dense_args = (prob["pred"], prob["teacher_hidden"], prob["lm_head"], prob["labels"], eval_mask)
    dense_value, dense_grads = jax.value_and_grad(_dense_loss, argnums=(0, 1))(params, prob["h"], *dense_args)
    grad_fn = jax.jit(
        jax.value_and_grad(lambda pr, h: _chunked_loss(pr, h, prob, eval_mask, chunk=2)[0], argnums=(0, 1))
    )
    value, grads = grad_fn(params, prob["h"])
    np.testing.assert_allclose(value, dense_value, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(dense_grads)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    assert float(jnp.abs(grads[0]["w2"]).sum()) > 0
    _, sums = _chunked_loss(params, prob["h"], prob, eval_mask, chunk=2)
    m = np.asarray(params["w1"])[prob["pred"]]
    np.testing.assert_allclose(sums["markov_sq"], np.sum(eval_mask[..., None] * m**2), rtol=1e-5)


def test_micro_batches_normalised_once_equal_whole_batch():
    """Numerator gradients and sums of micro-batches, added and divided once, equal the whole batch's."""
    prob, params = _toy_problem(3, B=4)
    eval_mask = _mask_from_lengths([*LENGTHS, [1, 1, 7, 0, 0], [7, 7, 7, 7, 7]])

    @jax.jit
    def numerator_grads(params, batch, mask):
        def numerator(pr):
            _, sums = _chunked_loss(pr, batch["h"], batch, mask, chunk=3)
            return objective.loss_numerators(sums)[0], sums

        return jax.grad(numerator, has_aux=True)(params)

    def micro(part):
        batch = {k: v if k == "lm_head" else v[part] for k, v in prob.items()}
        return numerator_grads(params, batch, eval_mask[part])

    whole_grads, whole_sums = micro(slice(0, 4))
    grads_a, sums_a = micro(slice(0, 2))
    grads_b, sums_b = micro(slice(2, 4))
    combined = jax.tree.map(jnp.add, sums_a, sums_b)
    np.testing.assert_allclose(
        objective.loss_from_sums(combined), objective.loss_from_sums(whole_sums), rtol=1e-6
    )
    combined_metrics = objective.metrics_from_sums(combined)
    for name, value in objective.metrics_from_sums(whole_sums).items():
        np.testing.assert_allclose(combined_metrics[name], value, rtol=1e-5, err_msg=name)
    denominator = objective.loss_denominators(combined)[0]
    direct = jax.grad(lambda pr: _chunked_loss(pr, prob["h"], prob, eval_mask, chunk=3)[0])(params)
    for a, b, whole, want in zip(*map(jax.tree.leaves, (grads_a, grads_b, whole_grads, direct))):
        np.testing.assert_allclose(a + b, whole, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose((a + b) / denominator, want, rtol=1e-4, atol=1e-7)


def test_loss_groups_each_divide_by_their_own_denominator():
    sums = {"x": jnp.float32(6.0), "y": jnp.float32(1.0), "dx": jnp.float32(3.0), "dy": jnp.float32(0.0)}
    terms = {"dx": {"x": 0.5}, "dy": {"y": 2.0}}
    np.testing.assert_allclose(objective.loss_numerators(sums, terms), [3.0, 2.0])
    np.testing.assert_allclose(objective.loss_denominators(sums, terms), [3.0, 0.0])
    np.testing.assert_allclose(objective.loss_from_sums(sums, terms), 1.0)  # empty group counts 0


def test_bce_target_is_stop_gradient():
    prob = _random_problem(4)
    eval_mask = _mask_from_lengths(LENGTHS)

    def term(name):
        def f(logits, conf):
            return _sums_of(prob | {"logits": logits, "conf": conf}, eval_mask, chunk=2)[name]

        return jax.grad(f, argnums=(0, 1))(jnp.asarray(prob["logits"]), jnp.asarray(prob["conf"]))

    bce_d_logits, bce_d_conf = term("bce")
    assert float(jnp.abs(bce_d_logits).max()) == 0.0
    # d/ds [softplus(s) - a s] = sigmoid(s) - a, weighted by w_i, with the overlap a held constant.
    teacher = jax.nn.softmax(prob["teacher_hidden"] @ prob["lm_head"], axis=-1)
    overlap = jnp.minimum(teacher, jax.nn.softmax(prob["logits"], axis=-1)).sum(-1)
    want = objective.position_weights(eval_mask) * (jax.nn.sigmoid(prob["conf"]) - overlap)
    np.testing.assert_allclose(bce_d_conf, want, rtol=1e-5, atol=1e-6)
    l1_d_logits, l1_d_conf = term("l1")
    assert float(jnp.abs(l1_d_logits).max()) > 0 and float(jnp.abs(l1_d_conf).max()) == 0.0


def test_chunked_memory_stays_far_below_dense():
    """Backward-pass temp memory grows with the chunk, not with N, at the paper's vocabulary size.

    lm_head is f32 here: XLA:CPU has no bf16 dot and would add a constant f32 copy of a bf16 lm_head.
    """
    B, N, H, V, R = 1, 64, 256, 151_669, 16
    spec = jax.ShapeDtypeStruct
    params = {
        "w1": spec((V, R), jnp.float32),
        "w2": spec((R, V), jnp.float32),
        "wc": spec((H + R,), jnp.float32),
        "bc": spec((), jnp.float32),
    }
    args = (
        spec((B, N, S, H), jnp.bfloat16),  # h
        spec((B, N, S), jnp.int32),  # pred
        spec((B, N, S, H), jnp.bfloat16),  # teacher hidden
        spec((H, V), jnp.float32),  # lm_head
        spec((B, N, S), jnp.int32),  # labels
        spec((B, N, S), jnp.float32),  # eval mask
    )

    def temp_bytes(chunk):
        def loss(params, h, pred, teacher_hidden, lm_head, labels, eval_mask):
            prob = {"pred": pred, "teacher_hidden": teacher_hidden, "lm_head": lm_head, "labels": labels}
            return _chunked_loss(params, h, prob, eval_mask, chunk)[0]

        compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(params, *args).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    chunk = 8
    chunk_tensor = B * chunk * S * V * 4  # one f32 [B, C, S, V] tensor: 34 MB (dense [B, N, S, V]: 272 MB)
    chunked, dense = temp_bytes(chunk), temp_bytes(N)
    assert chunked < 6 * chunk_tensor, (chunked, chunk_tensor)
    assert dense > 6 * chunked, (chunked, dense)
