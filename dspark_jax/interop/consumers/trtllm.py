"""TensorRT-LLM as a consumer: `DSparkDecodingConfig` over the main directory, plus its options file.

`trtllm-serve --extra_llm_api_options OUT/trtllm_llm_api_options.yaml` (`side_files.TRTLLM_FILE`). Rules
(NVIDIA/TensorRT-LLM, read in the stored index at the commit named; not run here: TensorRT-LLM has no CPU
build):

  [trtllm]  tensorrt_llm/llmapi/llm_args.py @0004396720054fd8e205cbf616f21f0b57c6b412, `DSparkDecodingConfig`:
            decoding_type 'DSpark'; mask_token_id, target_layer_ids, block_size (= max_draft_len),
            markov_rank, markov_head_type vanilla/gated/rnn; draft_len_schedule {batch size >= 1: draft
            length in [0, max_draft_len]}, its smallest key mapping to max_draft_len; no draft vocabulary.
            (Its target's aux capture code was not read: the last layer is not checked for it.)
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from dspark_jax.interop import deepspec_layout as layout
from dspark_jax.interop.consumers import base
from dspark_jax.interop.consumers.side_files import TRTLLM_FILE, draft_len_schedule, trtllm_options


def refuse(facts: base.DraftFacts) -> str | None:
    if facts.draft_vocab_size:
        return (
            "TensorRT-LLM's DSparkDecodingConfig names no draft vocabulary (this draft proposes from "
            f"{facts.draft_vocab_size} tokens): train with train.draft_vocab=0 [trtllm]"
        )
    return None


def side_files(sources: base.SideSources) -> dict[str, Any]:
    """The options file [trtllm], with a `draft_len_schedule` when the run has both its calibration and its
    SPS table."""
    calibration, sps = sources.calibration.content, sources.sps_table.content
    schedule = None
    if calibration is not None and sps is not None:
        schedule = draft_len_schedule(
            calibration.survival, sps, sps["rows"], sources.config_json["block_size"]
        )
    return {TRTLLM_FILE: trtllm_options(sources.config_json, str(sources.directory), schedule)}


def check(c: Mapping[str, Any], specs: base.Specs, out: base.Problems, directory: Path) -> None:
    shape_ok = base.main_keys(
        c, out, arch_ok=layout.ARCHITECTURE in (c.get("architectures") or []), tag="trtllm"
    )
    shape_ok &= base.layer_ids(c.get("target_layer_ids"), c.get("num_target_layers"), out, "trtllm")
    if c.get("draft_vocab_size", c.get("vocab_size")) != c.get("vocab_size"):
        out.add("config.json", f"draft_vocab_size={c['draft_vocab_size']}: no draft vocabulary [trtllm]")
        shape_ok = False
    if shape_ok:
        base.deepspec_tensors(c, specs, out, "trtllm")
    if (directory / TRTLLM_FILE).is_file():
        _options(directory / TRTLLM_FILE, c, out)


def _options(path: Path, c: Mapping[str, Any], out: base.Problems) -> None:
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        out.add(path.name, f"not valid YAML ({str(e).splitlines()[0]})")
        return
    spec = (doc or {}).get("speculative_config") if isinstance(doc, dict) else None
    valid = {
        "decoding_type": lambda x: x == "DSpark",
        "max_draft_len": lambda x: base.is_int(x) and x >= 1,
        "speculative_model_dir": lambda x: isinstance(x, str) and bool(x),
        "mask_token_id": lambda x: x == c.get("mask_token_id"),
        "target_layer_ids": lambda x: x == c.get("target_layer_ids"),
        "block_size": lambda x: x == c.get("block_size"),
        "markov_rank": lambda x: x == c.get("markov_rank"),
        "markov_head_type": lambda x: x in base.MARKOV_HEAD_TYPES and x == c.get("markov_head_type"),
        "draft_len_schedule": lambda x: isinstance(x, dict),
    }
    required = ("decoding_type", "max_draft_len", "speculative_model_dir")
    if not base.fields(spec, valid, required, f"{path.name} speculative_config", "trtllm", out):
        return
    longest = spec["max_draft_len"]
    if spec.get("block_size", longest) != longest:
        out.add(path.name, f"block_size={spec['block_size']} differs from max_draft_len={longest} [trtllm]")
    schedule = spec.get("draft_len_schedule")
    if schedule:
        keys = sorted(schedule)
        ok = lambda k: base.is_int(k) and k >= 1 and base.is_int(schedule[k]) and 0 <= schedule[k] <= longest
        bad = [k for k in keys if not ok(k)]
        if bad:
            out.add(
                path.name,
                f"draft_len_schedule entries {bad}: batch sizes >= 1 to lengths in [0, {longest}] [trtllm]",
            )
        elif schedule[keys[0]] != longest:
            out.add(
                path.name,
                f"draft_len_schedule[{keys[0]}]={schedule[keys[0]]}: the smallest batch size must map to "
                f"max_draft_len={longest} [trtllm]",
            )


CONSUMER = base.Consumer(
    name="trtllm",
    release="NVIDIA/TensorRT-LLM @0004396 (read)",
    check=check,
    refuse=refuse,
    side_files=side_files,
)
