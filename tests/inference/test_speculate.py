"""Speculative decoding: lossless greedy, cache roll-back, bad inputs (tiny target and draft).

Greedy losslessness is shown with drafts the target accepts: every group's proposer runs (its draft pass,
confidences and carry), then its tokens are replaced by the target's own greedy continuation, wrong at a
position that differs between rows and cycles, so rows of one batch accept different lengths in the same
cycle and the roll-back path runs on every cycle. Sampling losslessness: `test_sampling_joint.py`.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax import groups, sharding
from dspark_jax.draft.model import DraftConfig, DSparkDraft, FrozenTarget
from dspark_jax.groups.engram.group import TABLE
from dspark_jax.groups.engram.hashing import HashSpec
from dspark_jax.groups.engram.model import EngramDraftConfig
from dspark_jax.groups.engram.table import device_table
from dspark_jax.groups.memory.group import MEMORY_PROPOSER
from dspark_jax.groups.memory.model import MEMORY_SOURCES, MemoryDraft, MemoryDraftConfig
from dspark_jax.groups.reranker.model import RerankerDraft, RerankerDraftConfig
from dspark_jax.inference import engine, scheduler
from dspark_jax.inference.decoder import SpeculativeDecoder
from dspark_jax.run import draft_state, target_side
from dspark_jax.target.config import TargetConfig
from dspark_jax.target.generate import Generator, SamplingParams
from dspark_jax.target.model import DecodeCache, Transformer
from tests import rules
from tests.marks import tiered

V, H, EOS, AUX = 48, 32, 3, (0, 1)
TARGET = TargetConfig(
    family="qwen3",
    vocab_size=V,
    hidden_size=H,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    qk_norm=True,
    max_position_embeddings=256,
    eos_token_ids=(EOS,),
)
# A Qwen3-Next-shaped target: linear and full attention layers (aux layers of both kinds), sparse MLPs.
HYBRID_TARGET = dataclasses.replace(
    TARGET,
    family="qwen3_next",
    num_layers=4,
    layer_types=("linear_attention", "full_attention") * 2,
    attn_output_gate=True,
    partial_rotary_factor=0.5,
    norm_unit_offset=True,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=16,
)
DRAFT = DraftConfig(
    hidden_size=H,
    vocab_size=V,
    num_aux=len(AUX),
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    intermediate_size=48,
    markov_rank=8,
)
PROMPTS = [[5, 9, 11, 7], [7] * 13, [20, 21, 22, 23, 24, 25, 26, 27, 28], [1, 2]]
ENGRAM_GROUPS = ("engram_markov", "engram_mask_gated", "engram_mask_replace")
# Every proposer: the baseline's, Draft Memory's with each memory source, Engram's three, the reranker's.
GROUPS = ("baseline", *(f"memory_{s}" for s in MEMORY_SOURCES), *ENGRAM_GROUPS, "reranker_joint")


def _scaled(module, mesh, scale):
    graphdef, state = nnx.split(module)
    state = jax.tree.map(lambda x: x * scale if x.ndim >= 2 else x, state)
    return nnx.merge(graphdef, jax.device_put(state, sharding.state_shardings(state, mesh, rules.ALL_GROUPS)))


def _parts(target_cfg, draft_cfg, mesh):
    target = _scaled(Transformer(target_cfg, rngs=nnx.Rngs(0)), mesh, 8.0)
    draft = _scaled(DSparkDraft(draft_cfg, rngs=nnx.Rngs(1)), mesh, 4.0)
    frozen = FrozenTarget(target.embedding.get_value(), target.lm_head_matrix())
    return target, draft, frozen


@pytest.fixture(scope="module")
def parts(mesh1):
    return _parts(TARGET, DRAFT, mesh1)


@pytest.fixture(scope="module")
def hybrid_parts(mesh1):
    return _parts(HYBRID_TARGET, DRAFT, mesh1)


def _memory_draft(mesh, source, cfg=DRAFT):
    cfg = MemoryDraftConfig(**{**cfg.__dict__, "memory_source": source})
    return _scaled(MemoryDraft(cfg, rngs=nnx.Rngs(1)), mesh, 4.0)


def _engram_parts(parts, mesh, group, cfg=DRAFT):
    """The parts with a random Engram table (identity compression) and the group's draft, its Engram
    weights made to matter (`W_V` and the gates are zero at initialisation)."""
    target, _, frozen = parts
    v = cfg.vocab_size
    spec = HashSpec.create(
        max_order=3, heads=2, head_dim=4, seed=0, layer_id=0, compressed_vocab=v, pad_id=0, table_size=60
    )
    rows = np.random.default_rng(0).normal(size=(spec.num_rows, spec.head_dim))
    cfg = EngramDraftConfig(**cfg.__dict__, engram_dim=spec.dim, engram_order=3)
    draft = groups.get(group).model.build_draft(cfg, rngs=nnx.Rngs(1))
    for name in ("engram_v", "engram_proj"):
        if hasattr(draft, name):
            layer = getattr(draft, name)
            layer.kernel.set_value(jax.random.normal(jax.random.key(2), layer.kernel.get_value().shape))
    if getattr(draft, "engram_gates", None) is not None:
        draft.engram_gates.set_value(jnp.full(draft.engram_gates.get_value().shape, 0.8))
    frozen = frozen._replace(side_inputs={TABLE: device_table(spec, np.arange(v), rows)})
    return (target, _scaled(draft, mesh, 4.0), frozen)


def _reranker_draft(mesh, trained=True, cfg=DRAFT, candidates=16):
    """A reranker draft (`candidates` per slot); `trained` makes its residual scores matter (`W_o` is zero
    at initialisation)."""
    cfg = RerankerDraftConfig(
        **cfg.__dict__, rerank_candidates=candidates, rerank_width=16, rerank_heads=4, rerank_ffn=64
    )
    draft = RerankerDraft(cfg, rngs=nnx.Rngs(1))
    if trained:
        w_o = draft.reranker.w_o.kernel
        w_o.set_value(3.0 * jax.random.normal(jax.random.key(5), w_o.get_value().shape))
    return _scaled(draft, mesh, 4.0)


def _group(parts, mesh, group, cfg=DRAFT, candidates=16):
    """`(parts, draft, proposer)` of a group in `GROUPS`, its group-specific weights made to matter."""
    if group.startswith("memory_"):
        return parts, _memory_draft(mesh, group.removeprefix("memory_"), cfg), MEMORY_PROPOSER
    if group in ENGRAM_GROUPS:
        return _engram_parts(parts, mesh, group, cfg), None, groups.get(group).model.proposer
    if group == "reranker_joint":
        return parts, _reranker_draft(mesh, cfg=cfg, candidates=candidates), groups.get(group).model.proposer
    return parts, None, engine.DSPARK_PROPOSER


def _decoder(parts, mesh, batch_size, draft=None, proposer=engine.DSPARK_PROPOSER, eos=EOS, **kw):
    target, default_draft, frozen = parts
    graphdef, params, rest = nnx.split(draft or default_draft, nnx.Param, ...)
    decoder = SpeculativeDecoder(
        target,
        graphdef,
        params,
        rest,
        frozen,
        proposer=proposer,
        aux_layer_ids=AUX,
        eos_ids=[eos],
        pad_id=0,
        batch_size=batch_size,
        mesh=mesh,
        **kw,
    )
    if kw.get("schedule") == "confidence":
        # A crafted table instead of the profile: SPS(n) = 1 / (n + rows) admits a proposal while its
        # survival beats tau* / (n + rows), so the verified lengths vary with the confidences.
        n = np.arange(1, batch_size * (decoder.block_size + 1) + 1)
        decoder.sps_table = scheduler.SpsTable(batch_size, 0, tuple(n), tuple(1.0 / (n + batch_size)))
    return decoder


def _scheduled(block_size=DRAFT.block_size):
    return dict(
        schedule="confidence",
        temperatures={"greedy": (0.5,) * block_size, "sampling": (2.0,) * block_size},
    )


SCHEDULES = {"fixed": {}, "confidence": _scheduled()}


def _steered(proposer: engine.Proposer, prompts, continuations) -> engine.Proposer:
    """`proposer` with its tokens replaced by the target's greedy continuation of each row's prompt
    (`continuations`, EOS excluded), made wrong at position `(p + 4 cycle + 5 row) mod (S + 2)` (none for
    S and S + 1; `p` the anchor's position): accepted lengths vary between rows and cycles, and every
    length 0..S occurs. Its confidences are replaced too, so that the prefix scheduler verifies
    `(p + 3 cycle + 2 row) mod (S + 1)` proposals; its draft pass and carry run unchanged."""
    width = max(map(len, prompts))
    prompts_NxW = jnp.asarray([[*p, *[0] * (width - len(p))] for p in prompts])  # right-padded, pad 0
    lengths_N = jnp.asarray([len(p) for p in prompts])
    longest = max(map(len, continuations)) + 16
    truth_NxL = jnp.asarray([[*c, *[EOS] * (longest - len(c))] for c in continuations])
    inner = lambda state: state._replace(carry=state.carry[0])

    def init_carry(draft, tokens_BxP, lengths_B):
        k = min(tokens_BxP.shape[1], width)
        same_BxN = jnp.all(tokens_BxP[:, None, :k] == prompts_NxW[None, :, :k], -1)
        row_N_B = jnp.argmax(same_BxN & (lengths_B[:, None] == lengths_N), axis=1)
        return proposer.init_carry(draft, tokens_BxP, lengths_B), truth_NxL[row_N_B]

    def select(draft, frozen, draft_out, state, rng, settings):
        proposals = proposer.select(draft, frozen, draft_out, inner(state), rng, settings)
        b, s = proposals.drafts_BxS.shape
        at_BxS = jnp.minimum(state.count_B[:, None] + jnp.arange(s), longest - 1)  # out slot of each draft
        truth_BxS = jnp.take_along_axis(state.carry[1], at_BxS, axis=1)
        p_B, row_B = state.target_cache.end_B, jnp.arange(b)
        wrong_B = (p_B + 4 * state.cycle + 5 * row_B) % (s + 2)
        drafts_BxS = jnp.where(jnp.arange(s) == wrong_B[:, None], (truth_BxS + 1) % V, truth_BxS)
        # Confidences that make the prefix scheduler verify `(p + 3 cycle + 2 row) mod (S + 1)` proposals.
        sure_B = (p_B + 3 * state.cycle + 2 * row_B) % (s + 1)
        confidence_BxS = jnp.where(jnp.arange(s) < sure_B[:, None], 4.0, -4.0)
        return proposals._replace(
            drafts_BxS=drafts_BxS.astype(proposals.drafts_BxS.dtype), confidence_logit_BxS=confidence_BxS
        )

    def next_carry(draft, state, draft_out, proposals, num_accepted_B):
        carry = proposer.next_carry(draft, inner(state), draft_out, proposals, num_accepted_B)
        return carry, state.carry[1]

    return engine.Proposer(
        lambda draft, frozen, state: proposer.draft_pass(draft, frozen, inner(state)),
        select,
        init_carry,
        next_carry,
    )


def _assert_accepted(report):
    """Drafts were accepted: MAL well above 1, and cycles of many different lengths (1 = none accepted)."""
    lengths = {int(n) for n, c in report["accepted_length_histogram"].items() if c}
    assert report["mal_pooled"] > 1.8, report
    assert len(lengths) >= 4 and max(lengths) > 2, report["accepted_length_histogram"]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize(
    "group, batch_size",
    tiered(
        [("baseline", 1), *((g, 8) for g in GROUPS)],
        fast=[("baseline", 1), ("engram_markov", 8), ("reranker_joint", 8)],
        slow=[("memory_with_memory", 8)],
    ),
    ids=lambda x: str(x),
)
def test_greedy_speculation_with_accepted_drafts_equals_target_greedy(
    parts, mesh1, group, batch_size, schedule
):
    _assert_greedy_lossless(parts, mesh1, group, batch_size, schedule)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize(
    "group, batch_size",
    tiered(
        [
            ("baseline", 1),
            ("baseline", 4),
            ("memory_with_memory", 4),
            ("engram_markov", 4),
            ("reranker_joint", 4),
        ],
        fast=[("baseline", 4), ("memory_with_memory", 4)],
    ),
    ids=lambda x: str(x),
)
def test_greedy_speculation_on_a_hybrid_moe_target_equals_its_greedy(
    hybrid_parts, mesh1, group, batch_size, schedule
):
    """Gated DeltaNet layers have no KV pointer to lower: the verifier keeps each row's states after
    exactly its accepted prefix, whichever proposer drafted the block (baseline, memory, Engram, reranker;
    rows of one batch accept different lengths in the same cycle; the rollback test's hybrid case forces a
    rejection at every position of the block)."""
    _assert_greedy_lossless(hybrid_parts, mesh1, group, batch_size, schedule, check_widths=False)


def _assert_greedy_lossless(parts, mesh1, group, batch_size, schedule, check_widths=True):
    """Speculation with steered drafts emits the target's greedy tokens, accepting many lengths; with
    `check_widths`, the schedule's verified lengths and widths are as designed (the prefix scheduler's
    widths follow the target's profiled throughput)."""
    prompts = PROMPTS * 2
    expected = Generator(parts[0], eos_ids=[EOS], pad_id=0, batch_size=8, mesh=mesh1).generate(
        prompts, max_new_tokens=20
    )
    group_parts, draft, proposer = _group(parts, mesh1, group)
    proposer = _steered(proposer, prompts, expected)
    decoder = _decoder(group_parts, mesh1, batch_size, draft, proposer, **SCHEDULES[schedule])
    assert decoder.generate(prompts, max_new_tokens=20) == expected
    report = decoder.report.as_dict()
    _assert_accepted(report)
    if not check_widths:
        return report
    if schedule == "fixed":
        assert report["mean_verified_length"] == 7 and report["mean_verify_width"] == 8
        if batch_size > 1:
            assert all(report["accepted_length_histogram"][str(n)] for n in range(1, 9)), report
    else:  # each row verifies its own number of proposals
        assert 0 < report["mean_verified_length"] < 7 and 1 <= report["mean_verify_width"] < 8
        assert report["mal_per_verified_token"] > report["mal_pooled"] / 8


def test_reranked_proposals_at_initialisation_are_dspark_s(parts, mesh1):
    """`W_o = 0`: the engine's reranked greedy block equals the plain Markov block; trained, it differs."""
    target, _, frozen = parts
    settings = engine.SpecSettings(8, SamplingParams(), (EOS,), AUX)
    proposer = groups.get("reranker_joint").model.proposer
    blocks = {}
    for trained in (False, True):
        draft = _reranker_draft(mesh1, trained)
        state = engine.prefill(
            target,
            draft,
            jnp.asarray([PROMPTS[2]] * 2),
            jnp.asarray([9, 9]),
            jnp.asarray([True] * 2),
            max_len=64,
            settings=settings,
            rng=jax.random.key(0),
            proposer=proposer,
        )
        h = engine.draft_hidden(draft, frozen, state)
        plain = engine.markov_select(draft, frozen, h, state, jax.random.key(0), settings)
        blocks[trained] = (proposer.select(draft, frozen, h, state, jax.random.key(0), settings), plain)
    np.testing.assert_array_equal(blocks[False][0].drafts_BxS, blocks[False][1].drafts_BxS)
    assert not np.array_equal(blocks[True][0].drafts_BxS, blocks[True][1].drafts_BxS)


@pytest.mark.slow
def test_draft_memory_reaches_the_next_round(parts, mesh1):
    """After a round, the carry holds that round's states; the next draft pass reads them: its states
    differ from a memory-free pass, and the two sources differ from each other."""
    target, _, frozen = parts
    outs = {}
    for source in ("with_memory", "no_memory"):
        draft = _memory_draft(mesh1, source)
        settings = engine.SpecSettings(8, SamplingParams(), (EOS,), AUX)
        state = engine.prefill(
            target,
            draft,
            jnp.asarray([PROMPTS[2]]),
            jnp.asarray([len(PROMPTS[2])]),
            jnp.asarray([True]),
            max_len=64,
            settings=settings,
            rng=jax.random.key(0),
            proposer=MEMORY_PROPOSER,
        )
        first = MEMORY_PROPOSER.draft_pass(draft, frozen, state)
        np.testing.assert_allclose(first["h"], engine.draft_hidden(draft, frozen, state), rtol=1e-6)
        state = engine.cycle(target, draft, frozen, state, settings, MEMORY_PROPOSER)
        assert int(state.carry.matches_B[0]) < 7  # 7 = no last round
        second = MEMORY_PROPOSER.draft_pass(draft, frozen, state)
        assert not np.allclose(second["h"], engine.draft_hidden(draft, frozen, state), atol=1e-4)
        outs[source] = second
    np.testing.assert_allclose(outs["no_memory"]["h"], outs["with_memory"]["h"], rtol=1e-6)
    assert not np.allclose(outs["no_memory"]["source"], outs["with_memory"]["source"], atol=1e-4)


@pytest.mark.slow
def test_statistics_count_real_rows_only_whatever_the_concurrency(parts, mesh1):
    """3 prompts at concurrency 1, 2, 3 and 8: padding rows never enter MAL, histogram or rates."""
    prompts = PROMPTS[:3]
    reports, outputs = [], []
    for concurrency in (1, 2, 3, 8):
        decoder = _decoder(parts, mesh1, concurrency)
        outputs.append(decoder.generate(prompts, max_new_tokens=20))
        report = decoder.report.as_dict()
        reports.append({k: report[k] for k in STAT_KEYS})
    assert all(o == outputs[0] for o in outputs)
    for r in reports[1:]:
        for k in STAT_KEYS:
            if k == "confidence_by_position":  # float32 sums over rows: batch-shape rounding only
                np.testing.assert_allclose(r[k], reports[0][k], rtol=1e-6)
            else:
                assert r[k] == reports[0][k], (k, r[k], reports[0][k])
    hist = reports[0]["accepted_length_histogram"]
    assert reports[0]["requests"] == 3 and sum(hist.values()) == reports[0]["cycles"]
    assert reports[0]["generated_tokens"] == sum(len(o) for o in outputs[0])


STAT_KEYS = (
    "requests",
    "generated_tokens",
    "cycles",
    "mal_pooled",
    "mal_per_request",
    "accepted_length_histogram",
    "acceptance_by_position",
    "confidence_by_position",
)


def _forced(tokens_BxS):
    """A proposer that returns fixed drafts (uniform draft logits; greedy acceptance ignores them)."""

    def select(draft, frozen, draft_out, state, rng, params):
        b, s = tokens_BxS.shape
        return engine.Proposals(tokens_BxS, jnp.zeros((b, s, V)), jnp.zeros((b, s)))

    return engine.Proposer(lambda draft, frozen, state: (), select)


def _slots_major(buffers, axes=(0, 2, 1, 3)):
    """Attention cache buffers as `[B, T, G, D]`, the slots where `_assert_close_rows` cuts: values
    `[B, G, T, D]` by default, keys `[B, G, D, T]` with `axes=(0, 3, 1, 2)`."""
    return [np.asarray(b).transpose(axes) for b in buffers]


def _assert_close_rows(got, want, row, end, what):
    """Row `row` of each cache buffer in `got` equals row 0 of `want`'s (first `end` slots when given)."""
    for k, (g, w) in enumerate(zip(got, want)):
        g, w = np.asarray(g[row]), np.asarray(w[0])
        if end is not None:
            g, w = g[:end], w[:end]
        np.testing.assert_allclose(
            g, w, rtol=1e-4, atol=1e-4 * max(1.0, np.abs(w).max()), err_msg=f"{what} {k}"
        )


@pytest.mark.parametrize("kind", [pytest.param("dense", marks=pytest.mark.slow), "hybrid"])
def test_rollback_leaves_caches_equal_to_a_fresh_prefill(request, mesh1, kind):
    """Three rows accept different numbers of forced drafts in the same cycles, every number 0..7 once
    over three cycles (a rejection at every position of the block); after every cycle each row's target
    caches (KV of the attention layers, conv windows and recurrent states of the Gated DeltaNet layers)
    and draft caches equal a fresh prefill of what it has processed."""
    target, draft, frozen = request.getfixturevalue({"dense": "parts", "hybrid": "hybrid_parts"}[kind])
    prompts = [[5, 9, 11, 7], [20, 21, 22, 23, 24, 25], [1, 2]]
    plan_CxB = [(0, 3, 6), (7, 1, 4), (2, 5, 0)]  # accepted drafts of each row in each cycle
    assert sorted(n for plan in plan_CxB for n in plan) == [0, 0, 1, 2, 3, 4, 5, 6, 7]
    b, width = len(prompts), 8
    settings = engine.SpecSettings(64, SamplingParams(), (EOS,), AUX)
    state = engine.prefill(
        target,
        draft,
        jnp.asarray([[*p, *[0] * (width - len(p))] for p in prompts]),
        jnp.asarray([len(p) for p in prompts]),
        jnp.asarray([True] * b),
        max_len=64,
        settings=settings,
        rng=jax.random.key(0),
    )
    # The target's own greedy continuations, to force each row's planned number of accepted drafts.
    greedy = Generator(target, eos_ids=[-1 % V], pad_id=0, batch_size=b, mesh=mesh1).generate(
        prompts, max_new_tokens=40
    )
    emitted = [[int(state.pending_B[row])] for row in range(b)]
    assert [e[0] for e in emitted] == [g[0] for g in greedy]
    for plan_B in plan_CxB:
        done_B = [len(e) for e in emitted]
        drafts_BxS = []
        for row, accepted in enumerate(plan_B):
            drafts = greedy[row][done_B[row] : done_B[row] + 7]
            if accepted < 7:
                drafts[accepted] = (drafts[accepted] + 1) % V
            drafts_BxS.append(drafts)
        state = engine.cycle(target, draft, frozen, state, settings, _forced(jnp.asarray(drafts_BxS)))
        cache = state.target_cache
        for row, accepted in enumerate(plan_B):
            count = int(state.count_B[row])
            emitted[row] = [int(t) for t in state.out_BxO[row, :count]]
            assert count == done_B[row] + accepted + 1 and emitted[row] == greedy[row][:count]
            # Fresh prefill of everything the row's target processed: prompt + all emitted but the pending.
            processed = [*prompts[row], *emitted[row][:-1]]
            end = int(cache.end_B[row])
            assert end == len(processed)
            fresh_cache = DecodeCache.zeros(target.cfg, 1, 64, target.dtype)
            fresh = target(jnp.asarray([processed]), cache=fresh_cache, aux_layer_ids=AUX)
            _assert_close_rows(
                _slots_major(cache.k_BxGxDxT, axes=(0, 3, 1, 2)),
                _slots_major(fresh.cache.k_BxGxDxT, axes=(0, 3, 1, 2)),
                row,
                end,
                "keys of attention layer",
            )
            _assert_close_rows(
                _slots_major(cache.v_BxGxTxD),
                _slots_major(fresh.cache.v_BxGxTxD),
                row,
                end,
                "values of attention layer",
            )
            for k, (got, want) in enumerate(zip(cache.linear, fresh.cache.linear)):
                _assert_close_rows(got, want, row, None, f"linear layer {k}: state")
            assert len(cache.linear) == (2 if kind == "hybrid" else 0)
            fresh_kv = draft.context_kv(draft.context(fresh.aux_BxTxAxH))
            _assert_close_rows(state.draft_k, [k for k, _ in fresh_kv], row, end, "draft keys of layer")
            _assert_close_rows(state.draft_v, [v for _, v in fresh_kv], row, end, "draft values of layer")


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize(
    "group, draft_len",
    tiered(
        [
            ("baseline", 1),
            ("baseline", 3),
            ("memory_with_memory", 2),
            ("engram_markov", 2),
            ("reranker_joint", 2),
        ],
        fast=[("baseline", 1), ("baseline", 3), ("memory_with_memory", 2)],
    ),
    ids=lambda x: str(x),
)
def test_a_shorter_block_drafts_and_verifies_only_its_first_proposals_losslessly(
    parts, mesh1, group, draft_len, schedule
):
    """`draft_len = L`: every cycle selects and verifies at most the block's first `L` proposals (a
    verification of at most `L + 1` tokens), accepted lengths vary up to `L + 1` (all `L` accepted), and
    the output is still the target's greedy one."""
    prompts = PROMPTS * 2
    expected = Generator(parts[0], eos_ids=[EOS], pad_id=0, batch_size=8, mesh=mesh1).generate(
        prompts, max_new_tokens=20
    )
    group_parts, draft, proposer = _group(parts, mesh1, group)
    steered = _steered(proposer, prompts, expected)
    decoder = _decoder(group_parts, mesh1, 8, draft, steered, draft_len=draft_len, **SCHEDULES[schedule])
    assert decoder.generate(prompts, max_new_tokens=20) == expected
    report = decoder.report.as_dict()
    hist = {int(n) for n, c in report["accepted_length_histogram"].items() if c}
    acceptance = np.asarray(report["acceptance_by_position"])
    assert max(hist) <= draft_len + 1 and not acceptance[draft_len:].any(), report
    if schedule == "fixed":
        assert draft_len + 1 in hist and len(hist) >= min(draft_len + 1, 3), report[
            "accepted_length_histogram"
        ]
        assert report["mean_verified_length"] == draft_len and report["mean_verify_width"] == draft_len + 1
    else:
        assert 0 < report["mean_verified_length"] < draft_len and report["mean_verify_width"] <= draft_len + 1


def test_bad_inputs(parts, mesh1):
    other = DSparkDraft(DraftConfig(**{**DRAFT.__dict__, "hidden_size": 16}), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="hidden_size: draft 16, target 32"):
        _decoder(parts, mesh1, 1, draft=other)
    other = DSparkDraft(DraftConfig(**{**DRAFT.__dict__, "vocab_size": 50}), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="vocab_size: draft 50, target 48"):
        _decoder(parts, mesh1, 1, draft=other)
    with pytest.raises(ValueError, match=r"draft_len must be in 0..7 \(0 = the whole block\), got 8"):
        _decoder(parts, mesh1, 1, draft_len=8)
    decoder = _decoder(parts, mesh1, 1)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        decoder.generate([[1], []], max_new_tokens=4)
    with pytest.raises(ValueError, match="prompt 0 has 250 tokens"):
        decoder.generate([[1] * 250], max_new_tokens=4)


@pytest.mark.slow
@pytest.mark.parametrize("concurrency", tiered([1, 8], slow=[1]))
def test_greedy_lossless_on_the_demo_target(mesh1, concurrency):
    """SmolLM2 with a (random-init) demo-shaped draft: output equals target-only greedy on GSM8K prompts."""
    from configs import baseline
    from dspark_jax.data.conversations import GSM8K_VAL256, read_turns_jsonl
    from dspark_jax.target import load_target
    from dspark_jax.target.chat import prompt_ids

    config = draft_state.random_init(baseline.get_config("demo"))
    target = load_target(mesh=mesh1)
    graphdef, params, rest = draft_state.init_draft(config, target.config, mesh1)
    side = target_side.side_from_target(target, mesh1)
    questions = read_turns_jsonl(GSM8K_VAL256)[:8]
    prompts = [
        prompt_ids(target.tokenizer, target.chat_template, [{"role": "user", "content": q[0]}]).tolist()
        for q in questions
    ]
    kw = dict(eos_ids=target.eos_ids, pad_id=target.tokenizer.pad_id, batch_size=concurrency, mesh=mesh1)
    decoder = SpeculativeDecoder(
        target.model, graphdef, params, rest, side.frozen, aux_layer_ids=config.data.aux_layer_ids, **kw
    )
    expected = Generator(target.model, **kw).generate(prompts, max_new_tokens=24)
    assert decoder.generate(prompts, max_new_tokens=24) == expected
