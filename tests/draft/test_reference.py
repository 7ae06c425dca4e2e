"""The whole baseline draft training computation against a float64 NumPy re-implementation.

The reference below is written from docs/design.md section 1 alone (dense visibility mask over
`[context; all block slots]`, explicit loops, no chunking, its own RoPE frequencies and its
own label / predecessor / eval-mask indexing, and the confidence metrics as DeepSpec logs them);
only the parameter values come from the model.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.draft.model import DraftConfig, DSparkDraft, FrozenTarget
from dspark_jax.draft.objective import metrics_from_sums
from dspark_jax.groups.baseline import draft_sums

H, V, A, T, N, S = 32, 40, 3, 20, 4, 7
CFG = DraftConfig(
    hidden_size=H,
    vocab_size=V,
    num_aux=A,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    intermediate_size=48,
    markov_rank=8,
    anchor_chunk=2,
)
EPS = CFG.rms_norm_eps


def _rms(x, scale):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS) * scale


def _rope(x_NSxQxD, pos_NS):
    d = x_NSxQxD.shape[-1]
    ang = pos_NS[:, None].astype(np.float64) * (CFG.rope_theta ** (-np.arange(0, d, 2) / d))
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
    x1, x2 = x_NSxQxD[..., : d // 2], x_NSxQxD[..., d // 2 :]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _softplus(z):
    return np.logaddexp(0.0, z)


def _forward(p, emb, mask_vec, batch, anchors, memory=None, context=True):
    """Final draft states `h [B, N, S, H]`, float64, one sample at a time, dense visibility masks.

    `memory`: None, or per-block `(states [B, N, M, H] (adapted), positions [B, N, M], valid [B, N, M])`,
    keys/values visible to their own block only. `context=False`: no block sees a context position.
    """
    ids = np.asarray(batch["input_ids"])
    aux = np.asarray(batch["aux_hidden"], np.float64)
    emb, mask_vec = np.asarray(emb, np.float64), np.asarray(mask_vec, np.float64)
    positions = np.asarray(batch["positions"])
    b_rows, t = ids.shape
    n_blocks = anchors.shape[1]
    heads_per_kv = CFG.num_heads // CFG.num_kv_heads
    out_h = []
    for b in range(b_rows):
        c = _rms(aux[b].reshape(t, -1) @ p["aux_proj/kernel"], p["aux_norm/scale"])
        a_n = anchors[b]
        start_n = a_n - positions[b, a_n]  # first index of each block's own sample
        x = np.stack(
            [np.concatenate([emb[ids[b, a]][None], np.repeat(mask_vec[None], S - 1, 0)]) for a in a_n]
        )
        x = x.reshape(n_blocks * S, -1)
        slot_pos = (a_n[:, None] - start_n[:, None] + np.arange(S)).reshape(-1)
        blk = np.repeat(np.arange(n_blocks), S)
        j = np.arange(t)[None, :]
        own_context = (j < a_n[blk][:, None]) & (j >= start_n[blk][:, None]) & context
        visible = np.concatenate([own_context, blk[:, None] == blk[None, :]], 1)
        if memory is not None:
            states, mem_positions, mem_valid = (np.asarray(v) for v in memory)
            m = states.shape[2]
            mem_blk = np.repeat(np.arange(n_blocks), m)
            mem_states = states[b].reshape(n_blocks * m, -1).astype(np.float64)
            mem_pos = (mem_positions[b] - start_n[:, None]).reshape(-1)
            own_memory = (blk[:, None] == mem_blk[None, :]) & mem_valid[b].reshape(1, -1)
            visible = np.concatenate([visible, own_memory], 1)
        for layer in range(CFG.num_layers):
            w = {k.split("/", 2)[2]: v for k, v in p.items() if k.startswith(f"layers/{layer}/")}
            hn = _rms(x, w["input_norm/scale"])
            q = _rope(
                _rms(np.einsum("ih,hqd->iqd", hn, w["attn/q/kernel"]), w["attn/q_norm/scale"]), slot_pos
            )

            def kv(src, pos, w=w):
                k_ = _rms(np.einsum("ih,hgd->igd", src, w["attn/k/kernel"]), w["attn/k_norm/scale"])
                return _rope(k_, pos), np.einsum("ih,hgd->igd", src, w["attn/v/kernel"])

            sources = [kv(c, positions[b]), kv(hn, slot_pos)]
            if memory is not None:
                sources.append(kv(mem_states, mem_pos))  # adapted states: no input norm
            keys = np.concatenate([k_ for k_, _ in sources])
            values = np.concatenate([v_ for _, v_ in sources])
            out = np.zeros_like(q)
            for head in range(CFG.num_heads):
                score = q[:, head] @ keys[:, head // heads_per_kv].T / np.sqrt(CFG.head_dim)
                out[:, head] = _softmax(np.where(visible, score, -np.inf)) @ values[:, head // heads_per_kv]
            x = x + np.einsum("iqd,qdh->ih", out, w["attn/o/kernel"])
            hn = _rms(x, w["post_attn_norm/scale"])
            gate = hn @ w["mlp/gate/kernel"]
            x = x + (gate / (1 + np.exp(-gate)) * (hn @ w["mlp/up/kernel"])) @ w["mlp/down/kernel"]
        out_h.append(_rms(x, p["final_norm/scale"]).reshape(n_blocks, S, -1))
    return np.stack(out_h)


def _eval_mask(batch, b, a, keep):
    """the design notes' cumulative validity of the predictions of the block at `a` in row `b`."""
    loss_mask, positions = np.asarray(batch["loss_mask"]), np.asarray(batch["positions"])
    t = loss_mask.shape[1]
    return np.cumprod(
        [
            keep
            and a + 1 + i < t
            and loss_mask[b, a + 1 + i]
            and positions[b, a + 1 + i] == positions[b, a] + 1 + i  # the anchor's own sample
            for i in range(S)
        ]
    )


