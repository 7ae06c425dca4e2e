"""Speculative decoding cycle latency (draft / selection / verify) and tokens/s vs target-only decoding.

  python benchmarks/speculate.py [--checkpoint=WORKDIR | --config=configs/baseline.py] [--prompts=16] \
      [--concurrency=1] [--max_new_tokens=64] [--select_top_k=0,64] [--draft_len=0,1,2,3] \
      [--draft_vocab=0,8192]

One row per selection rule (`--select_top_k`: 0 = the Markov correction over the whole vocabulary, K =
over each slot's K best base logits), proposals per cycle (`--draft_len`: the block's first L, 0 = all) and
draft vocabulary (`--draft_vocab`: the N tokens the run's training responses use most, 0 = all; needs the
run's training cache):
cycle phases, break-even MAL (the decode loop's time per iteration / the target-only decode step, both
with the prefill taken out), MAL, row use (the rows' cycles over loop iterations x concurrency: a batch
loops until its slowest row is done), tokens/s, speedup, and how many outputs equal target-only decoding's.

Runs on the demo target (SmolLM2). With `--checkpoint` the run's stored config picks the
experiment group and draft shape; without it the draft of `--config`'s demo preset is
randomly initialised: latency is the same, acceptance is not (expect MAL ~1), so
speedups are only meaningful with a trained draft (`python -m dspark_jax.train`).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import load_config_module
from dspark_jax import sharding
from dspark_jax.data.conversations import GSM8K_VAL256, read_turns_jsonl
from dspark_jax.inference.decoder import SpecReport
from dspark_jax.inference.timing import time_cycle_phases
from dspark_jax.run import checkpoints, decoding, draft_state, target_side
from dspark_jax.target import target_from_config
from dspark_jax.target.chat import prompt_ids
from dspark_jax.target.generate import GenerationStats, SamplingParams
from dspark_jax.target.model import DecodeCache


def target_forward_ms(target, rows: int, context: int, tokens: int, repeats: int = 10) -> float:
    """Milliseconds of one target forward of `tokens` new tokens per row (with their logits) on a KV
    cache holding `context` tokens: 1 token is a decode step, `S + 1` a verification's forward."""
    graphdef, state = nnx.split(target.model)
    cache = DecodeCache.zeros(target.config, rows, context + tokens, target.model.dtype)
    cache = cache._replace(end_B=jnp.full((rows,), context, jnp.int32))
    tokens_BxT = jnp.zeros((rows, tokens), jnp.int32)

    @jax.jit
    def forward(state, cache, tokens_BxT):
        model = nnx.merge(graphdef, state)
        out = model(tokens_BxT, cache=cache)
        return model.logits(out.hidden_BxTxH)

    jax.block_until_ready(forward(state, cache, tokens_BxT))
    begin = time.perf_counter()
    for _ in range(repeats):
        jax.block_until_ready(forward(state, cache, tokens_BxT))
    return 1e3 * (time.perf_counter() - begin) / repeats


