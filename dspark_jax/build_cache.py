"""Regenerate replies with the target and build the offline caches of a config.

  python -m dspark_jax.build_cache [--config=configs/baseline.py:demo] [--split=all|train|val] [--dry_run]
      [--process_index=I --process_count=P] [--config.data.features=online]

With `--config.data.features=online` it stops at the token rows: the same regeneration (same
replies file), then only each sample's input_ids and loss_mask are written, under
`<split>_tokens-<key>` (no target forward, no states; what an online run, which computes the
target's states in its training step, reads). `--dry_run` prints, per split, an upper bound of the
cache's size in bytes from the prompts, the aux layers (none for token rows) and the reply-length
cap, in seconds: no weights are loaded, nothing is generated or written. Several processes can
build disjoint
shards of one cache (`--process_index/--process_count`); the last one to finish writes the
final manifest. Rerunning resumes a killed build.
"""

from __future__ import annotations

import json

from absl import flags

from dspark_jax import sharding
from dspark_jax.cache.build import projected_size
from dspark_jax.cli import config_value, define_config_flag, run
from dspark_jax.run import caches, config_lib
from dspark_jax.target import load_tokenizer, target_from_config

_CONFIG = define_config_flag()
_SPLIT = flags.DEFINE_enum("split", "all", ["all", "train", "val"], "Which cache to build.")
_DRY_RUN = flags.DEFINE_bool(
    "dry_run", False, "Print an upper bound of each cache's bytes (no weights, nothing written)."
)
_PROCESS_INDEX = flags.DEFINE_integer("process_index", 0, "This builder's index among process_count.")
_PROCESS_COUNT = flags.DEFINE_integer("process_count", 1, "Number of builder processes.")


def main(argv):
    del argv
    config = config_value(_CONFIG)
    splits = ("train", "val") if _SPLIT.value == "all" else (_SPLIT.value,)
    if _DRY_RUN.value:
        tokenizer, template, shape = load_tokenizer(config.target)
        for split in splits:
            spec = caches.split_spec(config, split)
            print(json.dumps(projected_size(spec, tokenizer, template, shape.hidden_size)))
        return
    mesh = sharding.make_mesh(config.mesh.to_dict())
    target = target_from_config(
        config.target, seed=config.seed, mesh=mesh, rules=config_lib.sharding_rules(config)
    )
    for split in splits:
        report = caches.prepare(
            config,
            split,
            target,
            mesh,
            process_index=_PROCESS_INDEX.value,
            process_count=_PROCESS_COUNT.value,
        )
        print(json.dumps(report))


if __name__ == "__main__":
    run(main)
