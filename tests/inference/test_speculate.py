"""Speculative decoding: lossless greedy and sampling, cache roll-back, bad inputs (tiny target and draft)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from dspark_jax import experiments, sharding
from dspark_jax.draft.engram import EngramDraftConfig
from dspark_jax.draft.memory import MEMORY_SOURCES, MemoryDraft, MemoryDraftConfig
from dspark_jax.draft.model import DraftConfig, DSparkDraft, FrozenTarget
from dspark_jax.draft.reranker import RerankerDraft, RerankerDraftConfig
from dspark_jax.engram.hashing import HashSpec
from dspark_jax.engram.table import device_table
from dspark_jax.experiments.memory import MEMORY_PROPOSER
from dspark_jax.inference import engine, scheduler
from dspark_jax.inference.decoder import SpeculativeDecoder
from dspark_jax.target.config import TargetConfig
from dspark_jax.target.generate import Generator, SamplingParams
from dspark_jax.target.model import KVCache, Transformer

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


def _scaled(module, mesh, scale):
    graphdef, state = nnx.split(module)
    state = jax.tree.map(lambda x: x * scale if x.ndim >= 2 else x, state)
    return nnx.merge(graphdef, jax.device_put(state, sharding.state_shardings(state, mesh)))


@pytest.fixture(scope="module")
def parts(mesh1):
    target = _scaled(Transformer(TARGET, rngs=nnx.Rngs(0)), mesh1, 8.0)
    draft = _scaled(DSparkDraft(DRAFT, rngs=nnx.Rngs(1)), mesh1, 4.0)
    frozen = FrozenTarget(target.embedding.get_value(), target.lm_head_matrix())
    return target, draft, frozen


def _memory_draft(mesh, source):
    cfg = MemoryDraftConfig(**{**DRAFT.__dict__, "memory_source": source})
    return _scaled(MemoryDraft(cfg, rngs=nnx.Rngs(1)), mesh, 4.0)


ENGRAM_GROUPS = ("engram_markov", "engram_mask_gated", "engram_mask_replace")


def _engram_parts(parts, mesh, group):
    """The parts with a random Engram table (identity compression) and the group's draft, its Engram
    weights made to matter (`W_V` and the gates are zero at initialisation)."""
    target, _, frozen = parts
    spec = HashSpec.create(
        max_order=3, heads=2, head_dim=4, seed=0, layer_id=0, compressed_vocab=V, pad_id=0, table_size=60
    )
    rows = np.random.default_rng(0).normal(size=(spec.num_rows, spec.head_dim))
    cfg = EngramDraftConfig(**DRAFT.__dict__, engram_dim=spec.dim, engram_order=3)
    draft = experiments.get(group).build_draft(cfg, rngs=nnx.Rngs(1))
    for name in ("engram_v", "engram_proj"):
        if hasattr(draft, name):
            layer = getattr(draft, name)
            layer.kernel.set_value(jax.random.normal(jax.random.key(2), layer.kernel.get_value().shape))
    if getattr(draft, "engram_gates", None) is not None:
        draft.engram_gates.set_value(jnp.full(draft.engram_gates.get_value().shape, 0.8))
    frozen = frozen._replace(engram=device_table(spec, np.arange(V), rows))
    return (target, _scaled(draft, mesh, 4.0), frozen)


def _reranker_draft(mesh, trained=True):
    """A reranker draft (16 of 48 candidates); `trained` makes its residual scores matter (`W_o` is zero
    at initialisation)."""
    cfg = RerankerDraftConfig(**DRAFT.__dict__, rerank_width=16, rerank_heads=4, rerank_ffn=64)
    draft = RerankerDraft(cfg, rngs=nnx.Rngs(1))
    if trained:
        w_o = draft.reranker.w_o.kernel
        w_o.set_value(3.0 * jax.random.normal(jax.random.key(5), w_o.get_value().shape))
    return _scaled(draft, mesh, 4.0)


def _decoder(parts, mesh, batch_size, draft=None, proposer=engine.DSPARK_PROPOSER, **kw):
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
        eos_ids=[EOS],
        pad_id=0,
        batch_size=batch_size,
        mesh=mesh,
        **kw,
    )
    if kw.get("schedule") == "confidence":
        # A crafted table instead of the profile: SPS(n) = 1 / (n + rows) admits a proposal while its
        # survival beats tau* / (n + rows), so the verified lengths vary with the confidences.
        n = np.arange(1, batch_size * (DRAFT.block_size + 1) + 1)
        decoder.sps_table = scheduler.SpsTable(batch_size, 0, tuple(n), tuple(1.0 / (n + batch_size)))
    return decoder


SCHEDULED = dict(schedule="confidence", temperatures={"greedy": (0.5,) * 7, "sampling": (2.0,) * 7})


@pytest.mark.parametrize("batch_size", [1, 4])
def test_greedy_speculation_with_the_prefix_scheduler_equals_target_greedy(parts, mesh1, batch_size):
    expected = Generator(parts[0], eos_ids=[EOS], pad_id=0, batch_size=4, mesh=mesh1).generate(
        PROMPTS, max_new_tokens=20
    )
    decoder = _decoder(parts, mesh1, batch_size, **SCHEDULED)
    assert decoder.generate(PROMPTS, max_new_tokens=20) == expected
    report = decoder.report.as_dict()
    assert 0 < report["mean_verified_length"] < 7 and 1 <= report["mean_verify_width"] < 8
    assert report["mal_per_verified_token"] > report["mal_pooled"] / 8
    fixed = _decoder(parts, mesh1, batch_size)
    fixed.generate(PROMPTS, max_new_tokens=20)
    assert (
        fixed.report.as_dict()["mean_verified_length"] == 7
        and fixed.report.as_dict()["mean_verify_width"] == 8
    )


@pytest.mark.parametrize("batch_size", [1, 4])
def test_greedy_speculation_equals_target_greedy(parts, mesh1, batch_size):
    expected = Generator(parts[0], eos_ids=[EOS], pad_id=0, batch_size=4, mesh=mesh1).generate(
        PROMPTS, max_new_tokens=20
    )
    decoder = _decoder(parts, mesh1, batch_size)
    assert decoder.generate(PROMPTS, max_new_tokens=20) == expected
    report = decoder.report.as_dict()
    assert report["cycles"] > 0 and 1.0 <= report["mal_pooled"] <= 8.0


@pytest.mark.parametrize("source", MEMORY_SOURCES)
@pytest.mark.parametrize("batch_size", [1, 8])
def test_greedy_speculation_with_draft_memory_equals_target_greedy(parts, mesh1, source, batch_size):
    prompts = PROMPTS * 2
    expected = Generator(parts[0], eos_ids=[EOS], pad_id=0, batch_size=8, mesh=mesh1).generate(
        prompts, max_new_tokens=20
    )
    decoder = _decoder(parts, mesh1, batch_size, _memory_draft(mesh1, source), MEMORY_PROPOSER)
    assert decoder.generate(prompts, max_new_tokens=20) == expected
    assert decoder.report.as_dict()["cycles"] > len(prompts)  # later rounds read memory


@pytest.mark.parametrize("group", ENGRAM_GROUPS)
@pytest.mark.parametrize("batch_size", [1, 8])
def test_greedy_speculation_with_engram_equals_target_greedy(parts, mesh1, group, batch_size):
    prompts = PROMPTS * 2
    expected = Generator(parts[0], eos_ids=[EOS], pad_id=0, batch_size=8, mesh=mesh1).generate(
        prompts, max_new_tokens=20
    )
    engram_parts = _engram_parts(parts, mesh1, group)
    decoder = _decoder(engram_parts, mesh1, batch_size, proposer=experiments.get(group).proposer)
    assert decoder.generate(prompts, max_new_tokens=20) == expected
    assert decoder.report.as_dict()["cycles"] > len(prompts)


@pytest.mark.parametrize("batch_size", [1, 8])
def test_greedy_speculation_with_the_reranker_equals_target_greedy(parts, mesh1, batch_size):
    prompts = PROMPTS * 2
    expected = Generator(parts[0], eos_ids=[EOS], pad_id=0, batch_size=8, mesh=mesh1).generate(
        prompts, max_new_tokens=20
    )
    proposer = experiments.get("reranker_joint").proposer
    decoder = _decoder(parts, mesh1, batch_size, _reranker_draft(mesh1), proposer)
    assert decoder.generate(prompts, max_new_tokens=20) == expected


def test_reranked_proposals_at_initialisation_are_dspark_s(parts, mesh1):
    """`W_o = 0`: the engine's reranked greedy block equals the plain Markov block; trained, it differs."""
    target, _, frozen = parts
    settings = engine.SpecSettings(8, SamplingParams(), (EOS,), AUX)
    proposer = experiments.get("reranker_joint").proposer
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