def _metrics(p, h, lm_head, batch, anchors, keep):
    """Metrics of docs/design.md section 1 from final states `h [B, N, S, H]` of the blocks at `anchors`."""
    ids = np.asarray(batch["input_ids"])
    last = np.asarray(batch["last_hidden"], np.float64)
    lm_head = np.asarray(lm_head, np.float64)
    rows = []  # (eval_mask_i, w_i, ce, l1, bce, overlap, sigmoid(s)) per prediction
    taus = []
    for b in range(ids.shape[0]):
        for n, a in enumerate(anchors[b]):
            em = _eval_mask(batch, b, a, keep[b, n])
            run = 1.0
            tau = 1.0
            for i in range(S):
                if not em[i]:
                    rows.append((0.0,) * 7)
                    continue
                m = p["markov/w1"][ids[b, a + i]]
                logits = h[b, n, i] @ lm_head + m @ p["markov/w2"]
                q_i, p_i = _softmax(logits), _softmax(last[b, a + i] @ lm_head)
                ce = -np.log(q_i[ids[b, a + 1 + i]])
                overlap = np.minimum(p_i, q_i).sum()
                s = np.concatenate([h[b, n, i], m]) @ p["confidence/kernel"] + p["confidence/bias"]
                bce = overlap * _softplus(-s) + (1 - overlap) * _softplus(s)
                rows.append(
                    (1.0, np.exp(-i / 4), ce, np.abs(p_i - q_i).sum(), bce, overlap, 1 / (1 + np.exp(-s)))
                )
                run *= overlap
                tau += run
            if em[0]:
                taus.append(tau)
    em, wt, ce, l1, bce, ov, sig = np.asarray(rows).reshape(-1, S, 7).transpose(2, 0, 1)
    out = {name: (wt * t).sum() / wt.sum() for name, t in (("ce", ce), ("l1", l1), ("bce", bce))}
    out["loss"] = 0.1 * out["ce"] + 0.9 * out["l1"] + out["bce"]
    out["tau_prob"] = np.mean(taus)
    out |= {f"accept_rate_{i}": (ov * em)[:, i].sum() / em[:, i].sum() for i in range(S)}
    w = wt * em  # DeepSpec weighs the confidence metrics like the loss
    out["confidence_abs_error"] = (np.abs(sig - ov) * w).sum() / w.sum()
    out["confidence_bias"] = ((sig - ov) * w).sum() / w.sum()
    prefix_gap = np.cumprod(sig * em, axis=1) - np.cumprod(ov * em, axis=1)
    out["confidence_cumprod_bias"] = (prefix_gap * w).sum() / w.sum()
    out["valid_predictions"] = em.sum()
    out["valid_blocks"] = float(len(taus))
    return out


