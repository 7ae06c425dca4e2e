"""Fit the Engram table of an Engram config (or check the one it names).

  python -m dspark_jax.fit_engram --config=configs/engram_markov.py[:demo|:smoke|:paper] [--table=PATH]

Runs the target over `engram.fit_source` conversations `[fit_offset, fit_offset + fit_limit)` (none of the
training or validation text: the config check refuses overlapping ranges, shared prompts are left out),
with a progress bar; a killed fit resumes from its last commit. An existing table is loaded and checked
instead. Prints one JSON line: the table's path, shape, size in bytes and fit statistics. Training fits a
missing table by itself; this command does it ahead of time (or on another machine).
"""

from __future__ import annotations

import json
import os

from dspark_jax import sharding
from dspark_jax.cli import config_value, define_config_flag, define_path_flag, run
from dspark_jax.errors import UsageError
from dspark_jax.groups.engram import prepare
from dspark_jax.run.target_side import side_from_checkpoint, side_from_target
from dspark_jax.target import target_from_config

DEFAULT_CONFIG = "configs/engram_markov.py:demo"
_CONFIG = define_config_flag(DEFAULT_CONFIG)
_TABLE = define_path_flag(
    "table", None, "Where to write the table; default: engram.table_path or its default."
)


def main(argv):
    del argv
    config = config_value(_CONFIG)
    if not prepare.uses_engram(config):
        raise UsageError(
            f"--config: experiment {config.experiment!r} has no engram section (use configs/engram_*.py)"
        )
    if _TABLE.value:
        with config.unlocked():
            config.engram.table_path = _TABLE.value
    mesh = sharding.make_mesh(config.mesh.to_dict())
    target = None

    def load_target():
        nonlocal target
        target = target or target_from_config(config.target, seed=config.seed, mesh=mesh)
        return target

    side = (
        side_from_target(load_target(), mesh)
        if config.target.random_init
        else side_from_checkpoint(config, mesh)
    )
    table = prepare.prepare_table(
        config, side.fingerprint, side.tokenizer_fingerprint, side.config.vocab_size, load_target
    )
    path = prepare.table_path(config, side.fingerprint, side.tokenizer_fingerprint)
    print(
        json.dumps(
            {
                "table": path,
                "bytes": os.path.getsize(path),
                "rows": table.spec.num_rows,
                "dim": table.spec.dim,
                "compressed_vocab": table.spec.compressed_vocab,
                "fit": dict(table.fit),
            }
        )
    )


if __name__ == "__main__":
    run(main, config_default=DEFAULT_CONFIG)
