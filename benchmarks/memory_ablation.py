"""Does a trained Draft Memory draft use its memory, and its target context? Paired figures of one checkpoint.

  DSPARK_JAX_CACHE=DIR python benchmarks/memory_ablation.py --checkpoint=WORKDIR [--control=WORKDIR]

Runs the checkpoint's two-stage evaluation on its whole validation cache once (`training.evaluation`): as
trained, with every memory slot masked (the same stage-1 matches and stage-2 blocks, no memory keys) and
without the target context (stage 2 only; stage 1 still picks the blocks with it). Prints each figure and
the paired difference with its 95% interval over the validation samples. `--control`: a run of the same
recipe with `--config.draft.memory_states=target` (a perfect stage 1: the target's own final states in the
memory slots), printed below as the upper bound of what a memory adds at that budget.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dspark_jax.run import checkpoints
from dspark_jax.training.evaluation import evaluate_checkpoint


def rows(checkpoint: str, label: str) -> list[str]:
    config = checkpoints.run_config(checkpoint)
    if config.experiment != "memory":
        raise SystemExit(f"error: {checkpoint} is a {config.experiment!r} run, not a Draft Memory one")
    m = evaluate_checkpoint(config, checkpoint)
    out = [
        f"{label}: {checkpoint} (memory_states={config.draft.memory_states}), step {m['step']}, "
        f"{m['samples']} validation samples",
        f"  tau_prob {m['tau_prob']:.4f} [{m['tau_prob_low95']:.4f}, {m['tau_prob_high95']:.4f}], "
        f"stage-1 mean matches {m['stage1_mean_matches']:.3f}",
    ]
    for name in ("memory", "context"):
        out.append(
            f"  without {name:8s} {m[f'tau_prob_without_{name}']:.4f}   {name} gain "
            f"{m[f'{name}_gain']:+.4f} [{m[f'{name}_gain_low95']:+.4f}, {m[f'{name}_gain_high95']:+.4f}]"
        )
    return out


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--checkpoint", required=True, help="a Draft Memory work directory")
    parser.add_argument("--control", default="", help="the same recipe trained with memory_states=target")
    args = parser.parse_args()
    lines = rows(args.checkpoint, "draft memory")
    if args.control:
        lines += rows(args.control, "perfect memory (upper bound)")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
