"""Draft model: the visibility rule end to end through the 3-layer backbone, and MASK handling."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.draft.model import DraftConfig, DSparkDraft, FrozenTarget, make_draft_vocab, vocab_columns

CFG = DraftConfig(
    hidden_size=32,
    vocab_size=50,
    num_aux=3,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    intermediate_size=48,
    markov_rank=16,
    anchor_chunk=2,
)


def _setup(cfg=CFG, t=24):
    model = DSparkDraft(cfg, rngs=nnx.Rngs(0))
    keys = jax.random.split(jax.random.key(1), 3)
    frozen = FrozenTarget(
        jax.random.normal(keys[0], (cfg.vocab_size, cfg.hidden_size)),
        jax.random.normal(keys[1], (cfg.hidden_size, cfg.vocab_size)),
    )
    aux = jax.random.normal(keys[2], (1, t, cfg.num_aux, cfg.hidden_size))
    return model, frozen, aux


def _outputs(model, frozen, aux, anchors, tokens):
    ctx = model.context(aux)
    return model.backbone(model.block_inputs(frozen, tokens), model.context_kv(ctx), anchors)


@pytest.mark.parametrize("attention", ["xla", "reference"])
def test_block_sees_only_context_before_its_anchor(attention):
    cfg = DraftConfig(**{**CFG.__dict__, "attention": attention})
    model, frozen, aux = _setup(cfg)
    anchors = jnp.asarray([[3, 9, 15]])
    tokens = jnp.asarray([[5, 6, 7]])
    base = np.asarray(_outputs(model, frozen, aux, anchors, tokens))
    later = np.asarray(_outputs(model, frozen, aux.at[:, 9:].add(3.0), anchors, tokens))
    np.testing.assert_array_equal(later[:, :2], base[:, :2])  # blocks at 3 and 9 never see j >= 9
    assert not np.allclose(later[:, 2], base[:, 2])  # block at 15 sees 9..14
    at_anchor = np.asarray(_outputs(model, frozen, aux.at[:, 9].add(3.0), anchors, tokens))
    np.testing.assert_array_equal(at_anchor[:, 1], base[:, 1])  # the anchor's own target state is hidden
    earlier = np.asarray(_outputs(model, frozen, aux.at[:, 8].add(3.0), anchors, tokens))
    assert not np.allclose(earlier[:, 1], base[:, 1])
    other = np.asarray(_outputs(model, frozen, aux, anchors, tokens.at[:, 0].set(11)))
    np.testing.assert_array_equal(other[:, 1:], base[:, 1:])  # another block's inputs
    assert not np.allclose(other[:, 0], base[:, 0])


def test_mask_token_row_or_learned_vector():
    model, frozen, _ = _setup()
    x = model.block_inputs(frozen, jnp.asarray([[4]]))
    np.testing.assert_array_equal(np.asarray(x[0, 0, 0]), np.asarray(frozen.embedding_VxH[4]))
    np.testing.assert_array_equal(np.asarray(x[0, 0, 3]), np.asarray(model.mask_embedding.get_value()))
    spare = DSparkDraft(DraftConfig(**{**CFG.__dict__, "mask_token_id": 49}), rngs=nnx.Rngs(0))
    assert spare.mask_embedding is None
    y = spare.block_inputs(frozen, jnp.asarray([[4]]))
    np.testing.assert_array_equal(
        np.asarray(y[0, 0, 1:]), np.broadcast_to(np.asarray(frozen.embedding_VxH[49]), (6, 32))
    )


def test_heads_over_a_draft_vocabulary_are_the_whole_vocabularys_at_its_ids():
    """`FrozenTarget.draft_vocab`: base and Markov-corrected logits `[..., N]` are the whole vocabulary's
    columns at the vocabulary's ids (the shared-columns Markov bias gathers `W2`'s columns once); the
    confidence logit does not depend on the vocabulary."""
    model, frozen, _ = _setup()
    ids = np.asarray([0, 3, 4, 17, 30, 49])
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    restricted = frozen._replace(draft_vocab=make_draft_vocab(frozen.lm_head_HxV, ids[::-1], one, one))
    np.testing.assert_array_equal(vocab_columns(restricted), ids)  # sorted
    assert vocab_columns(frozen) is None
    h = jax.random.normal(jax.random.key(5), (2, 3, CFG.block_size, CFG.hidden_size))
    predecessors = jax.random.randint(jax.random.key(6), (2, 3, CFG.block_size), 0, CFG.vocab_size)
    whole, part = model.heads(frozen, h, predecessors), model.heads(restricted, h, predecessors)
    assert part["logits"].shape == (2, 3, CFG.block_size, len(ids))
    np.testing.assert_allclose(part["logits"], np.asarray(whole["logits"])[..., ids], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(part["confidence_logit"], whole["confidence_logit"])


def test_a_draft_cut_to_its_vocabulary_gives_the_same_logits_and_gradients():
    """`DSparkDraft.on_columns` (what the chunked loss runs: W2's draft-vocabulary columns gathered once):
    the heads and every parameter's gradient equal the whole draft's over the same vocabulary; W2's
    gradient lands on the vocabulary's columns only. A cut head refuses any other columns."""
    model, frozen, _ = _setup()
    ids = np.asarray([0, 3, 4, 17, 30, 49])
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    restricted = frozen._replace(draft_vocab=make_draft_vocab(frozen.lm_head_HxV, ids, one, one))
    h = jax.random.normal(jax.random.key(5), (2, 3, CFG.block_size, CFG.hidden_size))
    predecessors = jax.random.randint(jax.random.key(6), (2, 3, CFG.block_size), 0, CFG.vocab_size)
    weights = jax.random.normal(jax.random.key(7), (2, 3, CFG.block_size, len(ids)))
    graphdef, params = nnx.split(model)

    def loss(params, cut):
        draft = nnx.merge(graphdef, params)
        draft = draft.on_columns(vocab_columns(restricted)) if cut else draft
        out = draft.heads(restricted, h, predecessors)
        return jnp.sum(out["logits"] * weights) + jnp.sum(out["confidence_logit"])

    (whole, whole_grads), (cut, cut_grads) = (jax.value_and_grad(loss)(params, c) for c in (False, True))
    np.testing.assert_allclose(cut, whole, rtol=1e-6)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(cut_grads), jax.tree.leaves(whole_grads)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))
    w2_grad = np.asarray(cut_grads["markov"]["w2"].get_value())
    assert np.abs(w2_grad[:, ids]).min() > 0 and not np.delete(w2_grad, ids, axis=1).any()
    with pytest.raises(ValueError, match="takes that vocabulary's ids"):
        model.on_columns(vocab_columns(restricted)).heads(frozen, h, predecessors)
