"""Speculative decoding with a DSpark draft and real target verification, batched under `jax.jit`.

Per request, `p` tokens have target states in both caches and the next token `x[p]` is
known but not yet fed to the target. One cycle:

1. draft: one backbone pass over the block `[E(x[p]), MASK x 6]` at positions `p..p+6`,
   attending to the cached draft context `j < p` (docs/design.md section 1 at inference);
2. select: the Markov head picks `d_1..d_7` one by one, each from its own corrected logits
   given the previous choice (greedy, or sampled with temperature / top-p); with
   `select_top_k = K` the correction is computed for the K best base logits of each slot only
   (the choice is then among those K: still lossless, the target decides what is emitted);
   `draft_len = L` selects the first `L` slots only: a shorter block, for hardware where a verification
   forward's cost grows fast with its width (e.g. a CPU); a draft vocabulary (`FrozenTarget.draft_vocab`)
   restricts the choices to its `K` tokens, so the selection reads `K` of the LM head's `V` columns;
3. schedule: how many proposals `l` each row verifies: all of them (`fixed`), or the prefix scheduler's
   choice from the calibrated confidences (`confidence`, `dspark_jax.inference.scheduler`);
4. verify: the target runs `[x[p], d_1..d_l]` in one forward with its KV cache (a padded bucket width
   under the scheduler);
5. accept: exact match (greedy) or lossless rejection sampling over the `l` verified proposals; `m`
   accepted drafts plus one target token (the correction, or the bonus after `l` accepted) are emitted;
6. roll back: the target cache keeps `p + m + 1` tokens; the draft context gains the target
   states of positions `p..p+m`; the next anchor is the emitted target token.

Rows advance independently (per-row cache lengths); the whole decode is one `while_loop`.
Prompts are right-padded, so cache slots equal positions.

Steps 1-2 belong to the experiment group: a `Proposer` (registered with the group in
`dspark_jax.experiments`) makes the block and may carry per-request state across cycles
(e.g. the last round's hidden states, or the request's recent tokens).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.draft.model import DraftMemory, DSparkDraft, FrozenTarget, vocab_columns
from dspark_jax.inference import scheduler
from dspark_jax.inference.acceptance import accept_greedy, accept_sampling
from dspark_jax.target.generate import SamplingParams, sample
from dspark_jax.target.model import DecodeCache, Transformer, keep_prefix


@dataclasses.dataclass(frozen=True)
class SpecSettings:
    """Static settings of a compiled speculative program."""

    max_new_tokens: int
    params: SamplingParams
    eos_ids: tuple[int, ...]
    aux_layer_ids: tuple[int, ...]
    select_top_k: int = 0  # selection among each slot's top-K base logits; 0 = the whole vocabulary
    confidence_temperatures: tuple[float, ...] | None = None  # STS temperature per proposal; None = 1
    verify_buckets: tuple[int, ...] | None = None  # the confidence schedule's verify widths; None = fixed
    draft_len: int = 0  # proposals drafted per cycle, the block's first `draft_len` slots; 0 = all `S`


class SpecState(NamedTuple):
    """Loop state; `B` rows, `T` cache slots, `O` output slots (the legend in `dspark_jax/__init__.py`)."""

    cycle: jax.Array
    target_cache: DecodeCache
    draft_k: tuple[jax.Array, ...]  # per draft layer [B, T, G, D]
    draft_v: tuple[jax.Array, ...]
    pending_B: jax.Array  # x[p], the next token not yet fed to the target
    out_BxO: jax.Array
    count_B: jax.Array  # tokens emitted so far (EOS included)
    done_B: jax.Array
    rng: jax.Array
    stats: dict[str, jax.Array]
    carry: Any  # the proposer's per-request state


class Proposals(NamedTuple):
    """A block of `S` proposals per row: tokens, the logits they were drawn from, the confidence head's
    logits (proposal `i` accepted given the ones before it)."""

    drafts_BxS: jax.Array
    logits_BxSxV: jax.Array
    confidence_logit_BxS: jax.Array


class Proposer(NamedTuple):
    """How an experiment group drafts a block at inference, in two phases timed apart.

    draft_pass(draft, frozen, state) -> draft output (a pytree; the baseline's final states `h`)
    select(draft, frozen, draft_out, state, rng, settings) -> `Proposals` (`settings`: `SpecSettings`)
    init_carry(draft, tokens_BxP, lengths_B) -> per-request state carried across cycles (`()` for none),
      from the right-padded prompts
    next_carry(draft, state, draft_out, proposals, num_accepted_B) -> the carry of the next cycle (`state`
      is the cycle's own state: `state.carry` the current carry, `~state.done_B` the rows that cycled)
    """

    draft_pass: Callable
    select: Callable
    init_carry: Callable = lambda draft, tokens_BxP, lengths_B: ()
    next_carry: Callable = lambda draft, state, draft_out, proposals, num_accepted_B: state.carry


def _write_rows(buffer, new, start_B):
    """Writes `new` `[B, count, ...]` into each row of `buffer` `[B, slots, ...]` at that row's offset.

    `buffer` holds cache slots (`T`) or output slots (`O`); row `b` gets `new[b]` at slots
    `start_B[b] ..`; slots past the buffer's end are dropped.
    """
    rows_Bx1 = jnp.arange(buffer.shape[0])[:, None]
    slots_BxT = start_B[:, None] + jnp.arange(new.shape[1])
    return buffer.at[rows_Bx1, slots_BxT].set(new.astype(buffer.dtype), mode="drop")


def append_context(draft: DSparkDraft, draft_k, draft_v, aux_BxTxAxH, start_B):
    """Adds the draft context keys/values of target states at positions `start .. start + T - 1`."""
    positions_BxT = start_B[:, None] + jnp.arange(aux_BxTxAxH.shape[1])
    kvs = draft.context_kv(draft.context(aux_BxTxAxH.astype(draft.dtype)), positions_BxT)
    new_k = tuple(_write_rows(buf, k, start_B) for buf, (k, _) in zip(draft_k, kvs))
    new_v = tuple(_write_rows(buf, v, start_B) for buf, (_, v) in zip(draft_v, kvs))
    return new_k, new_v


def draft_hidden(
    draft: DSparkDraft,
    frozen: FrozenTarget,
    state: SpecState,
    x_Bx1xSxH: jax.Array | None = None,
    memory: DraftMemory | None = None,
) -> jax.Array:
    """Draft states `h [B, S, H]` of the block anchored at `p` (context `j < p`) from its inputs
    `x_Bx1xSxH` (default the draft's `block_inputs` of `x[p]`); `memory` of one block per row,
    `[B, 1, M, ...]`, is the attention's memory operand (`[context; memory; block]`)."""
    if x_Bx1xSxH is None:
        x_Bx1xSxH = draft.block_inputs(frozen, state.pending_B[:, None])
    ctx_kvs = list(zip(state.draft_k, state.draft_v))
    return draft.backbone(x_Bx1xSxH, ctx_kvs, state.target_cache.end_B[:, None], memory)[:, 0]


def candidates(
    draft: DSparkDraft, frozen: FrozenTarget, h_BxSxH, top_k: int
) -> tuple[jax.Array, jax.Array | None]:
    """Each slot's candidate tokens and their base logits, from one pass over the LM head for the block:
    `(base [B, S, C], ids [B, S, C])`, `C` = the vocabulary `V` (ids None: all of it, in order), the draft
    vocabulary's tokens (`frozen.draft_vocab`: its columns of the head only) or, with `top_k = K`, the `K`
    best of those."""
    base_BxSxC, ids_C = draft.base_logits(frozen, h_BxSxH), vocab_columns(frozen)
    if not top_k:
        return base_BxSxC, None if ids_C is None else jnp.broadcast_to(ids_C, base_BxSxC.shape)
    top = jax.lax.top_k(base_BxSxC, min(top_k, base_BxSxC.shape[-1]))
    # XLA:CPU lowers top_k to a sort and would repeat it for every slot that reads a slice of it.
    base_BxSxK, index_BxSxK = jax.lax.optimization_barrier(top)
    return base_BxSxK, index_BxSxK if ids_C is None else ids_C[index_BxSxK]


def markov_select(
    draft: DSparkDraft,
    frozen: FrozenTarget,
    h_BxSxH,
    state: SpecState,
    rng,
    settings: SpecSettings,
    markov_features: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
    rescore: Callable | None = None,
) -> Proposals:
    """Sequential Markov selection: each slot's token from its corrected logits given the previous choice.

    `markov_features(h_BxH, token_B)`, called once per slot in order with that slot's state and
    predecessor (the anchor, then each choice), returns the Markov representation `[B, R]` the
    correction reads (a group's own, e.g. from the drafted prefix); None = the draft's `markov_features`.

    `rescore(i, h_BxH, predecessor_B, logits_BxC, columns_BxC)` (C = V, or K with `select_top_k`;
    `columns` None for the whole vocabulary), called once per slot after the Markov correction, returns
    `(scores_BxK, columns_BxK)`: the slot's candidates and the scores it draws from (a group that rescores
    the candidates).

    With `settings.select_top_k = K` each slot's candidates are its K best base logits and the Markov
    correction reads only their K columns of `W2` (the full `[R, V]` matrix is otherwise read once per
    slot); with a draft vocabulary (`frozen.draft_vocab`) they come from its `K` ids only (`candidates`).
    The proposals' logits are `-inf` outside the candidates, so sampled acceptance uses the distribution
    the token was actually drawn from. With `settings.draft_len = L` only the first `L` slots are selected
    (`Proposals` of `L` columns).
    """
    h_BxSxH = h_BxSxH[:, : settings.draft_len or None]
    token_B = state.pending_B
    vocab = frozen.lm_head_HxV.shape[-1]
    base_BxSxV, columns_BxSxK = candidates(draft, frozen, h_BxSxH, settings.select_top_k)
    drafts, logits, confidence = [], [], []
    for i in range(h_BxSxH.shape[1]):
        columns = None if columns_BxSxK is None else columns_BxSxK[:, i]
        m_BxR = None if markov_features is None else markov_features(h_BxSxH[:, i], token_B)
        out = draft.corrected(base_BxSxV[:, i], h_BxSxH[:, i], token_B, columns, m_BxR)
        scores = out["logits"]
        if rescore is not None:
            scores, columns = rescore(i, h_BxSxH[:, i], token_B, scores, columns)
        choice_B = sample(scores, jax.random.fold_in(rng, i), settings.params)
        if columns is None:
            token_B, logits_BxV = choice_B, scores
        else:
            token_B = jnp.take_along_axis(columns, choice_B[:, None], axis=1)[:, 0]
            rows_Bx1 = jnp.arange(columns.shape[0])[:, None]
            logits_BxV = jnp.full((columns.shape[0], vocab), -jnp.inf).at[rows_Bx1, columns].set(scores)
        drafts.append(token_B)
        logits.append(logits_BxV)
        confidence.append(out["confidence_logit"])
    return Proposals(jnp.stack(drafts, 1), jnp.stack(logits, 1), jnp.stack(confidence, 1))


DSPARK_PROPOSER = Proposer(draft_hidden, markov_select)


def where_active(state: SpecState, new_carry):
    """`new_carry` on the rows that cycled in `state`, the old carry on finished rows."""
    active_B = ~state.done_B
    pick = lambda n, o: jnp.where(active_B.reshape(-1, *[1] * (n.ndim - 1)), n, o)
    return jax.tree.map(pick, new_carry, state.carry)


def prefill(
    target: Transformer,
    draft: DSparkDraft,
    tokens_BxP,
    lengths_B,
    real_B,
    *,
    max_len: int,
    settings: SpecSettings,
    rng,
    proposer: Proposer = DSPARK_PROPOSER,
):
    """Target prefill of right-padded prompts; returns the first loop state (first token emitted).

    Padding rows (`real_B` False) start done: they never cycle and never count in the statistics.
    """
    b, p = tokens_BxP.shape
    cache = DecodeCache.zeros(target.cfg, b, max_len, target.dtype)
    valid_BxP = jnp.arange(p) < lengths_B[:, None]
    out = target(tokens_BxP, cache=cache, valid_BxT=valid_BxP, aux_layer_ids=settings.aux_layer_ids)
    cache = out.cache._replace(end_B=lengths_B.astype(jnp.int32))
    last_BxH = out.hidden_BxTxH[jnp.arange(b), lengths_B - 1]
    first_B = sample(target.logits(last_BxH), jax.random.fold_in(rng, 0), settings.params)
    shape = (b, max_len, draft.cfg.num_kv_heads, draft.cfg.head_dim)
    zeros = tuple(jnp.zeros(shape, draft.dtype) for _ in draft.layers)
    draft_k, draft_v = append_context(draft, zeros, zeros, out.aux_BxTxAxH, jnp.zeros((b,), jnp.int32))
    s = draft.cfg.block_size
    out_BxO = jnp.full((b, settings.max_new_tokens + s + 1), -1, jnp.int32).at[:, 0].set(first_B)
    eos = jnp.asarray(settings.eos_ids, jnp.int32)
    stats = {
        "cycles_B": jnp.zeros((b,), jnp.int32),
        "accepted_len_B": jnp.zeros((b,), jnp.int32),  # sum over the row's cycles of m + 1
        "accepted_hist": jnp.zeros((s + 2,), jnp.int32),  # index = accepted length m + 1
        "reached_S": jnp.zeros((s,), jnp.int32),  # proposal i was verified
        "accepted_S": jnp.zeros((s,), jnp.int32),  # proposal i was accepted
        "confidence_S": jnp.zeros((s,), jnp.float32),  # sum of predicted acceptance over reached proposals
        "verified_B": jnp.zeros((b,), jnp.int32),  # sum over the row's cycles of the proposals verified
        "verify_width": jnp.int32(0),  # sum over loop iterations of the (padded) verification width
    }
    return SpecState(
        jnp.int32(0),
        cache,
        draft_k,
        draft_v,
        first_B,
        out_BxO,
        jnp.ones((b,), jnp.int32),
        jnp.isin(first_B, eos) | (settings.max_new_tokens <= 1) | ~real_B,
        rng,
        stats,
        proposer.init_carry(draft, tokens_BxP, lengths_B),
    )


def cycle(
    target: Transformer,
    draft: DSparkDraft,
    frozen: FrozenTarget,
    state: SpecState,
    settings: SpecSettings,
    proposer: Proposer = DSPARK_PROPOSER,
    sps_N: jax.Array | None = None,
) -> SpecState:
    """One draft-select-schedule-verify-accept cycle for every row (finished rows change nothing);
    `sps_N` is the scheduler's throughput table (`confidence` schedule only)."""
    rng = cycle_rng(state)
    draft_out = proposer.draft_pass(draft, frozen, state)
    proposals = proposer.select(draft, frozen, draft_out, state, jax.random.fold_in(rng, 0), settings)
    new_state, num_accepted_B = verify_and_accept(
        target, draft, state, proposals, settings, jax.random.fold_in(rng, 1), sps_N
    )
    carry = proposer.next_carry(draft, state, draft_out, proposals, num_accepted_B)
    return new_state._replace(carry=carry)


def cycle_rng(state: SpecState) -> jax.Array:
    return jax.random.fold_in(state.rng, state.cycle + 1)  # 0 is the prefill's


def confidence(proposals: Proposals, settings: SpecSettings) -> jax.Array:
    """Predicted acceptance `c_i = sigmoid(z_i / T_i)` of each proposal, f32 `[B, S]` (STS temperatures)."""
    logits_BxS = proposals.confidence_logit_BxS.astype(jnp.float32)
    if settings.confidence_temperatures is not None:
        temperatures_S = jnp.asarray(settings.confidence_temperatures, jnp.float32)
        logits_BxS = logits_BxS / temperatures_S[: logits_BxS.shape[1]]  # the first `draft_len` proposals
    return jax.nn.sigmoid(logits_BxS)


def verify_lengths(
    confidence_BxS: jax.Array, active_B: jax.Array, settings: SpecSettings, sps_N
) -> jax.Array:
    """Proposals each row verifies this cycle: all `S` (fixed schedule) or the prefix scheduler's choice
    from the calibrated confidences."""
    b, s = confidence_BxS.shape
    if settings.verify_buckets is None:
        return jnp.full((b,), s, jnp.int32)
    return scheduler.schedule_lengths(jnp.cumprod(confidence_BxS, axis=1), active_B, sps_N)


def verify_forward(target: Transformer, tokens_BxS1, cache: DecodeCache, settings: SpecSettings, width: int):
    """Target forward of the first `width` tokens of each row: logits `[B, S+1, V]`, aux states and the
    output (its cache and the linear layers' per-token states), zero-padded past `width` (those
    positions are never read: at most `width - 1` are verified)."""
    out = target(tokens_BxS1[:, :width], cache=cache, aux_layer_ids=settings.aux_layer_ids, keep_steps=True)
    pad = lambda x: jnp.pad(x, [(0, 0), (0, tokens_BxS1.shape[1] - width)] + [(0, 0)] * (x.ndim - 2))
    steps = tuple(step.padded(tokens_BxS1.shape[1]) for step in out.steps)
    return pad(target.logits(out.hidden_BxTxH)), pad(out.aux_BxTxAxH), (out.cache, steps)


def verify_and_accept(
    target: Transformer,
    draft: DSparkDraft,
    state: SpecState,
    proposals: Proposals,
    settings: SpecSettings,
    rng,
    sps_N: jax.Array | None = None,
) -> tuple[SpecState, jax.Array]:
    """Scheduling, target verification of the proposals, acceptance, emission and cache roll-back.

    Returns the next state and the number of accepted proposals per row. The proposals may be fewer than
    the block's slots (`SpecSettings.draft_len`); the per-position statistics keep the block's length.
    """
    drafts_BxS, draft_logits, _ = proposals
    p_B = state.target_cache.end_B
    active_B = ~state.done_B
    s = drafts_BxS.shape[1]
    confidence_BxS = confidence(proposals, settings)
    lengths_B = verify_lengths(confidence_BxS, active_B, settings, sps_N)
    tokens_BxS1 = jnp.concatenate([state.pending_B[:, None], drafts_BxS], 1)
    forward = functools.partial(verify_forward, target, tokens_BxS1, state.target_cache, settings)
    if settings.verify_buckets is None:
        width = jnp.int32(s + 1)
        target_logits, aux_BxS1xAxH, verified = forward(s + 1)
    else:
        index = scheduler.bucket_index(lengths_B, active_B, settings.verify_buckets)
        width = jnp.asarray(settings.verify_buckets, jnp.int32)[index]
        branches = [functools.partial(forward, w) for w in settings.verify_buckets]
        target_logits, aux_BxS1xAxH, verified = jax.lax.switch(index, branches)
    if settings.params.temperature == 0:
        m_B, next_B = accept_greedy(drafts_BxS, target_logits, lengths_B)
    else:
        m_B, next_B = accept_sampling(
            drafts_BxS, draft_logits, target_logits, rng, settings.params, lengths_B
        )
    # Emit d_1..d_m and the target token.
    positions_S1 = jnp.arange(s + 1)
    emitted_BxS1 = jnp.where(positions_S1 < m_B[:, None], jnp.pad(drafts_BxS, ((0, 0), (0, 1))), 0)
    emitted_BxS1 = jnp.where(positions_S1 == m_B[:, None], next_B[:, None], emitted_BxS1)
    room_B = settings.max_new_tokens - state.count_B
    n_emit_B = jnp.where(active_B, jnp.minimum(m_B + 1, room_B), 0)
    keep = positions_S1 < n_emit_B[:, None]
    eos = jnp.asarray(settings.eos_ids, jnp.int32)
    hit_eos = jnp.any(keep & jnp.isin(emitted_BxS1, eos), axis=1)
    out_BxO = _write_rows(state.out_BxO, jnp.where(keep, emitted_BxS1, -1), state.count_B)
    out_BxO = jnp.where(active_B[:, None], out_BxO, state.out_BxO)
    # Roll the target cache back to the accepted prefix; extend the draft context with it.
    end_B = jnp.where(active_B, p_B + m_B + 1, p_B)
    target_cache = keep_prefix(state.target_cache, *verified, end_B)
    draft_k, draft_v = append_context(draft, state.draft_k, state.draft_v, aux_BxS1xAxH, p_B)
    verified_BxS = jnp.arange(s) < lengths_B[:, None]
    reached_BxS = active_B[:, None] & (jnp.arange(s) <= m_B[:, None]) & verified_BxS
    to_block = lambda x_S: jnp.pad(x_S, (0, state.stats["reached_S"].shape[0] - s))
    stats = {
        "cycles_B": state.stats["cycles_B"] + active_B,
        "accepted_len_B": state.stats["accepted_len_B"] + jnp.where(active_B, m_B + 1, 0),
        "accepted_hist": state.stats["accepted_hist"].at[m_B + 1].add(active_B.astype(jnp.int32)),
        "reached_S": state.stats["reached_S"] + to_block(jnp.sum(reached_BxS, 0)),
        "accepted_S": state.stats["accepted_S"]
        + to_block(jnp.sum(reached_BxS & (jnp.arange(s) < m_B[:, None]), 0)),
        "confidence_S": state.stats["confidence_S"]
        + to_block(jnp.sum(jnp.where(reached_BxS, confidence_BxS, 0.0), 0)),
        "verified_B": state.stats["verified_B"] + jnp.where(active_B, lengths_B, 0),
        "verify_width": state.stats["verify_width"] + width,
    }
    count_B = state.count_B + n_emit_B
    done_B = state.done_B | hit_eos | (count_B >= settings.max_new_tokens)
    next_state = state._replace(
        cycle=state.cycle + 1,
        target_cache=target_cache,
        draft_k=draft_k,
        draft_v=draft_v,
        pending_B=jnp.where(active_B, next_B, state.pending_B),
        out_BxO=out_BxO,
        count_B=count_B,
        done_B=done_B,
        stats=stats,
    )
    return next_state, m_B


def speculate_program(
    target_state,
    draft_params,
    draft_rest,
    frozen,
    tokens_BxP,
    lengths_B,
    real_B,
    rng,
    sps_N=None,
    *,
    target_graphdef,
    draft_graphdef,
    max_len: int,
    settings: SpecSettings,
    proposer: Proposer = DSPARK_PROPOSER,
):
    """Prefill + cycles until every row is done; returns the final `SpecState` (`sps_N`: the scheduler's
    throughput table, `confidence` schedule only)."""
    target = nnx.merge(target_graphdef, target_state)
    draft = nnx.merge(draft_graphdef, draft_params, draft_rest)
    state = prefill(
        target,
        draft,
        tokens_BxP,
        lengths_B,
        real_B,
        max_len=max_len,
        settings=settings,
        rng=rng,
        proposer=proposer,
    )
    return jax.lax.while_loop(
        lambda s: ~jnp.all(s.done_B),
        lambda s: cycle(target, draft, frozen, s, settings, proposer, sps_N),
        state,
    )