def test_rollback_leaves_caches_equal_to_a_fresh_prefill(parts, mesh1):
    target, draft, frozen = parts
    prompt = jnp.asarray([[5, 9, 11, 7, 0, 0, 0, 0]])
    settings = engine.SpecSettings(64, SamplingParams(), (EOS,), AUX)
    state = engine.prefill(
        target,
        draft,
        prompt,
        jnp.asarray([4]),
        jnp.asarray([True]),
        max_len=64,
        settings=settings,
        rng=jax.random.key(0),
    )
    # The target's own greedy continuation, to force exactly 3 accepted drafts, then 0, then 7.
    greedy = Generator(target, eos_ids=[-1 % V], pad_id=0, batch_size=1, mesh=mesh1).generate(
        [[5, 9, 11, 7]], max_new_tokens=40
    )[0]
    emitted = [int(state.pending_B[0])]
    assert emitted[0] == greedy[0]
    for accepted in (3, 0, 7):
        done = len(emitted)
        drafts = greedy[done : done + 7]
        if accepted < 7:
            drafts[accepted] = (drafts[accepted] + 1) % V
        state = engine.cycle(target, draft, frozen, state, settings, _forced(jnp.asarray([drafts])))
        count = int(state.count_B[0])
        emitted = [int(t) for t in state.out_BxO[0, :count]]
        assert count == done + accepted + 1 and emitted == greedy[:count]
        # Fresh prefill of everything the target has processed: prompt + all emitted but the pending token.
        processed = [5, 9, 11, 7, *emitted[:-1]]
        end = int(state.target_cache.end_B[0])
        assert end == len(processed)
        fresh_cache = KVCache.zeros(target.cfg, 1, 64, target.dtype)
        fresh = target(jnp.asarray([processed]), cache=fresh_cache, aux_layer_ids=AUX)
        for got, want in zip(
            state.target_cache.k_BxTxGxD + state.target_cache.v_BxTxGxD,
            fresh.cache.k_BxTxGxD + fresh.cache.v_BxTxGxD,
        ):
            np.testing.assert_allclose(np.asarray(got[0, :end]), np.asarray(want[0, :end]), atol=1e-5)
        fresh_kv = draft.context_kv(draft.context(fresh.aux_BxTxAxH))
        for (k, v), got_k, got_v in zip(fresh_kv, state.draft_k, state.draft_v):
            np.testing.assert_allclose(np.asarray(got_k[0, :end]), np.asarray(k[0]), atol=1e-5)
            np.testing.assert_allclose(np.asarray(got_v[0, :end]), np.asarray(v[0]), atol=1e-5)


