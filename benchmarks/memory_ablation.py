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

import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import ablation
from dspark_jax.groups.memory import model as memory_lib
from dspark_jax.run import checkpoints, draft_state

NAMES = ("tau_prob", "accept_rate_0", "accept_rate_1", "accept_rate_2", "stage1_mean_matches")


class MaskedMemoryDraft(memory_lib.MemoryDraft):
    """The same parameters; every memory slot invalid."""

    def memory(self, *args):
        full = super().memory(*args)
        return full._replace(valid_BxNxM=jnp.zeros_like(full.valid_BxNxM))


def variants(config, side, graphdef):
    cfg = draft_state.draft_config(config, side.config)
    masked = nnx.split(nnx.eval_shape(lambda: MaskedMemoryDraft(cfg, rngs=nnx.Rngs(0))))[0]
    return {"with memory": (graphdef, side.frozen), "memory masked": (masked, side.frozen)}


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--checkpoint", required=True, help="a Draft Memory work directory")
    parser.add_argument("--batches", type=int, default=0, help="validation batches (0 = all)")
    args = parser.parse_args()
    config = checkpoints.run_config(args.checkpoint)
    if config.experiment != "memory":
        raise SystemExit(f"error: {args.checkpoint} is a {config.experiment!r} run, not a Draft Memory one")
    ablation(args.checkpoint, variants, NAMES, args.batches)


if __name__ == "__main__":
    main()
