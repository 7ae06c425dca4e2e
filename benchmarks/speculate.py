"""Speculative decoding cycle latency (draft / selection / verify) and tokens/s vs target-only decoding.

  python benchmarks/speculate.py [--checkpoint=WORKDIR | --config=configs/baseline.py] [--prompts=16] \
      [--concurrency=1] [--max_new_tokens=64]

Runs on the demo target (SmolLM2). With `--checkpoint` the run's stored config picks the
experiment group and draft shape; without it the draft of `--config`'s demo preset is
randomly initialised: latency is the same, acceptance is not (expect MAL ~1), so
speedups are only meaningful with a trained draft (`python -m dspark_jax.train`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import load_config_module
from dspark_jax import sharding
from dspark_jax.data.conversations import GSM8K_VAL256, read_turns_jsonl
from dspark_jax.inference.decoder import SpecReport
from dspark_jax.inference.timing import time_cycle_phases
from dspark_jax.target import target_from_config
from dspark_jax.target.chat import prompt_ids
from dspark_jax.target.generate import GenerationStats, SamplingParams
from dspark_jax.train import components


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
    args = parser.parse_args()
    if args.checkpoint:
        config = components.run_config(args.checkpoint)
    else:
        config = load_config_module(args.config).get_config("demo")
    mesh = sharding.make_mesh({"data": 1, "fsdp": -1, "tensor": 1})
    target = target_from_config(config.target, seed=config.seed, mesh=mesh)
    if args.checkpoint:
        draft = components.restore_draft(config, target.config, mesh, args.checkpoint)[:3]
    else:
        draft = components.init_draft(config, target.config, mesh)
    conversations = read_turns_jsonl(GSM8K_VAL256)[: args.prompts]
    prompts = [
        prompt_ids(target.tokenizer, target.chat_template, [{"role": "user", "content": c[0]}]).tolist()
        for c in conversations
    ]
    sampling = SamplingParams(temperature=args.temperature)
    decoder = components.speculative_decoder(config, target, draft, batch_size=args.concurrency, mesh=mesh)
    plain = decoder.target_only()
    for runner in (decoder, plain):  # warm up: compile every prompt bucket
        runner.generate(prompts, max_new_tokens=args.max_new_tokens, params=sampling)
    decoder.report, plain.stats = SpecReport(), GenerationStats()  # keep the compiled programs, reset counts
    decoder.generate(prompts, max_new_tokens=args.max_new_tokens, params=sampling)
    plain.generate(prompts, max_new_tokens=args.max_new_tokens, params=sampling)
    spec, base = decoder.report.as_dict(), plain.stats.as_dict()
    phases = time_cycle_phases(decoder, prompts, max_new_tokens=args.max_new_tokens, params=sampling)
    draft_kind = f"trained ({args.checkpoint})" if args.checkpoint else "random init"
    print(
        f"SmolLM2 target, draft {draft_kind}, {len(prompts)} GSM8K prompts, concurrency {args.concurrency}, "
        f"max_new {args.max_new_tokens}, temperature {args.temperature}"
    )
    print(
        f"cycle: draft {phases['draft_ms']:.1f} ms | selection {phases['select_ms']:.1f} ms | "
        f"verify {phases['verify_ms']:.1f} ms | total {phases['cycle_ms']:.1f} ms"
    )
    print(f"MAL pooled {spec['mal_pooled']:.2f}, per request {spec['mal_per_request']:.2f}")
    print(f"{'':14s} {'tokens/s':>10s}")
    print(f"{'speculative':14s} {spec['tokens_per_second']:10.1f}")
    print(f"{'target-only':14s} {base['tokens_per_second']:10.1f}")
    print(f"speedup {spec['tokens_per_second'] / base['tokens_per_second']:.2f}x")


if __name__ == "__main__":
    main()
