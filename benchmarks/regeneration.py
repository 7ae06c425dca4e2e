"""Regeneration's prompt order: each chunk's prompts in input order (the builder before 2026-12-06) vs
shortest first (`dspark_jax.data.regenerate` now), on the demo's first turns, in one run.

  python benchmarks/regeneration.py [--conversations=128] [--chunk=64] [--preset=demo]

The first `--conversations` conversations of the preset's training blend (`data.train_source`) whose first
prompt fits `data.regen_max_prompt_tokens`, in chunks of `--chunk` (`regenerate`'s default) through one
greedy `Generator` of `data.regen_batch_size` rows and `data.regen_max_new_tokens` new tokens, as
`regenerate` feeds it. Per order: the prefill's padded tokens (a batch pads to the power-of-two bucket of
its longest prompt), seconds (compiles excluded: `GenerationStats`), generated tokens, and how many replies
equal the other order's (greedy: a row's reply should not depend on its neighbours; a difference is the
float noise of other padding). Each prompt bucket's programs compile and run once on one batch first.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from configs import base
from dspark_jax import sharding
from dspark_jax.data.conversations import load_conversations
from dspark_jax.target import target_from_config
from dspark_jax.target.chat import prompt_ids
from dspark_jax.target.generate import GREEDY, GenerationStats, Generator, prompt_bucket


def batches(chunks: list[list[list[int]]], size: int):
    """The generator's batches of the chunks, in order (a chunk's last batch may be short)."""
    for chunk in chunks:
        for i in range(0, len(chunk), size):
            yield chunk[i : i + size]


def padded_tokens(chunks: list[list[list[int]]], size: int) -> int:
    """Prefill tokens of the chunks' batches: rows x the bucket of each batch's longest prompt."""
    return sum(size * prompt_bucket(max(map(len, batch))) for batch in batches(chunks, size))


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--conversations", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--preset", default="demo")
    args = parser.parse_args()
    config = base.get_config(args.preset)
    data = config.data
    mesh = sharding.make_mesh({"data": 1, "fsdp": -1, "tensor": 1})
    target = target_from_config(config.target, seed=config.seed, mesh=mesh)
    prompts = []
    for conversation in load_conversations(data.train_source, limit=data.train_limit or None).conversations:
        first = next((k for k, m in enumerate(conversation) if m["role"] == "user"), None)
        if first is None:
            continue
        ids = prompt_ids(target.tokenizer, target.chat_template, conversation[: first + 1]).tolist()
        if len(ids) <= data.regen_max_prompt_tokens:
            prompts.append(ids)
        if len(prompts) == args.conversations:
            break
    chunks = [prompts[i : i + args.chunk] for i in range(0, len(prompts), args.chunk)]
    orders = {
        "input order": [list(range(len(c))) for c in chunks],
        "shortest first": [sorted(range(len(c)), key=lambda i: len(c[i])) for c in chunks],
    }
    generator = Generator(
        target.model,
        eos_ids=target.eos_ids,
        pad_id=target.tokenizer.pad_id,
        batch_size=data.regen_batch_size,
        padding="left",
        mesh=mesh,
    )
    arrangements = {
        name: [[c[i] for i in o] for c, o in zip(chunks, order)] for name, order in orders.items()
    }
    warm = {}  # one batch per prompt bucket: its programs compile and run once before any timing
    for arranged in arrangements.values():
        for batch in batches(arranged, data.regen_batch_size):
            warm.setdefault(prompt_bucket(max(map(len, batch))), batch)
    for batch in warm.values():
        generator.generate(batch, max_new_tokens=data.regen_max_new_tokens, params=GREEDY)
    replies, rows = {}, []
    for (name, order), arranged in zip(orders.items(), arrangements.values()):
        generator.stats = GenerationStats()
        out = []
        for chunk, o in zip(arranged, order):
            generated = generator.generate(chunk, max_new_tokens=data.regen_max_new_tokens, params=GREEDY)
            back = [None] * len(chunk)
            for i, ids in zip(o, generated):
                back[i] = ids
            out += back
        replies[name] = out
        stats = generator.stats
        rows.append(
            (name, padded_tokens(arranged, data.regen_batch_size), stats.seconds, stats.generated_tokens)
        )
    same = sum(a == b for a, b in zip(*replies.values()))
    print(
        f"{len(prompts)} first turns of {data.train_source} ({sum(map(len, prompts))} prompt tokens), "
        f"chunks of {args.chunk}, batch {data.regen_batch_size}, max_new {data.regen_max_new_tokens}, "
        "greedy; compiles excluded"
    )
    print(f"{'order':>15s} {'prefill tokens':>14s} {'seconds':>8s} {'generated':>9s} {'tokens/s':>8s}")
    for name, padded, seconds, generated in rows:
        print(f"{name:>15s} {padded:14d} {seconds:8.1f} {generated:9d} {generated / seconds:8.1f}")
    print(f"replies equal in both orders: {same}/{len(prompts)}")


if __name__ == "__main__":
    main()