def _chi_square_pvalue(tokens, probs_V):
    expected = probs_V / probs_V.sum() * len(tokens)
    big = expected > 5
    observed = np.bincount(tokens, minlength=V)
    chi = stats.chisquare(
        np.r_[observed[big], observed[~big].sum()], np.r_[expected[big], expected[~big].sum()]
    )
    return chi.pvalue


@pytest.mark.parametrize("group", ["baseline", "scheduled", "memory", *ENGRAM_GROUPS, "reranker_joint"])
def test_sampling_is_lossless(parts, mesh1, group):
    """The second and third generated tokens follow the target's distributions (the third one's cycle
    reads, with Draft Memory, the memory of the cycle that decided the second). 'scheduled' is the
    baseline under the prefix scheduler: each row verifies its own number of proposals."""
    target = parts[0]
    prompt = [5, 9, 11, 7]
    params = SamplingParams(temperature=1.0)
    rows = 1024
    if group == "memory":
        decoder = _decoder(parts, mesh1, rows, _memory_draft(mesh1, "with_memory"), MEMORY_PROPOSER)
    elif group == "reranker_joint":
        decoder = _decoder(parts, mesh1, rows, _reranker_draft(mesh1), experiments.get(group).proposer)
    elif group in ENGRAM_GROUPS:
        decoder = _decoder(
            _engram_parts(parts, mesh1, group), mesh1, rows, proposer=experiments.get(group).proposer
        )
    else:
        decoder = _decoder(parts, mesh1, rows, **(SCHEDULED if group == "scheduled" else {}))
    outs = decoder.generate([prompt] * rows, max_new_tokens=3, params=params, seed=3)
    if group == "scheduled":
        assert 0 < decoder.report.as_dict()["mean_verified_length"] < 7
    forward = jax.jit(lambda ids: jax.nn.softmax(target.logits(target(ids).hidden_BxTxH[:, -1])))
    p1_V = np.asarray(forward(jnp.asarray([prompt])))[0].astype(np.float64)
    p2_VxV = np.asarray(forward(jnp.asarray([[*prompt, t] for t in range(V)]))).astype(np.float64)
    pairs = [[*prompt, t1, t2] for t1 in range(V) for t2 in range(V)]
    p3_VxVxV = np.asarray(forward(jnp.asarray(pairs))).astype(np.float64).reshape(V, V, V)
    alive_V = np.arange(V) != EOS  # a row stops at EOS and emits nothing after it
    p12_VxV = p1_V[:, None] * p2_VxV * alive_V[:, None]
    second_V = p12_VxV.sum(0) * alive_V
    third_V = np.einsum("ab,abc->c", p12_VxV * alive_V[None, :], p3_VxVxV) * alive_V
    seconds = [o[1] for o in outs if len(o) > 1]
    thirds = [o[2] for o in outs if len(o) > 2]
    assert _chi_square_pvalue(seconds, second_V) > 1e-3
    assert _chi_square_pvalue(thirds, third_V) > 1e-3


