"""Regeneration's decode batch: tokens/s on the demo's first turns at several `data.regen_batch_size`
values, in one run.

  python benchmarks/regeneration.py [--conversations=128] [--batch_sizes=32,64,128] [--preset=demo]

The first `--conversations` conversations of the preset's training blend (`data.train_source`) whose first
prompt fits `data.regen_max_prompt_tokens`, fed as `regenerate` feeds them: one `generate` call per chunk
of `--chunk` conversations (at least the batch), which batches its prompts shortest first; greedy,
`data.regen_max_new_tokens` new tokens. Per batch size: seconds (compiles excluded, `GenerationStats`),
generated tokens, tokens/s, and row use: generated tokens over the rows x decode steps the batches paid
(a batch steps until its longest row ends; a finished or padding row still computes). Replies equal to
the first batch size's are counted (greedy; a difference is the float noise of another batch shape).
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
from dspark_jax.target.generate import GREEDY, Generator


def paid_row_steps(prompts: list[list[int]], replies: list[list[int]], batch: int, max_new: int) -> int:
    """Rows x decode steps of one `generate` call's batches (shortest prompts first, as it batches)."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    total = 0
    for start in range(0, len(order), batch):
        rows = [replies[i] for i in order[start : start + batch]]
        total += batch * min(max_new, max(len(r) + 1 for r in rows))  # a row's EOS is a step
    return total


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--conversations", type=int, default=128)
    parser.add_argument("--batch_sizes", default="32,64,128")
    parser.add_argument("--chunk", type=int, default=64, help="regenerate's chunk_size (raised to the batch)")
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
    max_new = data.regen_max_new_tokens
    print(
        f"{len(prompts)} first turns of {data.train_source} ({sum(map(len, prompts))} prompt tokens), "
        f"max_new {max_new}, greedy, compiles excluded"
    )
    print(
        f"{'batch':>5s} {'chunk':>5s} {'seconds':>8s} {'generated':>9s} {'tokens/s':>8s} {'row use':>7s} "
        f"{'equal':>7s}"
    )
    first = None
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        chunk = max(args.chunk, batch)
        generator = Generator(
            target.model, eos_ids=target.eos_ids, pad_id=target.tokenizer.pad_id, batch_size=batch, mesh=mesh
        )
        replies, paid = [], 0
        for start in range(0, len(prompts), chunk):
            part = prompts[start : start + chunk]
            out = generator.generate(part, max_new_tokens=max_new, params=GREEDY)
            paid += paid_row_steps(part, out, batch, max_new)
            replies += out
        first = first or replies
        stats = generator.stats
        same = sum(a == b for a, b in zip(first, replies))
        print(
            f"{batch:5d} {chunk:5d} {stats.seconds:8.1f} {stats.generated_tokens:9d} "
            f"{stats.tokens_per_second:8.1f} {stats.generated_tokens / paid:7.2f} {same:3d}/{len(prompts)}"
        )


if __name__ == "__main__":
    main()