def _reference(p, emb, lm_head, mask_vec, batch):
    """The baseline draft's metrics on the batch's own anchors."""
    anchors, keep = np.asarray(batch["anchors"]), np.asarray(batch["block_keep"])
    return _metrics(p, _forward(p, emb, mask_vec, batch, anchors), lm_head, batch, anchors, keep)


def _batch(rng):
    loss_mask = np.zeros((2, T), np.int32)
    loss_mask[0, 3:10] = loss_mask[0, 13:] = 1  # two assistant turns with a user gap at 10..12
    loss_mask[1, :7] = loss_mask[1, 9:] = 1
    # Row 1 packs two samples, rows 0..10 and 11..23: anchor 9's predictions stop at the sample's end
    # (although the loss mask runs on), anchor 12 sees context 11 only.
    positions = np.stack([np.arange(T), np.r_[np.arange(11), np.arange(T - 11)]]).astype(np.int32)
    anchors = np.asarray([[4, 8, 15, 0], [0, 5, 9, 12]], np.int32)  # 8: cut by the gap; 15: by T
    keep = np.asarray([[1, 1, 1, 0], [1, 1, 1, 1]], np.uint8)  # one padded block
    ids = rng.integers(0, V, (2, T)).astype(np.int32)
    return {
        "positions": positions,
        "input_ids": ids,
        "loss_mask": loss_mask,
        "aux_hidden": rng.normal(size=(2, T, A, H)).astype(np.float32),
        "last_hidden": rng.normal(size=(2, T, H)).astype(np.float32),
        "anchors": anchors,
        "block_keep": keep,
    }


def _randomize(model, rng):
    """Sets every parameter to larger random values (norm scales near 1); returns them as float64 NumPy."""
    flat = []
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        shape = var.get_value().shape
        scale = path[-1] == "scale"
        value = (1.0 + 0.2 * rng.normal(size=shape)) if scale else 0.3 * rng.normal(size=shape)
        flat.append((path, var.replace(jnp.asarray(value, jnp.float32))))
    nnx.update(model, nnx.from_flat_state(flat))
    return {
        "/".join(map(str, path)): np.asarray(var.get_value(), np.float64)
        for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }


@pytest.mark.parametrize(("attention", "mask_token_id"), [("xla", None), ("reference", None), ("xla", 7)])
def test_draft_metrics_match_numpy_reference(attention, mask_token_id):
    cfg = DraftConfig(**{**CFG.__dict__, "attention": attention, "mask_token_id": mask_token_id})
    rng = np.random.default_rng(0)
    model = DSparkDraft(cfg, rngs=nnx.Rngs(0))
    params = _randomize(model, rng)
    emb, lm_head = rng.normal(size=(V, H)), 0.5 * rng.normal(size=(H, V))
    batch = _batch(rng)
    frozen = FrozenTarget(jnp.asarray(emb, jnp.float32), jnp.asarray(lm_head, jnp.float32))
    got = metrics_from_sums(draft_sums(model, frozen, {k: jnp.asarray(v) for k, v in batch.items()}))
    mask_vec = params["mask_embedding"] if mask_token_id is None else emb[mask_token_id]
    want = _reference(params, emb.astype(np.float32), lm_head.astype(np.float32), mask_vec, batch)
    assert 0.05 < want["accept_rate_0"] < 0.95 and want["l1"] > 0.3  # far from trivial distributions
    assert float(got["valid_blocks"]) == 7
    for name, value in want.items():
        np.testing.assert_allclose(float(got[name]), value, rtol=1e-4, atol=1e-5, err_msg=name)
