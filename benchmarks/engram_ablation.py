"""Does a trained Engram draft use its features? Validation metrics with the table and with its rows zeroed.

  DSPARK_JAX_CACHE=DIR python benchmarks/engram_ablation.py --checkpoint=WORKDIR [--batches=0]

Evaluates the checkpoint of an Engram group on its validation cache twice: with its fitted table, and
with every row zero (Engram-Markov: `v = 0`, the plain Markov head; gated Engram-MASK: the MASK slots
alone; replacement: zero slots). Prints both rows and their difference.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import ablation
from dspark_jax.groups.engram import prepare
from dspark_jax.groups.engram.group import TABLE, table_of
from dspark_jax.run import checkpoints

NAMES = ("tau_prob", "accept_rate_0", "accept_rate_1", "accept_rate_2", "loss")


def variants(config, side, graphdef):
    table = table_of(side.frozen)
    zeroed_table = table._replace(rows_xW=jnp.zeros_like(table.rows_xW))
    zeroed = side.frozen._replace(side_inputs={**side.frozen.side_inputs, TABLE: zeroed_table})
    return {"with features": (graphdef, side.frozen), "rows zeroed": (graphdef, zeroed)}


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--checkpoint", required=True, help="an Engram group's work directory")
    parser.add_argument("--batches", type=int, default=0, help="validation batches (0 = all)")
    args = parser.parse_args()
    config = checkpoints.run_config(args.checkpoint)
    if not prepare.uses_engram(config):
        raise SystemExit(f"error: {args.checkpoint} is a {config.experiment!r} run, not an Engram one")
    ablation(args.checkpoint, variants, NAMES, args.batches)


if __name__ == "__main__":
    main()
