"""Target generation over `{"turns": [...]}` prompts.

  python -m dspark_jax.generate [--config=configs/baseline.py:demo] --input=IN.jsonl --output=OUT.jsonl \
      [--max_new_tokens=N] [--temperature=T] [--top_p=P] [--seed=S]

Each output line is `{"replies": [str per turn], "reply_ids": [[int] per turn]}`; greedy
when the temperature is 0 (the default). Without `--config` the target is the embedded
default (SmolLM2-135M-Instruct).
"""

from __future__ import annotations

import json
from pathlib import Path

from absl import logging

from dspark_jax import sharding
from dspark_jax.cli import (
    SamplingFlags,
    check_flags,
    config_value,
    define_config_flag,
    define_path_flag,
    run,
)
from dspark_jax.data.conversations import read_turns_jsonl
from dspark_jax.target import target_from_config
from dspark_jax.target.generate import Generator, generate_replies

_CONFIG = define_config_flag()
_INPUT = define_path_flag("input", None, "JSONL of {'turns': [...]} prompts.", required=True)
_OUTPUT = define_path_flag("output", None, "Output JSONL path.", required=True)
_SAMPLING = SamplingFlags()


def main(argv):
    del argv
    _SAMPLING.check()
    config = config_value(_CONFIG)
    params, seed, max_new = _SAMPLING.resolve(config)
    check_flags(
        input=(Path(_INPUT.value).exists(), f"{_INPUT.value} does not exist"),
    )
    conversations = read_turns_jsonl(_INPUT.value)
    mesh = sharding.make_mesh(config.mesh.to_dict())
    target = target_from_config(config.target, seed=seed, mesh=mesh)
    logging.info("target %s (%s), %d conversations", target.source, target.config.family, len(conversations))
    generator = Generator(
        target.model,
        eos_ids=target.eos_ids,
        pad_id=target.tokenizer.pad_id,
        batch_size=config.generate.batch_size,
        padding=config.generate.padding,
        mesh=mesh,
    )
    results = generate_replies(
        generator,
        target.tokenizer,
        target.chat_template,
        conversations,
        max_new_tokens=max_new,
        params=params,
        seed=seed,
    )
    out = Path(_OUTPUT.value)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as f:
        for replies, reply_ids in results:
            f.write(json.dumps({"replies": replies, "reply_ids": reply_ids}, ensure_ascii=False) + "\n")
    stats = generator.stats
    print(json.dumps({"output": str(out), "conversations": len(results), **stats.as_dict()}))


if __name__ == "__main__":
    run(main)
