"""Fixed vs confidence-scheduled verification: MAL, verified length and tokens/s per concurrency, one run.

  python benchmarks/schedule.py --checkpoint=WORKDIR [--prompts=32] [--concurrency=1,8,32] \
      [--max_new_tokens=64] [--temperature=0] [--output=OUT.json]

The checkpoint needs its STS calibration (`python -m dspark_jax.calibrate --checkpoint=WORKDIR`). Per
concurrency, on the same GSM8K prompts: target-only decoding (the baseline), then the draft with
`fixed` (all 7 proposals verified) and `confidence` (the prefix scheduler, its SPS table profiled at
start) schedules. Every program is compiled (and the table profiled) on a first pass; the second pass
is timed. Prints one row per (concurrency, schedule) and the profiled SPS tables.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dspark_jax import sharding
from dspark_jax.data.conversations import GSM8K_VAL256, read_turns_jsonl
from dspark_jax.inference.decoder import SCHEDULES, SpecReport
from dspark_jax.run import checkpoints, decoding, draft_state
from dspark_jax.target import target_from_config
from dspark_jax.target.chat import prompt_ids
from dspark_jax.target.generate import GenerationStats, Generator, SamplingParams


def _second_pass(decoder, prompts, **kw):
    """Outputs of a timed second pass (the first compiles, and profiles the SPS table); statistics are
    those of the second pass only."""
    decoder.generate(prompts, **kw)
    if isinstance(decoder, Generator):
        decoder.stats = GenerationStats()
    else:
        decoder.report = SpecReport()
    return decoder.generate(prompts, **kw)


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--output", default="")
    args = parser.parse_args()
    config = checkpoints.run_config(args.checkpoint)
    step = checkpoints.checkpoint_step(args.checkpoint)
    temperatures = checkpoints.load_calibration(args.checkpoint, step, config.draft.block_size)
    mesh = sharding.make_mesh({"data": 1, "fsdp": -1, "tensor": 1})
    target = target_from_config(config.target, seed=config.seed, mesh=mesh)
    draft = draft_state.restore_draft(config, target.config, mesh, args.checkpoint)[:3]
    conversations = read_turns_jsonl(GSM8K_VAL256)[: args.prompts]
    prompts = [
        prompt_ids(target.tokenizer, target.chat_template, [{"role": "user", "content": c[0]}]).tolist()
        for c in conversations
    ]
    kw = dict(max_new_tokens=args.max_new_tokens, params=SamplingParams(temperature=args.temperature))
    rows, tables = [], {}
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        base_outputs = base = None
        for schedule in SCHEDULES:
            decoder = decoding.speculative_decoder(
                config,
                target,
                draft,
                batch_size=concurrency,
                mesh=mesh,
                schedule=schedule,
                temperatures=temperatures,
            )
            if base is None:
                plain = decoder.target_only()
                base_outputs = _second_pass(plain, prompts, **kw)
                base = plain.stats.as_dict()
            outputs = _second_pass(decoder, prompts, **kw)
            spec = decoder.report.as_dict()
            same = sum(a == b for a, b in zip(outputs, base_outputs))
            rows.append(
                {
                    "concurrency": concurrency,
                    "schedule": schedule,
                    "target_only_tokens_per_second": base["tokens_per_second"],
                    "speedup": spec["tokens_per_second"] / base["tokens_per_second"],
                    "identical_to_target_only": same,
                    **spec,
                }
            )
            if decoder.sps_table is not None:
                tables[concurrency] = decoder.sps_table.as_dict()
    print(
        f"{config.experiment} step {step}, SmolLM2 target, {len(prompts)} GSM8K prompts, max_new "
        f"{args.max_new_tokens}, temperature {args.temperature}; STS temperatures "
        f"{[round(t, 2) for t in temperatures['greedy' if args.temperature == 0 else 'sampling']]}"
    )
    print(
        f"{'conc':>4} {'schedule':>10} {'verified':>8} {'width':>6} {'MAL':>5} {'MAL/verif':>9} "
        f"{'tok/s':>7} {'target tok/s':>12} {'speedup':>7} {'= target':>8}"
    )
    for r in rows:
        print(
            f"{r['concurrency']:>4} {r['schedule']:>10} {r['mean_verified_length']:8.2f} "
            f"{r['mean_verify_width']:6.2f} {r['mal_pooled']:5.2f} {r['mal_per_verified_token']:9.3f} "
            f"{r['tokens_per_second']:7.1f} {r['target_only_tokens_per_second']:12.1f} {r['speedup']:6.2f}x "
            f"{r['identical_to_target_only']:>5}/{len(prompts)}"
        )
    for concurrency, table in tables.items():
        sps = ", ".join(f"{n}: {v:.1f}" for n, v in zip(table["tokens"], table["sps"]))
        print(f"SPS, concurrency {concurrency} ({table['cache_slots']} cache slots), tokens: passes/s {sps}")
    if args.output:
        Path(args.output).write_text(json.dumps({"rows": rows, "sps_tables": tables}, indent=2) + "\n")


if __name__ == "__main__":
    main()
