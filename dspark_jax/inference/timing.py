"""Cycle latency split into its parts: draft pass, token selection, target verification.

The decoder runs a whole request as one `while_loop`; to see where a cycle's time goes, the
same engine and proposer functions are compiled as three separate programs and timed one after
another on real decoding states (each measured phase blocks until its result is ready).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.inference import engine
from dspark_jax.inference.decoder import SpeculativeDecoder
from dspark_jax.target.generate import SamplingParams


class CyclePrograms(NamedTuple):
    """One cycle's phases of a decoder as separate jitted programs over its own parts:

    prefill(target_state, draft_params, draft_rest, tokens_BxP, lengths_B, real_B, rng) -> state
    draft_pass(draft_params, draft_rest, frozen, state) -> the proposer's draft output
    select(draft_params, draft_rest, frozen, state, draft_out) -> `engine.Proposals`
    verify(target_state, draft_params, draft_rest, state, draft_out, proposals, sps_N) -> (the next state
      with the proposer's next carry, accepted proposals per row)
    """

    prefill: Callable
    draft_pass: Callable
    select: Callable
    verify: Callable


def cycle_programs(decoder: SpeculativeDecoder, settings: engine.SpecSettings, max_len: int) -> CyclePrograms:
    """The decoder's cycle split into its phases (the same engine and proposer functions its decode loop
    runs), for `max_len` cache slots."""
    tg, dg, proposer = decoder.target_graphdef, decoder.draft[0], decoder.proposer

    def prefill(ts, dp, dr, tokens, lengths, real, rng):
        target, draft = nnx.merge(tg, ts), nnx.merge(dg, dp, dr)
        return engine.prefill(
            target,
            draft,
            tokens,
            lengths,
            real,
            max_len=max_len,
            settings=settings,
            rng=rng,
            proposer=proposer,
        )

    def draft_pass(dp, dr, frozen, state):
        return proposer.draft_pass(nnx.merge(dg, dp, dr), frozen, state)

    def select(dp, dr, frozen, state, draft_out):
        rng = jax.random.fold_in(engine.cycle_rng(state), 0)
        return proposer.select(nnx.merge(dg, dp, dr), frozen, draft_out, state, rng, settings)

    def verify(ts, dp, dr, state, draft_out, proposals, sps_N):
        draft = nnx.merge(dg, dp, dr)
        rng = jax.random.fold_in(engine.cycle_rng(state), 1)
        new_state, accepted_B = engine.verify_and_accept(
            nnx.merge(tg, ts), draft, state, proposals, settings, rng, sps_N
        )
        carry = proposer.next_carry(draft, state, draft_out, proposals, accepted_B)
        return new_state._replace(carry=carry), accepted_B

    return CyclePrograms(*map(jax.jit, (prefill, draft_pass, select, verify)))


class FloorPrograms(NamedTuple):
    """The work a cycle cannot do without, as jitted programs:

    verify_forward(target_state, state, proposals) -> the target's logits and aux states of `[x[p], d_1..d_S]`
    lm_head(draft_params, draft_rest, frozen, h_BxSxH) -> the block's base logits over the (draft) vocabulary
    """

    verify_forward: Callable
    lm_head: Callable


def floor_programs(decoder: SpeculativeDecoder, settings: engine.SpecSettings) -> FloorPrograms:
    tg, dg = decoder.target_graphdef, decoder.draft[0]

    def verify_forward(ts, state, proposals):
        tokens_BxS1 = jnp.concatenate([state.pending_B[:, None], proposals.drafts_BxS], 1)
        width = tokens_BxS1.shape[1]
        return engine.verify_forward(nnx.merge(tg, ts), tokens_BxS1, state.target_cache, settings, width)

    def lm_head(dp, dr, frozen, h_BxSxH):
        return engine.candidates(nnx.merge(dg, dp, dr), frozen, h_BxSxH, top_k=0)[0]

    return FloorPrograms(jax.jit(verify_forward), jax.jit(lm_head))


def time_cycle_phases(
    decoder: SpeculativeDecoder,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    params: SamplingParams,
    cycles: int = 8,
) -> dict[str, float]:
    """Mean milliseconds per cycle of each phase over `cycles` cycles of the first batch of prompts.

    Phases: `draft` (the proposer's draft pass), `select` (its token selection), `verify` (the decoder's
    verification schedule, target verification, acceptance, roll-back and the proposer's carry update).
    Under the confidence schedule the verify program picks one of its bucket branches per call; on XLA:CPU
    a standalone call whose branch changes from the previous call measured ~15 ms above the same branch
    inside the decode loop (demo target, concurrency 1), so there `SpecReport.loop_ms_per_cycle` is the
    figure to read.

    The cycle's floor, on the same states: `verify_forward` (the target's forward of the `L + 1` tokens of
    a cycle's `L = decoder.draft_len` proposals on its cache, with their logits and aux states: nothing
    else of verification), `draft_forward` (the proposer's draft pass, `draft`) and `lm_head` (one pass of
    the `L` selected slots' draft states over the frozen LM head, the draft vocabulary's columns where the
    decoder has one); `floor_ms` is their sum, `prefill_ms`
    the prompt's prefill (to take out of a decode loop's time per iteration).
    """
    settings = dataclasses.replace(decoder.settings(max_new_tokens + 8 * cycles, params), eos_ids=(-1,))
    batch = next(decoder.batches(prompts[: decoder.batch_size]))
    max_len = decoder.max_len(batch.length, settings.max_new_tokens)
    sps_N = decoder.sps(max_len) if settings.verify_buckets else None
    run = cycle_programs(decoder, settings, max_len)
    ts, (_, dp, dr), frozen = decoder.target_state, decoder.draft, decoder.frozen
    floor = floor_programs(decoder, settings)
    times = {name: [] for name in ("draft", "select", "verify", "verify_forward", "lm_head", "prefill")}

    def timed(name, fn, *args):
        begin = time.perf_counter()
        result = jax.block_until_ready(fn(*args))
        times[name].append(time.perf_counter() - begin)
        return result

    for _ in range(2):  # the first call compiles
        prompt = (batch.tokens_BxP, batch.lengths_B, batch.real_B, jax.random.key(0))
        state = timed("prefill", run.prefill, ts, dp, dr, *prompt)
    h_BxSxH = jnp.zeros((batch.tokens_BxP.shape[0], decoder.draft_len, decoder.cfg.hidden_size))
    for _ in range(cycles + 1):  # the first cycle compiles
        draft_out = timed("draft", run.draft_pass, dp, dr, frozen, state)
        proposals = timed("select", run.select, dp, dr, frozen, state, draft_out)
        timed("verify_forward", floor.verify_forward, ts, state, proposals)
        timed("lm_head", floor.lm_head, dp, dr, frozen, h_BxSxH)
        state, _ = timed("verify", run.verify, ts, dp, dr, state, draft_out, proposals, sps_N)
    out = {f"{name}_ms": 1e3 * float(np.mean(v[1:])) for name, v in times.items()}
    out["cycle_ms"] = out["draft_ms"] + out["select_ms"] + out["verify_ms"]
    out["draft_forward_ms"] = out["draft_ms"]
    out["floor_ms"] = out["verify_forward_ms"] + out["draft_forward_ms"] + out["lm_head_ms"]
    return out
