"""Does a trained Draft Memory draft use its memory? Stage-2 metrics with the memory and with it masked.

  DSPARK_JAX_CACHE=DIR python benchmarks/memory_ablation.py --checkpoint=WORKDIR [--batches=0]

Runs the two-stage evaluation of the checkpoint on its validation cache twice: as trained, and with
every memory slot marked invalid (the same stage-1 matches and stage-2 anchors, no memory keys). Prints
both rows and their difference.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dspark_jax import sharding
from dspark_jax.data.batch import device_fields
from dspark_jax.data.pipeline import make_iterator
from dspark_jax.draft import memory as memory_lib
from dspark_jax.experiments import memory
from dspark_jax.train import components

NAMES = ("tau_prob", "accept_rate_0", "accept_rate_1", "accept_rate_2", "stage1_mean_matches")


class MaskedMemoryDraft(memory_lib.MemoryDraft):
    """The same parameters; every memory slot invalid."""

    def memory(self, *args):
        full = super().memory(*args)
        return full._replace(valid_BxNxM=jnp.zeros_like(full.valid_BxNxM))


def stage2_metrics(config, side, source, graphdef, params, rest, batches: int) -> dict[str, float]:
    pipeline = components.pipeline_config(config, side, batch_size=2, seed=config.seed, num_epochs=1)
    sums = jax.jit(lambda p, r, b: memory.memory_sums(nnx.merge(graphdef, p, r), side.frozen, b))
    total = None
    for index, batch in enumerate(make_iterator(source, pipeline)):
        if batches and index >= batches:
            break
        new = sums(params, rest, {k: jnp.asarray(v) for k, v in device_fields(batch).items()})
        total = new if total is None else jax.tree.map(jnp.add, total, new)
    metrics = memory.memory_metrics(total)
    return {name: float(metrics[name]) for name in NAMES}


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--checkpoint", required=True, help="a Draft Memory work directory")
    parser.add_argument("--batches", type=int, default=0, help="validation batches (0 = all)")
    args = parser.parse_args()
    config = components.run_config(args.checkpoint)
    if config.experiment != "memory":
        raise SystemExit(f"error: {args.checkpoint} is a {config.experiment!r} run, not a Draft Memory one")
    mesh = sharding.make_mesh(config.mesh.to_dict())
    side, paths = components.prepare_target_side(config, mesh)
    source = components.open_source(paths["val"], config, side)
    graphdef, params, rest, step = components.restore_draft(config, side.config, mesh, args.checkpoint)
    masked_graphdef = nnx.split(
        nnx.eval_shape(lambda: MaskedMemoryDraft(nnx.merge(graphdef, params, rest).cfg, rngs=nnx.Rngs(0)))
    )[0]
    rows = {
        "with memory": stage2_metrics(config, side, source, graphdef, params, rest, args.batches),
        "memory masked": stage2_metrics(config, side, source, masked_graphdef, params, rest, args.batches),
    }
    print(f"step {step}, {len(source)} validation samples")
    print(f"{'':14s}" + "".join(f"{n:>21s}" for n in NAMES))
    for label, values in rows.items():
        print(f"{label:14s}" + "".join(f"{values[n]:21.4f}" for n in NAMES))
    print(
        f"{'difference':14s}"
        + "".join(f"{rows['with memory'][n] - rows['memory masked'][n]:21.4f}" for n in NAMES)
    )


if __name__ == "__main__":
    main()
