"""Does a trained prefix reranker change choices? |W_o|, max |delta| against the candidates' top-1/top-2 logit
gap, the share of predictions and blocks whose greedy choice the reranker changes, and the share of the
query's SiLU units that are live (input above 0).

  DSPARK_JAX_CACHE=DIR python benchmarks/reranker_diagnosis.py --checkpoint=WORKDIR [--checkpoint=...] \
      [--batches=0] [--json=OUT.json]

For each reranker work directory (joint or frozen group): its final checkpoint on its validation cache,
teacher-forced (`dspark_jax.groups.reranker.diagnosis`). A choice can move only where max |delta| exceeds
half the gap; the table shows per gap quintile how far the deltas reach.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dspark_jax import sharding
from dspark_jax.data.batch import device_fields
from dspark_jax.data.pipeline import to_global
from dspark_jax.groups.reranker import diagnosis
from dspark_jax.groups.reranker.model import RerankerDraft
from dspark_jax.run import checkpoints
from dspark_jax.training.evaluation import open_validation


def diagnose(workdir: str, batches: int) -> dict:
    config = checkpoints.run_config(workdir)
    v = open_validation(config, workdir)
    if not isinstance(nnx.merge(v.graphdef, v.params, v.rest), RerankerDraft):
        raise SystemExit(f"error: {workdir} is a {config.experiment!r} run, not a prefix reranker one")
    fn = jax.jit(
        lambda params, rest, frozen, batch: diagnosis.choice_margins(
            nnx.merge(v.graphdef, params, rest), frozen, batch
        )
    )
    parts = []
    with sharding.activation_sharding(v.mesh, v.rules):
        for index, batch in enumerate(v.epoch()):
            if batches and index >= batches:
                break
            out = fn(v.params, v.rest, v.frozen, to_global(device_fields(batch), v.mesh, v.rules))
            parts.append({k: np.asarray(x) for k, x in jax.device_get(out).items()})
    joined = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    step = v.step + config.get("init", {}).get("step", 0)  # cumulative for the frozen group
    return {
        "workdir": workdir,
        "experiment": config.experiment,
        "step": step,
        **diagnosis.w_o_norms(v.params),
        **diagnosis.summarise(joined),
    }


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--checkpoint", action="append", required=True, help="a reranker work directory")
    parser.add_argument("--batches", type=int, default=0, help="validation batches (0 = all)")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    results = [diagnose(path, args.batches) for path in args.checkpoint]
    for r in results:
        print(
            f"{r['experiment']} step {r['step']} ({r['workdir']}): |W_o| Frobenius {r['w_o_frobenius']:.4g}, "
            f"max {r['w_o_max_abs']:.4g}; {r['predictions']} predictions in {r['blocks']} blocks; choice "
            f"changed in {r['changed_predictions']:.2%} of predictions, {r['changed_blocks']:.2%} of blocks; "
            f"max|delta| < gap/2 in {r['delta_below_half_gap']:.2%}; query units live (SiLU input > 0) "
            f"{r['live_units']:.2%} on average, none in {r['no_live_unit']:.2%} of predictions"
        )
        print(
            f"  {'gap bin':>20s} {'predictions':>11s} {'max|delta| median':>18s} {'p90':>9s} {'max':>9s} "
            f"{'changed':>8s}"
        )
        for b in r["by_gap"]:
            print(
                f"  {b['gap_from']:9.4f}-{b['gap_to']:<10.4f} {b['predictions']:11d} "
                f"{b['max_abs_delta_median']:18.4g} {b['max_abs_delta_p90']:9.4g} "
                f"{b['max_abs_delta_max']:9.4g} {b['changed']:8.2%}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
