"""Draft Memory: greedy stage 1, transitions on the seed's worked example, no stage-1 gradient, empty
memory = baseline, adapter size, checkpoints of the wrong group refused."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import baseline as baseline_config
from configs import memory as memory_config
from dspark_jax.draft import blocks, objective
from dspark_jax.draft.model import DraftMemory, FrozenTarget, make_draft_vocab
from dspark_jax.groups import baseline
from dspark_jax.groups.memory import group as memory
from dspark_jax.groups.memory.model import (
    MemoryDraft,
    MemoryDraftConfig,
    leading_matches,
    memory_slots,
    transition,
)
from dspark_jax.run import draft_state
from dspark_jax.run.checkpoints import Checkpointer
from dspark_jax.target import TargetConfig
from tests.draft.test_reference import CFG, S, _eval_mask, _forward, _metrics, _randomize, _rms

H, V, A = CFG.hidden_size, CFG.vocab_size, CFG.num_aux
MEMORY_CFG = MemoryDraftConfig(**CFG.__dict__)


def _model(seed=0, cfg=MEMORY_CFG):
    rng = np.random.default_rng(seed)
    model = MemoryDraft(cfg, rngs=nnx.Rngs(seed))
    params = _randomize(model, rng)
    emb, lm_head = rng.normal(size=(V, H)), 0.5 * rng.normal(size=(H, V))
    frozen = FrozenTarget(jnp.asarray(emb, jnp.float32), jnp.asarray(lm_head, jnp.float32))
    return model, params, frozen


def _batch(rng, t, anchors, loss_mask=None, positions=None, ids=None):
    anchors = np.atleast_2d(np.asarray(anchors, np.int32))
    b = anchors.shape[0]
    return {
        "input_ids": jnp.asarray(rng.integers(0, V, (b, t)) if ids is None else ids, jnp.int32),
        "loss_mask": jnp.asarray(np.ones((b, t)) if loss_mask is None else loss_mask, jnp.int32),
        "positions": jnp.asarray(
            np.tile(np.arange(t), (b, 1)) if positions is None else positions, jnp.int32
        ),
        "aux_hidden": jnp.asarray(rng.normal(size=(b, t, A, H)), jnp.float32),
        "last_hidden": jnp.asarray(rng.normal(size=(b, t, H)), jnp.float32),
        "anchors": jnp.asarray(anchors),
        "block_keep": jnp.ones(anchors.shape, jnp.uint8),
    }


def _greedy_free_run(h_SxH, anchor_token, params, lm_head, vocab=None):
    """Token-by-token greedy drafting in float64 NumPy: each choice's predecessor is the previous choice,
    each choice the best of the draft vocabulary's ids `vocab` (default: the whole vocabulary)."""
    vocab = np.arange(lm_head.shape[1]) if vocab is None else vocab
    drafts, token = [], anchor_token
    for h in np.asarray(h_SxH, np.float64):
        logits = h @ lm_head + params["markov/w1"][token] @ params["markov/w2"]
        token = int(vocab[np.argmax(logits[vocab])])
        drafts.append(token)
    return drafts