def test_bad_inputs(parts, mesh1):
    other = DSparkDraft(DraftConfig(**{**DRAFT.__dict__, "hidden_size": 16}), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="hidden_size: draft 16, target 32"):
        _decoder(parts, mesh1, 1, draft=other)
    other = DSparkDraft(DraftConfig(**{**DRAFT.__dict__, "vocab_size": 50}), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="vocab_size: draft 50, target 48"):
        _decoder(parts, mesh1, 1, draft=other)
    decoder = _decoder(parts, mesh1, 1)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        decoder.generate([[1], []], max_new_tokens=4)
    with pytest.raises(ValueError, match="prompt 0 has 250 tokens"):
        decoder.generate([[1] * 250], max_new_tokens=4)


@pytest.mark.slow
@pytest.mark.parametrize("concurrency", [1, 8])
def test_greedy_lossless_on_the_demo_target(mesh1, concurrency):
    """SmolLM2 with a (random-init) demo-shaped draft: output equals target-only greedy on GSM8K prompts."""
    from configs import baseline
    from dspark_jax.data.conversations import GSM8K_VAL256, read_turns_jsonl
    from dspark_jax.target import load_target
    from dspark_jax.target.chat import prompt_ids
    from dspark_jax.train import components

    config = baseline.get_config("demo")
    target = load_target(mesh=mesh1)
    graphdef, params, rest = components.init_draft(config, target.config, mesh1)
    side = components.side_from_target(target, mesh1)
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
