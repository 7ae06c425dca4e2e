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
    """
    settings = dataclasses.replace(decoder.settings(max_new_tokens + 8 * cycles, params), eos_ids=(-1,))
    batch = next(decoder.batches(prompts[: decoder.batch_size]))
    max_len = decoder.max_len(batch.length, settings.max_new_tokens)
    sps_N = decoder.sps(max_len) if settings.verify_buckets else None
    run = cycle_programs(decoder, settings, max_len)
    ts, (_, dp, dr), frozen = decoder.target_state, decoder.draft, decoder.frozen
    state = run.prefill(ts, dp, dr, batch.tokens_BxP, batch.lengths_B, batch.real_B, jax.random.key(0))
    times = {"draft": [], "select": [], "verify": []}
    for index in range(cycles + 1):  # the first cycle compiles
        t0 = time.perf_counter()
        draft_out = jax.block_until_ready(run.draft_pass(dp, dr, frozen, state))
        t1 = time.perf_counter()
        proposals = jax.block_until_ready(run.select(dp, dr, frozen, state, draft_out))
        t2 = time.perf_counter()
        state, _ = jax.block_until_ready(run.verify(ts, dp, dr, state, draft_out, proposals, sps_N))
        t3 = time.perf_counter()
        if index:
            for name, seconds in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
                times[name].append(seconds)
    out = {f"{name}_ms": 1e3 * float(np.mean(v)) for name, v in times.items()}
    out["cycle_ms"] = sum(out.values())
    return out
