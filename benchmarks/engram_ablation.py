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

from dspark_jax import experiments, sharding
from dspark_jax.data.pipeline import make_iterator
from dspark_jax.engram import prepare
from dspark_jax.train import components, evaluation

NAMES = ("tau_prob", "accept_rate_0", "accept_rate_1", "accept_rate_2", "loss")


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--checkpoint", required=True, help="an Engram group's work directory")
    parser.add_argument("--batches", type=int, default=0, help="validation batches (0 = all)")
    args = parser.parse_args()
    config = components.run_config(args.checkpoint)
    if not prepare.uses_engram(config):
        raise SystemExit(f"error: {args.checkpoint} is a {config.experiment!r} run, not an Engram one")
    mesh = sharding.make_mesh(config.mesh.to_dict())
    experiment = experiments.get(config.experiment)
    side, paths = components.prepare_target_side(config, mesh)
    source = components.open_source(paths["val"], config, side)
    graphdef, params, rest, step = components.restore_draft(config, side.config, mesh, args.checkpoint)
    table = side.frozen.engram
    frozen = {
        "with features": side.frozen,
        "rows zeroed": side.frozen._replace(engram=table._replace(rows_xW=jnp.zeros_like(table.rows_xW))),
    }
    sums = evaluation.make_eval_sums(graphdef, experiment)
    micro_rows = config.train.global_batch // config.train.grad_accum
    pipeline = components.pipeline_config(config, side, batch_size=micro_rows, seed=config.seed, num_epochs=1)
    rows = {
        label: evaluation.evaluate(
            sums, experiment, params, rest, f, make_iterator(source, pipeline), mesh, args.batches
        )
        for label, f in frozen.items()
    }
    print(f"{config.experiment} step {step}, {len(source)} validation samples")
    print(f"{'':14s}" + "".join(f"{n:>16s}" for n in NAMES))
    for label, values in rows.items():
        print(f"{label:14s}" + "".join(f"{values[n]:16.4f}" for n in NAMES))
    diff = {n: rows["with features"][n] - rows["rows zeroed"][n] for n in NAMES}
    print(f"{'difference':14s}" + "".join(f"{diff[n]:16.4f}" for n in NAMES))


if __name__ == "__main__":
    main()
