"""STS calibration of a trained draft's confidence head on the validation cache (any experiment group).

  python -m dspark_jax.calibrate --checkpoint=WORKDIR [--config=...] [--bins=15]
      [--profile_sps [--sps_rows=1,2,4,8] [--sps_cache_slots=1024]]

Runs the group's own teacher-forced evaluation forward over the validation cache, collects every
block's confidence logits with the measured acceptance (greedy: argmax match; sampling: the overlap
`sum_v min(p, q)`), fits one temperature per position left to right for each mode
(`dspark_jax.inference.calibration`) on the even validation micro-batches and reports the ECE of the
cumulative survival before and after on both halves (the odd batches are held out). Writes
`<workdir>/calibration/step_<N>/sts.json` (read by `speculate --schedule=confidence`) and one
reliability-diagram PNG per mode beside it, and prints the per-position table.

`--profile_sps` also times the target's verification forward on this machine at `--sps_rows` requests of
1..S+1 tokens each and writes `<workdir>/calibration/sps_table.json`, SGLang's SPS cost table (batch tokens
-> verification passes per second) with the device named: run it on the machine the draft will serve on.
`python -m dspark_jax.export` copies both files next to the exported weights.
"""

from __future__ import annotations

import json

from absl import flags

from dspark_jax import sharding
from dspark_jax.cli import check_flags, checkpoint_config, define_config_flag, define_path_flag, run
from dspark_jax.inference import calibration
from dspark_jax.suite import measure

_CONFIG = define_config_flag(default=None)
_CHECKPOINT = define_path_flag("checkpoint", None, "Training work directory or checkpoint.", required=True)
_BINS = flags.DEFINE_integer("bins", calibration.DEFAULT_BINS, "Equal-width ECE bins.")
_PROFILE_SPS = flags.DEFINE_bool("profile_sps", False, "Also profile the serving SPS table on this device.")
_SPS_ROWS = flags.DEFINE_list(
    "sps_rows", ["1", "2", "4", "8"], "Concurrent requests to profile the SPS table at."
)
_SPS_CACHE_SLOTS = flags.DEFINE_integer(
    "sps_cache_slots", 1024, "KV-cache slots per request while profiling."
)


def main(argv):
    del argv
    rows = [int(r) for r in _SPS_ROWS.value if r.strip().isdigit()]
    check_flags(
        bins=(_BINS.value >= 2, f"must be >= 2, got {_BINS.value}"),
        sps_rows=(
            len(rows) == len(_SPS_ROWS.value) and rows and min(rows) >= 1,
            f"must be a comma list of request counts >= 1, got {','.join(_SPS_ROWS.value)!r}",
        ),
        sps_cache_slots=(_SPS_CACHE_SLOTS.value >= 16, f"must be >= 16, got {_SPS_CACHE_SLOTS.value}"),
    )
    config = checkpoint_config(_CONFIG, _CHECKPOINT.value)
    path, result = measure.calibrate_checkpoint(config, _CHECKPOINT.value, _BINS.value)
    print(f"STS calibration of {config.experiment} step {result['step']}: {result['blocks']} blocks")
    for mode in calibration.MODES:
        ece = result["ece"][mode]["held_out"]
        print(f"{mode:>9}  position  temperature  ECE before  ECE after   (held out)")
        for k, t in enumerate(result["temperatures"][mode]):
            print(f"{'':>9}  {k + 1:>8}  {t:>11.3f}  {ece['before'][k]:>10.4f}  {ece['after'][k]:>9.4f}")
    print(json.dumps({"calibration": str(path), "temperatures": result["temperatures"]}, indent=2))
    if _PROFILE_SPS.value:
        mesh = sharding.make_mesh(config.mesh.to_dict())
        path, table = measure.profile_serving_sps(
            config, _CHECKPOINT.value, rows, _SPS_CACHE_SLOTS.value, mesh
        )
        print(f"SPS table on {table['device']}: {path}")
        for n, sps in zip(table["sample_batch_tokens"], table["sample_steps_per_sec"]):
            print(f"  {n:>6} tokens  {sps:>10.1f} verify passes/s")


if __name__ == "__main__":
    run(main, config_default=None)