@pytest.mark.parametrize("vocab_size", [V, V // 2], ids=["whole-vocabulary", "draft-vocabulary"])
def test_stage1_first_mismatch_equals_token_by_token_greedy(vocab_size):
    """Recorded continuations crafted to follow greedy for 0, 3, 7 and 5 tokens and then to diverge (with
    later coincidental agreements): the parallel leading-match count equals greedy's first error; with a
    draft vocabulary (`train.draft_vocab`) greedy chooses among its ids."""
    model, params, frozen = _model()
    vocab = np.sort(np.random.default_rng(7).choice(V, vocab_size, replace=False))
    if vocab_size < V:
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        frozen = frozen._replace(draft_vocab=make_draft_vocab(frozen.lm_head_HxV, vocab, one, one))
    rng = np.random.default_rng(1)
    t, anchors, follow = 44, [2, 12, 22, 32], [0, 3, 7, 5]
    batch = _batch(rng, t, anchors)
    _, h_BxNxSxH = baseline.block_states(model, frozen, batch, batch["anchors"], batch["block_keep"])
    lm_head = np.asarray(frozen.lm_head_HxV, np.float64)
    ids = np.asarray(batch["input_ids"])[0].copy()
    for n, (a, k) in enumerate(zip(anchors, follow)):
        drafts = _greedy_free_run(h_BxNxSxH[0, n], ids[a], params, lm_head, vocab)
        ids[a + 1 : a + 1 + k] = drafts[:k]
        if k < 7:
            ids[a + 1 + k] = (drafts[k] + 1) % V  # the first error
        if k + 2 < 7:
            ids[a + 2 + k] = drafts[k + 1]  # agrees again later: must not count
    batch["input_ids"] = jnp.asarray(ids[None])
    targets, h = baseline.block_states(model, frozen, batch, batch["anchors"], batch["block_keep"])
    got = np.asarray(leading_matches(model, frozen, h, targets))[0]
    want = []
    for n, a in enumerate(anchors):
        drafts = _greedy_free_run(h[0, n], ids[a], params, lm_head, vocab)
        want.append(next((i for i in range(7) if drafts[i] != ids[a + 1 + i]), 7))
    assert want == follow and got.tolist() == want


# The seed's worked example with a block of five: old anchor C, context up to B, recorded continuation
# D E F G H; two matches and a mismatch at F.
C, B5 = 4, 5
LETTERS = dict(zip("ABCDEFGHIJK", range(2, 13)))  # response tokens A.. K at positions 2..12


def _transition(anchor, matches, loss_mask, positions=None):
    t = loss_mask.shape[-1]
    positions = np.arange(t)[None] if positions is None else positions
    step = transition(
        jnp.asarray([[anchor]]),
        jnp.asarray([[matches]]),
        jnp.ones((1, 1), jnp.uint8),
        jnp.asarray(loss_mask[None]),
        jnp.asarray(positions),
    )
    slots, valid = memory_slots(jnp.asarray([[anchor]]), jnp.asarray([[matches]]), step.keep_BxN, B5)
    return (
        int(step.anchors_BxN[0, 0]),
        bool(step.keep_BxN[0, 0]),
        np.asarray(slots[0, 0]),
        np.asarray(valid[0, 0]),
    )


def test_transition_and_memory_positions_follow_the_seed_example():
    loss_mask = np.zeros(20, np.int32)
    loss_mask[2:13] = 1
    assert LETTERS["C"] == C
    # Two matches (D, E), mismatch at F: new anchor F, memory slots 2 and 3 = h[3], h[4] (the seed's h_4,
    # h_5) at the positions of G and H.
    new, kept, slots, valid = _transition(C, 2, loss_mask)
    assert kept and new == LETTERS["F"]
    assert np.flatnonzero(valid).tolist() == [2, 3]
    assert slots[valid].tolist() == [LETTERS["G"], LETTERS["H"]] == [new + 1, new + 2]
    # Memory slot j holds h[j+1], which predicted position C + j + 2.
    assert slots.tolist() == [C + j + 2 for j in range(B5 - 1)]
    # All five matched: the bonus position, no memory.
    new, kept, _, valid = _transition(C, 5, loss_mask)
    assert kept and new == C + 6 and not valid.any()
    # No match: new anchor D, memory h[1..4] aligned to E..H.
    new, kept, slots, valid = _transition(C, 0, loss_mask)
    assert kept and new == LETTERS["D"] and slots[valid].tolist() == [LETTERS[x] for x in "EFGH"]
    # Crossing the response end (position 13 is not a response token): dropped, no memory.
    new, kept, _, valid = _transition(9, 3, loss_mask)
    assert not kept and new == 9 and not valid.any()
    # Landing on the last response token: kept, but no supervised next token, so the block counts nothing.
    new, kept, _, _ = _transition(9, 2, loss_mask)
    assert kept and new == 12
    targets = blocks.block_targets(
        jnp.zeros((1, 20), jnp.int32),
        jnp.asarray(loss_mask[None]),
        jnp.asarray([[new]]),
        jnp.ones((1, 1)),
        B5,
    )
    assert int(targets.eval_mask.sum()) == 0
    # Crossing into the next packed sample (positions restart at 8): dropped.
    positions = np.r_[np.arange(8), np.arange(12)][None]
    new, kept, _, _ = _transition(C, 3, loss_mask, positions)
    assert not kept


def test_stage2_visibility_on_the_seed_example():
    """The stage-2 block at F sees context up to E and the memory at G and H, nothing else."""
    cfg = dataclasses.replace(MEMORY_CFG, block_size=B5)
    model, _, frozen = _model(cfg=cfg)
    rng = np.random.default_rng(3)
    loss_mask = np.zeros((1, 20), np.int32)
    loss_mask[0, 2:13] = 1
    batch = _batch(rng, 20, [[C]], loss_mask=loss_mask)
    anchors, keep = batch["anchors"], batch["block_keep"]
    _, h1 = baseline.block_states(model, frozen, batch, anchors, keep)
    step = transition(anchors, jnp.asarray([[2]]), keep, batch["loss_mask"], batch["positions"])
    assert int(step.anchors_BxN[0, 0]) == LETTERS["F"]

    def stage2(batch, h1):
        mem = model.memory(h1, anchors, jnp.asarray([[2]]), step.keep_BxN)
        return np.asarray(
            baseline.block_states(model, frozen, batch, step.anchors_BxN, step.keep_BxN, mem)[1]
        )

    base = stage2(batch, h1)
    aux = np.asarray(batch["aux_hidden"])
    for position, visible in ((LETTERS["A"], True), (LETTERS["E"], True), (LETTERS["F"], False), (15, False)):
        changed = aux.copy()
        changed[0, position] += 1.0
        moved = not np.allclose(stage2({**batch, "aux_hidden": jnp.asarray(changed)}, h1), base)
        assert moved == visible, position
    for slot, visible in ((0, False), (1, False), (2, False), (3, True), (4, True)):  # h[3], h[4] kept
        changed = np.asarray(h1).copy()
        changed[0, 0, slot] += 1.0
        assert (not np.allclose(stage2(batch, jnp.asarray(changed)), base)) == visible, slot


def _loss(sums):
    return objective.loss_from_sums(sums, memory.MEMORY.model.loss_terms)


@pytest.mark.slow
def test_no_gradient_reaches_stage_one():
    model, _, frozen = _model()
    batch = _batch(np.random.default_rng(4), 30, [[3, 9, 15, 21]])
    graphdef, params = nnx.split(model)
    stage1_copy = jax.tree.map(jnp.array, params)

    def two_stage(p1, p2):
        return _loss(memory.two_stage_sums(nnx.merge(graphdef, p1), nnx.merge(graphdef, p2), frozen, batch))

    g1, g2 = jax.grad(two_stage, argnums=(0, 1))(stage1_copy, params)
    assert all(float(jnp.max(jnp.abs(g))) == 0.0 for g in jax.tree.leaves(g1))
    shared = jax.grad(lambda p: _loss(memory.memory_sums(nnx.merge(graphdef, p), frozen, batch)))(params)
    for a, b in zip(jax.tree.leaves(shared), jax.tree.leaves(g2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    adapter = nnx.split(nnx.merge(graphdef, g2).memory_adapter)[1]
    assert all(float(jnp.max(jnp.abs(g))) > 0 for g in jax.tree.leaves(adapter))  # stage 2 trains it
    # A different stage-1 copy changes stage 1's choices, never the gradient path: still zero.
    perturbed = jax.tree.map(lambda x: x * 1.5 if x.ndim >= 2 else x, stage1_copy)
    g1 = jax.grad(two_stage)(perturbed, params)
    assert all(float(jnp.max(jnp.abs(g))) == 0.0 for g in jax.tree.leaves(g1))


def test_empty_memory_stage2_equals_the_baseline():
    model, _, frozen = _model()
    batch = _batch(np.random.default_rng(5), 30, [[3, 9, 15, 21]])
    anchors, keep = batch["anchors"], batch["block_keep"]
    _, h1 = baseline.block_states(model, frozen, batch, anchors, keep)
    empty = model.memory(h1, anchors, jnp.zeros_like(anchors), jnp.zeros_like(keep))
    assert isinstance(empty, DraftMemory) and not bool(empty.valid_BxNxM.any())
    with_empty = baseline.objective_sums(
        model, frozen, batch, anchors, *baseline.block_states(model, frozen, batch, anchors, keep, empty)
    )
    plain = baseline.draft_sums(model, frozen, batch)
    for name in plain:
        np.testing.assert_allclose(
            np.asarray(with_empty[name]), np.asarray(plain[name]), rtol=1e-6, err_msg=name
        )


def test_adapter_has_the_seeds_parameter_count_at_paper_shapes():
    config = memory_config.get_config("paper")
    target = TargetConfig.from_json(config.target.arch.to_dict())
    _, params, _ = draft_state.abstract_draft(config, target)
    adapter = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params["memory_adapter"]))
    assert adapter == 2560 * 2560 + 2560 == 6_556_160
    base_config = baseline_config.get_config("paper")
    _, base_params, _ = draft_state.abstract_draft(base_config, target)
    total = lambda p: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(p))
    assert total(params) - total(base_params) == 6_556_160


def test_a_checkpoint_of_the_other_group_is_refused_naming_the_parameters(mesh1, tmp_path):
    configs = {"memory": memory_config.get_config("smoke"), "baseline": baseline_config.get_config("smoke")}
    target = TargetConfig.from_json(configs["memory"].target.arch.to_dict())
    for saved, loaded, named in (
        (
            "memory",
            "baseline",
            r"in the checkpoint but not in the model: [^;]*memory_adapter\.proj\.kernel",
        ),
        ("baseline", "memory", r"missing from the checkpoint: [^;]*memory_adapter\.proj\.kernel"),
    ):
        _, params, _ = draft_state.init_draft(configs[saved], target, mesh1)
        with Checkpointer(tmp_path / saved) as checkpointer:
            checkpointer.save(1, {"params": params}, force=True)
        with pytest.raises(ValueError, match=named):
            draft_state.restore_draft(configs[loaded], target, mesh1, tmp_path / saved)


def _reference_two_stage(p, emb, lm_head, mask_vec, batch, context2=True, memory2=True):
    """Both stages in float64 NumPy from the seed's text: greedy first error, transition, adapter, stage 2
    (without the target context: `context2=False`; without its memory: `memory2=False`)."""
    ids, loss_mask = np.asarray(batch["input_ids"]), np.asarray(batch["loss_mask"])
    positions = np.asarray(batch["positions"])
    anchors, keep = np.asarray(batch["anchors"]), np.asarray(batch["block_keep"])
    t = ids.shape[1]
    h1 = _forward(p, emb, mask_vec, batch, anchors)
    new_anchors, new_keep, matches = anchors.copy(), np.zeros_like(keep), []
    states = np.zeros((*anchors.shape, S - 1, h1.shape[-1]))
    mem_positions = np.zeros((*anchors.shape, S - 1), np.int32)
    mem_valid = np.zeros((*anchors.shape, S - 1), bool)
    for b, n in np.ndindex(anchors.shape):
        a, em = anchors[b, n], _eval_mask(batch, b, anchors[b, n], keep[b, n])
        m = 0  # leading greedy matches with the recorded tokens, reference predecessors
        while m < S and em[m]:
            logits = h1[b, n, m] @ lm_head + p["markov/w1"][ids[b, a + m]] @ p["markov/w2"]
            if np.argmax(logits) != ids[b, a + 1 + m]:
                break
            m += 1
        if em[0]:
            matches.append(m)
        a2 = a + m + 1
        if keep[b, n] and a2 < t and loss_mask[b, a2] and positions[b, a2] == positions[b, a] + m + 1:
            new_anchors[b, n], new_keep[b, n] = a2, 1
            for k in range(m + 2, S + 1):  # the seed's 1-based h_k, RoPE position a + k
                states[b, n, k - 2] = _rms(h1[b, n, k - 1] @ p["memory_adapter/proj/kernel"], 1.0)
                states[b, n, k - 2] *= p["memory_adapter/norm/scale"]
                mem_positions[b, n, k - 2], mem_valid[b, n, k - 2] = a + k, memory2
    h2 = _forward(p, emb, mask_vec, batch, new_anchors, (states, mem_positions, mem_valid), context2)
    out = _metrics(p, h2, lm_head, batch, new_anchors, new_keep)
    out["stage1_mean_matches"] = np.mean(matches)
    out["transition_kept"] = out["valid_blocks"] / len(matches)
    return out, matches, (new_anchors, new_keep)


@pytest.mark.parametrize("attention", ["xla", "reference"])
def test_two_stages_match_a_float64_numpy_reference(attention):
    """Row 0 plain, row 1 two packed samples; continuations crafted to follow greedy for a chosen number
    of tokens: transitions inside a sample, to the bonus position, across the response end (dropped) and
    into the next packed sample (dropped)."""
    cfg = dataclasses.replace(MEMORY_CFG, attention=attention)
    model, params, frozen = _model(seed=7, cfg=cfg)
    batch = crafted_batch(model, params, frozen)
    got = memory.memory_metrics(memory.memory_sums(model, frozen, batch))
    mask_vec = params["mask_embedding"]
    lm_head = np.asarray(frozen.lm_head_HxV, np.float64)
    want, matches, _ = _reference_two_stage(params, frozen.embedding_VxH, lm_head, mask_vec, batch)
    assert matches == [2, 0, 7, 4, 1, 6, 3, 7]
    assert want["valid_blocks"] == 6  # two of eight transitions dropped
    for name, value in want.items():
        np.testing.assert_allclose(float(got[name]), value, rtol=1e-4, atol=1e-5, err_msg=name)
    assert float(got["stage1_matches_7"]) == 2 / 8 and float(got["memory_block_fraction"]) < 1.0


def crafted_batch(model, params, frozen):
    """Row 0 plain, row 1 two packed samples; each block's continuation follows the stage-1 draft's greedy
    choices for `[[2, 0, 7, 4], [1, 6, 3, 7]]` tokens, then departs from it."""
    rng = np.random.default_rng(8)
    t = 40
    anchors = np.asarray([[2, 12, 22, 31], [3, 13, 22, 30]], np.int32)
    follow = [[2, 0, 7, 4], [1, 6, 3, 7]]
    loss_mask = np.zeros((2, t), np.int32)
    loss_mask[0, 1:36] = 1
    loss_mask[1, 1:20] = loss_mask[1, 21:40] = 1
    positions = np.stack([np.arange(t), np.r_[np.arange(20), np.arange(20)]])
    batch = _batch(rng, t, anchors, loss_mask=loss_mask, positions=positions)
    _, h1 = baseline.block_states(model, frozen, batch, batch["anchors"], batch["block_keep"])
    lm_head = np.asarray(frozen.lm_head_HxV, np.float64)
    ids = np.asarray(batch["input_ids"]).copy()
    for b, n in np.ndindex(anchors.shape):
        a, k = anchors[b, n], follow[b][n]
        drafts = _greedy_free_run(h1[b, n], ids[b, a], params, lm_head)
        ids[b, a + 1 : a + 1 + k] = drafts[:k]
        if k < 7:
            ids[b, a + 1 + k] = (drafts[k] + 1) % V
    batch["input_ids"] = jnp.asarray(ids)
    return batch
