"""Cycle latency split into its parts: draft backbone, Markov selection, target verification.

The decoder runs a whole request as one `while_loop`; to see where a cycle's time goes, the
same engine functions are compiled as three separate programs and timed one after another
on real decoding states (each measured phase blocks until its result is ready).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx

from dspark_jax import sharding
from dspark_jax.inference import engine
from dspark_jax.inference.decoder import SpeculativeDecoder
from dspark_jax.target.generate import SamplingParams, pad_prompts, prompt_bucket


def time_cycle_phases(
    decoder: SpeculativeDecoder,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    params: SamplingParams,
    cycles: int = 8,
) -> dict[str, float]:
    """Mean milliseconds per cycle of each phase over `cycles` cycles of the first batch of prompts."""
    tg, dg = decoder.target_graphdef, decoder.draft[0]
    settings = engine.SpecSettings(max_new_tokens + 8 * cycles, params, (-1,), decoder.aux_layer_ids)
    chunk = list(prompts[: decoder.batch_size])
    length = prompt_bucket(max(len(p) for p in chunk))
    tokens, lengths = pad_prompts(chunk, decoder.batch_size, length, decoder.pad_id, "right")
    tokens, lengths = sharding.shard_batch(tokens, decoder.mesh), sharding.shard_batch(lengths, decoder.mesh)
    max_len = length + settings.max_new_tokens + 2 * (decoder.block_size + 1)

    @jax.jit
    def prefill(ts, dp, dr, tokens, lengths, rng):
        return engine.prefill(
            nnx.merge(tg, ts),
            nnx.merge(dg, dp, dr),
            tokens,
            lengths,
            max_len=max_len,
            settings=settings,
            rng=rng,
        )

    @jax.jit
    def hidden(dp, dr, frozen, state):
        draft = nnx.merge(dg, dp, dr)
        return engine.draft_hidden(
            draft, frozen, state.draft_k, state.draft_v, state.pending_B, state.target_cache.end_B
        )

    @jax.jit
    def select(dp, dr, frozen, state, h):
        rng = jax.random.fold_in(engine.cycle_rng(state), 0)
        return engine.select(nnx.merge(dg, dp, dr), frozen, h, state.pending_B, rng, settings.params)

    @jax.jit
    def verify(ts, dp, dr, state, proposals):
        rng = jax.random.fold_in(engine.cycle_rng(state), 1)
        return engine.verify_and_accept(
            nnx.merge(tg, ts), nnx.merge(dg, dp, dr), state, proposals, settings, rng
        )

    ts, (_, dp, dr), frozen = decoder.target_state, decoder.draft, decoder.frozen
    state = prefill(ts, dp, dr, tokens, lengths, jax.random.key(0))
    times = {"draft": [], "select": [], "verify": []}
    for index in range(cycles + 1):  # the first cycle compiles
        t0 = time.perf_counter()
        h = jax.block_until_ready(hidden(dp, dr, frozen, state))
        t1 = time.perf_counter()
        proposals = jax.block_until_ready(select(dp, dr, frozen, state, h))
        t2 = time.perf_counter()
        state = jax.block_until_ready(verify(ts, dp, dr, state, proposals))
        t3 = time.perf_counter()
        if index:
            for name, seconds in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
                times[name].append(seconds)
    out = {f"{name}_ms": 1e3 * float(np.mean(v)) for name, v in times.items()}
    out["cycle_ms"] = sum(out.values())
    return out
