"""The Engram groups: feature positions, gate and slot formulas against NumPy, equality with the baseline at
initialisation, the projection's gradient, online lookups equal to training features, parameter counts."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import baseline as baseline_config
from configs import engram_markov, engram_mask_gated, engram_mask_replace
from dspark_jax.draft import objective
from dspark_jax.draft.model import DSparkDraft, FrozenTarget
from dspark_jax.groups import baseline
from dspark_jax.groups.engram import group as engram_group
from dspark_jax.groups.engram.group import TABLE
from dspark_jax.groups.engram.hashing import HashSpec, host_hashes
from dspark_jax.groups.engram.model import (
    EngramDraftConfig,
    EngramMarkovDraft,
    EngramMaskDraft,
    EngramReplaceDraft,
)
from dspark_jax.groups.engram.table import device_table
from dspark_jax.inference import engine
from dspark_jax.run import draft_state
from dspark_jax.target import TargetConfig
from tests.draft.test_reference import CFG, EPS, S, _batch, _randomize

H, V = CFG.hidden_size, CFG.vocab_size
SPEC = HashSpec.create(
    max_order=3, heads=2, head_dim=5, seed=3, layer_id=1, compressed_vocab=V, pad_id=1, table_size=50
)
U = SPEC.dim
ENGRAM_CFG = EngramDraftConfig(**CFG.__dict__, engram_dim=U, engram_order=3)
ROWS = np.random.default_rng(9).normal(size=(SPEC.num_rows, SPEC.head_dim)).astype(np.float32)


def _frozen(rng):
    emb, lm_head = rng.normal(size=(V, H)), 0.5 * rng.normal(size=(H, V))
    table = device_table(SPEC, np.arange(V), ROWS)
    return FrozenTarget(jnp.asarray(emb, jnp.float32), jnp.asarray(lm_head, jnp.float32), {TABLE: table})


def _jbatch(batch):
    return {k: jnp.asarray(v) for k, v in batch.items()}


def _host_features(ids_T, positions_T):
    """e[t] of one row, `[T, U]`, from the NumPy int64 hashing."""
    rows = host_hashes(SPEC, ids_T, positions_T) + SPEC.offsets
    return ROWS[rows].reshape(len(ids_T), U)


def _rms(x):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS)


def test_training_features_read_the_predecessor_and_pre_anchor_positions():
    rng = np.random.default_rng(0)
    batch = _batch(rng)
    frozen = _frozen(rng)
    anchors, keep = batch["anchors"], batch["block_keep"]
    t = batch["input_ids"].shape[1]
    markov = engram_group.features_at(
        frozen,
        _jbatch(batch),
        jnp.asarray(anchors[..., None] + np.arange(S)),
        jnp.ones((*anchors.shape, S), bool),
    )
    pre = engram_group.pre_anchor_features(frozen, _jbatch(batch), jnp.asarray(anchors), jnp.asarray(keep))
    for b in range(2):
        e_TxU = _host_features(batch["input_ids"][b], batch["positions"][b])
        for n, a in enumerate(anchors[b]):
            for i in range(S):
                if a + i < t:
                    np.testing.assert_array_equal(markov[b, n, i], e_TxU[a + i])
            first_of_sample = batch["positions"][b, a] == 0
            want = np.zeros(U) if first_of_sample or not keep[b, n] else e_TxU[a - 1]
            np.testing.assert_array_equal(pre[b, n], want)
    # Row 1 packs a sample starting at 11: its anchor 12 reads e[11], whose n-grams do not reach back
    # into the first sample (pad ids instead).
    assert batch["positions"][1, 11] == 0 and anchors[1, 3] == 12
    lone = _host_features(batch["input_ids"][1, 11:12], np.zeros(1, int))
    np.testing.assert_array_equal(pre[1, 3], lone[0])


def test_markov_gate_and_value_match_numpy():
    rng = np.random.default_rng(1)
    model = EngramMarkovDraft(ENGRAM_CFG, rngs=nnx.Rngs(0))
    p = _randomize(model, rng)
    h, e = rng.normal(size=(6, H)), 3 * rng.normal(size=(6, U))
    tokens = rng.integers(0, V, 6)
    got = model.markov_features(jnp.asarray(h, jnp.float32), jnp.asarray(tokens), jnp.asarray(e, jnp.float32))
    e_bar = _rms(e)
    q = _rms(_rms(h) @ p["engram_q/kernel"])
    k = _rms(e_bar @ p["engram_k/kernel"])
    s = np.sum(q * k, -1, keepdims=True) / np.sqrt(CFG.markov_rank)
    g = 1 / (1 + np.exp(-np.sign(s) * np.sqrt(np.maximum(np.abs(s), 1e-6))))
    want = p["markov/w1"][tokens] + g * (e_bar @ p["engram_v/kernel"])
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)
    assert g.min() > 0.05 and g.max() < 0.95


@pytest.mark.parametrize("cls", [EngramMaskDraft, EngramReplaceDraft])
def test_mask_slot_inputs_match_numpy(cls):
    rng = np.random.default_rng(2)
    model = cls(ENGRAM_CFG, rngs=nnx.Rngs(0))
    p = _randomize(model, rng)
    frozen = _frozen(rng)
    tokens = rng.integers(0, V, (2, 3))
    e = rng.normal(size=(2, 3, U))
    e[1, 2] = 0  # a block without a pre-anchor feature
    got = np.asarray(model.block_inputs(frozen, jnp.asarray(tokens), jnp.asarray(e, jnp.float32)))
    z = _rms(e @ p["engram_proj/kernel"])
    emb = np.asarray(frozen.embedding_VxH)
    np.testing.assert_allclose(got[:, :, 0], emb[tokens], rtol=1e-6)
    if cls is EngramMaskDraft:
        slots = p["mask_embedding"] + np.tanh(p["engram_gates"])[:, None] * z[:, :, None]
    else:
        slots = np.broadcast_to(z[:, :, None], (2, 3, S - 1, H))
        assert "mask_embedding" not in p and "engram_gates" not in p
    np.testing.assert_allclose(got[:, :, 1:], slots, rtol=1e-4, atol=1e-5)
    if cls is EngramReplaceDraft:
        assert not got[1, 2, 1:].any()  # zero features: zero slots


def _shared_baseline(model):
    """A baseline draft holding `model`'s baseline parameters (the replacement has no MASK vector)."""
    base = DSparkDraft(CFG, rngs=nnx.Rngs(5))
    shared = {path: var for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    nnx.update(
        base,
        nnx.from_flat_state(
            [(p, shared.get(p, v)) for p, v in nnx.to_flat_state(nnx.state(base, nnx.Param))]
        ),
    )
    return base


@pytest.mark.parametrize(
    "cls, sums, equal",
    [
        (EngramMarkovDraft, engram_group.engram_markov_sums, True),
        (EngramMaskDraft, engram_group.engram_mask_sums, True),
        (EngramReplaceDraft, engram_group.engram_mask_sums, False),
    ],
)
def test_at_initialisation_markov_and_gated_equal_the_baseline(cls, sums, equal):
    rng = np.random.default_rng(3)
    model = cls(ENGRAM_CFG, rngs=nnx.Rngs(0))
    frozen, batch = _frozen(rng), _jbatch(_batch(rng))
    got = sums(model, frozen, batch)
    want = baseline.draft_sums(_shared_baseline(model), frozen, batch)
    same = all(np.array_equal(np.asarray(got[k]), np.asarray(want[k])) for k in want)
    assert same == equal
    if not equal:  # replacement starts elsewhere, on the same blocks
        assert float(got["blocks"]) == float(want["blocks"])


def _loss(sums):
    return objective.loss_from_sums(sums)


def test_projection_gradient_is_zero_until_a_gate_opens():
    rng = np.random.default_rng(4)
    model = EngramMaskDraft(ENGRAM_CFG, rngs=nnx.Rngs(0))
    frozen, batch = _frozen(rng), _jbatch(_batch(rng))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    grad = lambda p: jax.grad(
        lambda q: _loss(engram_group.engram_mask_sums(nnx.merge(graphdef, q, rest), frozen, batch))
    )(p)
    g = grad(params)
    assert not np.any(np.asarray(g["engram_proj"]["kernel"].get_value()))
    assert np.any(np.asarray(g["engram_gates"].get_value()))  # the gates themselves learn
    params["engram_gates"] = params["engram_gates"].replace(jnp.asarray([0.0, 0.0, 0.3, 0.0, 0.0, 0.0]))
    g = grad(params)
    assert np.abs(np.asarray(g["engram_proj"]["kernel"].get_value())).max() > 1e-6


def test_online_lookups_equal_training_features():
    """Teacher-forced: the engine's pre-anchor lookup, its drafted-prefix window and its carry after `m`
    accepted drafts give exactly the training features of the same positions."""
    rng = np.random.default_rng(5)
    frozen = _frozen(rng)
    draft = types.SimpleNamespace(cfg=ENGRAM_CFG)
    x = rng.integers(0, V, 40).astype(np.int32)
    e_TxU = _host_features(x, np.arange(40))
    for p in (1, 2, 3, 9, 20):
        prompt = jnp.asarray(np.pad(x[:p], (0, 40 - p))[None])
        carry = engram_group.init_recent(draft, prompt, jnp.asarray([p]))
        window = engram_group.PrefixWindow(engram_group.table_of(frozen), carry.tokens_BxN, jnp.asarray([p]))
        np.testing.assert_array_equal(window.features()[0], e_TxU[p - 1])  # Engram-MASK: e[a-1]
        for i in range(S):  # Engram-Markov: prediction i reads e[a+i] after pushing its predecessor
            np.testing.assert_array_equal(window.push(jnp.asarray([x[p + i]]))[0], e_TxU[p + i])
        for m in range(S + 1):
            state = types.SimpleNamespace(
                carry=carry, pending_B=jnp.asarray([x[p]]), done_B=jnp.asarray([False])
            )
            proposals = engine.Proposals(jnp.asarray(x[None, p + 1 : p + 1 + S]), None, None)
            after = engram_group.next_recent(draft, state, None, proposals, jnp.asarray([m]))
            fresh = engram_group.init_recent(draft, jnp.asarray(x[None]), jnp.asarray([p + m + 1]))
            np.testing.assert_array_equal(after.tokens_BxN, fresh.tokens_BxN)


@pytest.mark.parametrize(
    "module, added",
    [(engram_markov, 1_966_080), (engram_mask_gated, 6_553_606), (engram_mask_replace, 6_553_600)],
)
def test_parameter_counts_at_paper_shapes(module, added):
    config = module.get_config("paper")
    target = TargetConfig.from_json(config.target.arch.to_dict())
    total = lambda c: sum(
        int(np.prod(x.shape)) for x in jax.tree.leaves(draft_state.abstract_draft(c, target)[1])
    )
    assert total(config) - total(baseline_config.get_config("paper")) == added