def target_decode_step_ms(plain, prompts, outputs, *, max_new_tokens, params, seconds) -> float:
    """Target-only milliseconds per decode step with the prefill taken out, as the loop's figure is: the timed
    run's `seconds` less a run's that stops after the first token, over the steps each batch took after
    its first (a batch steps until its longest row is done; a row's EOS is a step)."""
    plain.generate(prompts, max_new_tokens=1, params=params)  # compile
    plain.stats = GenerationStats()
    plain.generate(prompts, max_new_tokens=1, params=params)
    steps = 0
    for start in range(0, len(prompts), plain.batch_size):
        rows = outputs[start : start + plain.batch_size]
        steps += min(max_new_tokens, max(len(r) + 1 for r in rows)) - 1
    return 1e3 * (seconds - plain.stats.seconds) / max(steps, 1)


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--checkpoint", default="")
    parser.add_argument("--config", default="configs/baseline.py", help="used without --checkpoint")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument(
        "--select_top_k",
        default="0,64",
        help="selection candidates per slot to compare (0 = full vocabulary)",
    )
    parser.add_argument(
        "--draft_len", default="0", help="proposals per cycle to compare (the block's first L; 0 = all)"
    )
    parser.add_argument(
        "--draft_vocab", default="0", help="draft vocabularies to compare (the N most used tokens; 0 = all)"
    )
    args = parser.parse_args()
    if args.checkpoint:
        config = checkpoints.run_config(args.checkpoint)
    else:
        config = load_config_module(args.config).get_config("demo")
    mesh = sharding.make_mesh({"data": 1, "fsdp": -1, "tensor": 1})
    target = target_from_config(config.target, seed=config.seed, mesh=mesh)
    if args.checkpoint:
        draft = draft_state.restore_draft(config, target.config, mesh, args.checkpoint)[:3]
    else:
        draft = draft_state.init_draft(
            config, target.config, mesh, target_side.target_reader(config, lambda: target)
        )
    conversations = read_turns_jsonl(GSM8K_VAL256)[: args.prompts]
    prompts = [
        prompt_ids(target.tokenizer, target.chat_template, [{"role": "user", "content": c[0]}]).tolist()
        for c in conversations
    ]
    sampling = SamplingParams(temperature=args.temperature)
    plain = None
    rows = []
    lengths = [int(n) for n in args.draft_len.split(",")]
    vocabs = [int(n) for n in args.draft_vocab.split(",")]
    for top_k, length, vocab in itertools.product(
        (int(k) for k in args.select_top_k.split(",")), lengths, vocabs
    ):
        decoder = decoding.speculative_decoder(
            config,
            target,
            draft,
            batch_size=args.concurrency,
            mesh=mesh,
            select_top_k=top_k,
            draft_len=length,
            draft_vocab=vocab,
        )
        if plain is None:
            plain = decoder.target_only()
            plain.generate(prompts, max_new_tokens=args.max_new_tokens, params=sampling)  # compile
            plain.stats = GenerationStats()
            reference = plain.generate(prompts, max_new_tokens=args.max_new_tokens, params=sampling)
            base = plain.stats.as_dict()
            decode_ms = target_decode_step_ms(
                plain,
                prompts,
                reference,
                max_new_tokens=args.max_new_tokens,
                params=sampling,
                seconds=base["seconds"],
            )
        decoder.generate(prompts, max_new_tokens=args.max_new_tokens, params=sampling)  # compile
        decoder.report = SpecReport()  # keep the compiled programs, reset counts
        outputs = decoder.generate(prompts, max_new_tokens=args.max_new_tokens, params=sampling)
        spec = decoder.report.as_dict()
        phases = time_cycle_phases(decoder, prompts, max_new_tokens=args.max_new_tokens, params=sampling)
        same = sum(a == b for a, b in zip(outputs, reference))
        rows.append((top_k, decoder.draft_len, decoder.draft_vocab_size, phases, spec, same))
    draft_kind = f"trained ({args.checkpoint})" if args.checkpoint else "random init"
    print(
        f"SmolLM2 target, draft {draft_kind}, {len(prompts)} GSM8K prompts, concurrency {args.concurrency}, "
        f"max_new {args.max_new_tokens}, temperature {args.temperature}"
    )
    print(
        f"target-only: {base['tokens_per_second']:.1f} tokens/s (prefill included), {decode_ms:.1f} ms per "
        "decode step (prefill taken out)"
    )
    widths = sorted({1} | {n + 1 for _, n, *_ in rows})
    forward = {n: target_forward_ms(target, args.concurrency, 256, n) for n in widths}
    print(
        "target forward with logits on 256 cached tokens: "
        + ", ".join(f"{n} tokens {ms:.1f} ms ({ms / forward[1]:.2f} steps)" for n, ms in forward.items())
    )
    print(
        "cycle = draft + select + verify, each its own program; loop = the decode loop's time per iteration, "
        "prefill taken out; floor = verify forward + draft forward + one LM-head pass (ms); "
        "break-even MAL = loop / target-only decode step, both without prefill; row use = rows' cycles / "
        "(loop iterations x concurrency): a batch loops until its slowest row is done"
    )
    print(
        f"{'selection':>11s} {'L':>2s} {'vocab':>6s} {'draft':>6s} {'select':>7s} {'verify':>7s} "
        f"{'cycle':>6s} {'loop':>6s} "
        f"{'verify fwd':>10s} {'LM head':>8s} {'floor':>6s} {'loop/floor':>10s} {'break-even MAL':>14s} "
        f"{'MAL':>5s} {'row use':>7s} {'tokens/s':>8s} {'speedup':>7s} {'= target-only':>13s}"
    )
    for top_k, length, vocab, phases, spec, same in rows:
        name = "full vocab" if top_k == 0 else f"top-{top_k}"
        batches = len(spec["per_batch"]["seconds"])
        row_use = spec["cycles"] / max(spec["loop_iterations"] * args.concurrency, 1)
        loop_ms = (1e3 * spec["seconds"] - batches * phases["prefill_ms"]) / max(spec["loop_iterations"], 1)
        print(
            f"{name:>11s} {length:2d} {vocab or 'all':>6} {phases['draft_ms']:6.1f} "
            f"{phases['select_ms']:7.1f} {phases['verify_ms']:7.1f} "
            f"{phases['cycle_ms']:6.1f} {loop_ms:6.1f} {phases['verify_forward_ms']:10.1f} "
            f"{phases['lm_head_ms']:8.1f} {phases['floor_ms']:6.1f} {loop_ms / phases['floor_ms']:10.2f} "
            f"{loop_ms / decode_ms:14.2f} {spec['mal_pooled']:5.2f} "
            f"{row_use:7.2f} {spec['tokens_per_second']:8.1f} "
            f"{spec['tokens_per_second'] / base['tokens_per_second']:6.2f}x {same:>9d}/{len(prompts)}"
        )


if __name__ == "__main__":
    main()
