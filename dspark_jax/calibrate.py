"""STS calibration of a trained draft's confidence head on the validation cache (any experiment group).

  python -m dspark_jax.calibrate --checkpoint=WORKDIR [--config=...] [--bins=15]

Runs the group's own teacher-forced evaluation forward over the validation cache, collects every
block's confidence logits with the measured acceptance (greedy: argmax match; sampling: the overlap
`sum_v min(p, q)`), fits one temperature per position left to right for each mode
(`dspark_jax.inference.calibration`) on the even validation micro-batches and reports the ECE of the
cumulative survival before and after on both halves (the odd batches are held out). Writes
`<workdir>/calibration/step_<N>/sts.json` (read by `speculate --schedule=confidence`) and one
reliability-diagram PNG per mode beside it, and prints the per-position table.
"""

from __future__ import annotations

import json

import numpy as np
from absl import flags

from dspark_jax import plots
from dspark_jax.cli import check_flags, checkpoint_config, define_config_flag, define_path_flag, run
from dspark_jax.inference import calibration
from dspark_jax.train import components
from dspark_jax.train.evaluation import block_records, open_validation

_CONFIG = define_config_flag(default=None)
_CHECKPOINT = define_path_flag("checkpoint", None, "Training work directory or checkpoint.", required=True)
_BINS = flags.DEFINE_integer("bins", calibration.DEFAULT_BINS, "Equal-width ECE bins.")

_ACCEPTANCE = {"greedy": "greedy_accept", "sampling": "overlap"}


def _blocks(records: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """`[blocks, S]` arrays of the valid blocks (first position present) of some micro-batches."""
    joined = {k: np.concatenate([r[k].reshape(-1, r[k].shape[-1]) for r in records]) for k in records[0]}
    valid = joined["eval_mask"][:, 0] > 0
    return {k: x[valid] for k, x in joined.items()}


def fit_and_report(records: list[dict[str, np.ndarray]], bins: int) -> dict:
    """STS for each mode on the even micro-batches; ECE and reliability tables on both halves."""
    halves = {"fit": _blocks(records[0::2]), "held_out": _blocks(records[1::2] or records[0::2])}
    result = {"temperatures": {}, "ece": {}, "reliability": {}}
    for mode, key in _ACCEPTANCE.items():
        fit_set = halves["fit"]
        fit = calibration.fit_sts(fit_set["confidence_logit"], fit_set[key], fit_set["eval_mask"], bins=bins)
        result["temperatures"][mode] = list(fit.temperatures)
        result["ece"][mode], result["reliability"][mode] = {}, {}
        for half, blocks in halves.items():
            logits, accept, mask = blocks["confidence_logit"], blocks[key], blocks["eval_mask"] > 0
            raw = np.ones_like(fit.temperatures)
            result["ece"][mode][half] = {
                "before": calibration.position_ece(logits, accept, mask, raw, bins),
                "after": calibration.position_ece(logits, accept, mask, fit.temperatures, bins),
            }
            measured = np.cumprod(accept, axis=1)
            result["reliability"][mode][half] = {
                name: [
                    calibration.reliability(pred[mask[:, k], k], measured[mask[:, k], k], bins)
                    for k in range(mask.shape[1])
                ]
                for name, pred in (
                    ("before", calibration.survival(logits, raw)),
                    ("after", calibration.survival(logits, fit.temperatures)),
                )
            }
    result["blocks"] = {half: len(b["eval_mask"]) for half, b in halves.items()}
    return result


def main(argv):
    del argv
    check_flags(bins=(_BINS.value >= 2, f"must be >= 2, got {_BINS.value}"))
    config = checkpoint_config(_CONFIG, _CHECKPOINT.value)
    validation = open_validation(config, _CHECKPOINT.value)
    result = fit_and_report(block_records(validation), _BINS.value)
    path = components.calibration_file(_CHECKPOINT.value, validation.step)
    record = {"step": validation.step, "experiment": config.experiment, "bins": _BINS.value, **result}
    calibration.save(path, record)
    for mode in calibration.MODES:
        plots.reliability_diagrams(
            path.parent / f"reliability_{mode}.png",
            result["reliability"][mode]["held_out"],
            f"{config.experiment} step {validation.step}: {mode} acceptance, held-out blocks",
        )
    print(f"STS calibration of {config.experiment} step {validation.step}: {result['blocks']} blocks")
    for mode in calibration.MODES:
        ece = result["ece"][mode]["held_out"]
        print(f"{mode:>9}  position  temperature  ECE before  ECE after   (held out)")
        for k, t in enumerate(result["temperatures"][mode]):
            print(f"{'':>9}  {k + 1:>8}  {t:>11.3f}  {ece['before'][k]:>10.4f}  {ece['after'][k]:>9.4f}")
    print(json.dumps({"calibration": str(path), "temperatures": result["temperatures"]}, indent=2))


if __name__ == "__main__":
    run(main, config_default=None)
