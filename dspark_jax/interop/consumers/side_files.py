"""The serving engines' side files: SGLang's STS calibration and SPS cost table, TensorRT-LLM's options.

  file           read by                                             made from
  `STS_FILE`     SGLang `--speculative-dspark-confidence-sts-path`   the run's calibration of a step
  `SPS_FILE`     SGLang `--speculative-dspark-sps-table-path`        a profiled verify-cost table
  `TRTLLM_FILE`  `trtllm-serve --extra_llm_api_options`              the draft's config (+ both above)

Their schemas are the engines' (`sglang.SOURCES`, `trtllm.SOURCES`); msgspec ignores keys a struct does not
name, so the files carry where they came from (device, step) beside the engine's keys.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import yaml

STS_FILE = "sts_calibration.json"
SPS_FILE = "sps_table.json"
TRTLLM_FILE = "trtllm_llm_api_options.yaml"


def sts_file(
    temperatures: Sequence[float], *, dataset: str, num_samples: int, ece_before, ece_after, **source
):
    """SGLang's STS calibration [sglang-sts]: one temperature per draft position, with where it came from."""
    return {
        "temperatures": [float(t) for t in temperatures],
        "dataset": dataset,
        "num_samples": int(num_samples),
        "ece_before": [float(e) for e in ece_before],
        "ece_after": [float(e) for e in ece_after],
        **source,
    }


def sps_file(tokens: Sequence[int], steps_per_second: Sequence[float], max_batch_tokens: int, **source):
    """SGLang's SPS cost table [sglang-sps] from profiled `(batch tokens, verify passes per second)` pairs;
    repeated token counts are merged to their median (the table's probes strictly increase)."""
    by_tokens: dict[int, list[float]] = {}
    for n, sps in zip(tokens, steps_per_second, strict=True):
        by_tokens.setdefault(int(n), []).append(float(sps))
    probes = sorted(by_tokens)
    return {
        "sample_batch_tokens": probes,
        "sample_steps_per_sec": [statistics.median(by_tokens[n]) for n in probes],
        "max_batch_tokens": max(int(max_batch_tokens), probes[-1]),
        **source,
    }


def draft_len_schedule(
    survival: Sequence[float], sps: Mapping[str, Any], batch_sizes: Sequence[int], block_size: int
) -> dict[int, int]:
    """TensorRT-LLM's `draft_len_schedule` from the SPS table and the mean calibrated survival `a_j`
    (position j = 1..S): per batch size `b`, the draft length `k` of the largest expected throughput
    `b (1 + sum_{j<=k} a_j) SPS(b (k + 1))`, `SPS` interpolated in batch tokens. TensorRT-LLM requires the
    smallest batch size to map to `block_size` [trtllm]; it does (whatever the table says)."""
    xs, ys = sps["sample_batch_tokens"], sps["sample_steps_per_sec"]
    throughput = lambda b, k: b * (1 + sum(survival[:k])) * float(np.interp(b * (k + 1), xs, ys))
    sizes = sorted({int(b) for b in batch_sizes})
    best = {b: max(range(block_size + 1), key=lambda k, b=b: (throughput(b, k), k)) for b in sizes}
    return {b: block_size if b == sizes[0] else best[b] for b in sizes}


def trtllm_options(config_json: Mapping[str, Any], model_dir: str, schedule: Mapping[int, int] | None):
    """`trtllm-serve --extra_llm_api_options` content: the draft's `DSparkDecodingConfig` [trtllm]."""
    spec = {
        "decoding_type": "DSpark",
        "max_draft_len": config_json["block_size"],
        "speculative_model_dir": model_dir,
        "mask_token_id": config_json["mask_token_id"],
        "target_layer_ids": list(config_json["target_layer_ids"]),
        "block_size": config_json["block_size"],
        "markov_rank": config_json["markov_rank"],
        "markov_head_type": config_json["markov_head_type"],
    }
    if schedule:
        spec["draft_len_schedule"] = {int(b): int(k) for b, k in schedule.items()}
    return {"speculative_config": spec}


def write_side_files(directory: str | Path, files: Mapping[str, Any]) -> None:
    """Writes each `{file name: content}` (JSON, or YAML for `.yaml`) into `directory`."""
    for name, content in files.items():
        text = (
            yaml.safe_dump(content, sort_keys=False)
            if name.endswith(".yaml")
            else json.dumps(content, indent=2)
        )
        (Path(directory) / name).write_text(text + ("" if text.endswith("\n") else "\n"))
