"""SGLang as a consumer: `--speculative-algorithm DSPARK --speculative-draft-model-path OUT`, and side files.

SGLang reads DeepSpec's layout as it is (the target's embedding and LM head are its own, the draft's copies
skipped), the STS calibration and the SPS cost table when its ragged verification is on. Rules, from the
PyPI release sglang 0.5.23 (paths below `sglang/srt/`):

  [sglang-model]    models/dspark.py `EntryClass` (Qwen3DSparkModel, LingDSparkModel, DSparkDraftModel) and
                    `DSparkDraftMixin.load_weights` over models/dflash.py `DFlashDraftModel.load_weights`:
                    `fc` [H, A * H] (a ValueError otherwise), `markov_head.markov_w2` [V, R] (the whole
                    vocabulary:
                    no draft-to-target map), an unknown `markov_head.*` tensor an error, every
                    `confidence_head.*` required when the head is on and built in float32; `embed_tokens.*`,
                    `lm_head.*`, `rotary_emb.*` skipped; a missing backbone tensor goes unreported (so the
                    checker reports it); hidden_act silu.
  [sglang-config]   speculative/dspark_components/dspark_config.py `parse_dspark_draft_config` over
                    speculative/dflash_utils.py `parse_dflash_draft_config`: `markov_rank` > 0,
                    `markov_head_type` vanilla/gated/rnn, `mask_token_id` required and below the vocabulary,
                    gamma from `block_size`, `target_layer_ids` within [0, num_target_layers)
                    (`num_target_layers` else the draft's own depth); `enable_confidence_head` absent: a
                    warning (SGLang builds the head, and reads the side files, only with
                    `SGLANG_RAGGED_VERIFY_MODE` set to another mode than its default 'static').
  [sglang-capture]  models/qwen3.py, models/llama.py `set_dflash_layers_to_capture` and model_executor/
                    model_runner_components/spec_aux_hidden_state.py: layer k's output is captured at the
                    input of layer k + 1, in ascending layer order; the last layer's never (the draft then
                    fails at its first forward: "DFLASH target_hidden feature dim mismatch").
  [sglang-sts]      speculative/dspark_components/dspark_sts.py `DSparkStsCalibration` (msgspec):
                    `temperatures` list[float], non-empty, all > 0; optional `dataset`, `num_samples`,
                    `ece_before` / `ece_after`; dspark_verify_planner.py: len(temperatures) == gamma.
  [sglang-sps]      speculative/dspark_components/dspark_sps.py `SpsCostTable` (msgspec, every key required):
                    `sample_batch_tokens` strictly increasing, `sample_steps_per_sec` as long,
                    `max_batch_tokens` >= the last probe; one probe = the uninitialised flat table; a file
                    holding the text "bias_seconds" is read as the additive form.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dspark_jax.interop.consumers import base
from dspark_jax.interop.consumers.side_files import SPS_FILE, STS_FILE, sts_file

log = logging.getLogger(__name__)
ARCHITECTURES = ("Qwen3DSparkModel", "LingDSparkModel", "DSparkDraftModel")


def refuse(facts: base.DraftFacts) -> str | None:
    if facts.draft_vocab_size:
        return (
            f"SGLang's Markov head covers the whole vocabulary (markov_w2 [{facts.vocab_size}, R]; it maps "
            f"no draft vocabulary, this draft has {facts.draft_vocab_size}): train with "
            "train.draft_vocab=0, or "
            "serve this draft with vLLM [sglang-model]"
        )
    return None


def resolved(c: Mapping[str, Any]) -> dict[str, Any]:
    """`c` with the keys SGLang reads from several places resolved in its order [sglang-config]: prefixed
    `dspark_*`, then `dflash_config` merged with `dspark_config`, then the top level."""
    nested = (c.get("dflash_config") or {}) | (c.get("dspark_config") or {})
    pick = lambda prefixed, key, section=nested: c.get(prefixed, section.get(key, c.get(key)))
    return dict(c) | {
        "markov_rank": pick("dspark_markov_rank", "markov_rank"),
        "markov_head_type": pick("dspark_markov_head_type", "markov_head_type"),
        "mask_token_id": pick("dspark_noise_token_id", "mask_token_id"),
        "target_layer_ids": pick("dspark_target_layer_ids", "target_layer_ids", c.get("dflash_config") or {}),
        "num_target_layers": base.first(c, "num_target_layers", "dflash_config"),
    }


def side_files(sources: base.SideSources) -> dict[str, Any]:
    """The STS calibration [sglang-sts] and the SPS table [sglang-sps], each when the run made it (a warning
    for one not made: SGLang then verifies statically)."""
    files = {}
    calibration, sps = sources.calibration.content, sources.sps_table.content
    if calibration is not None:
        files[STS_FILE] = sts_file(
            calibration.temperatures,
            dataset=calibration.dataset,
            num_samples=calibration.num_samples,
            ece_before=calibration.ece_before,
            ece_after=calibration.ece_after,
            mode=calibration.mode,
            step=sources.step,
            experiment=sources.experiment,
        )
    if sps is not None:
        files[SPS_FILE] = sps
    for run_file in (sources.calibration, sources.sps_table):
        if run_file.content is None:
            log.warning(
                "no %s: SGLang runs the draft without it (static verification); make it with %s",
                run_file.path,
                run_file.made_by,
            )
    return files


def check(c: Mapping[str, Any], specs: base.Specs, out: base.Problems, directory: Path) -> None:
    arch = c.get("architectures") or []
    c = resolved(c)
    shape_ok = base.main_keys(c, out, arch_ok=bool(arch) and arch[0] in ARCHITECTURES, tag="sglang-model")
    ids, n_target = c["target_layer_ids"], c["num_target_layers"]
    if n_target is None:
        out.add(
            "config.json",
            "num_target_layers is missing: SGLang then bounds target_layer_ids by the draft's own "
            "num_hidden_layers [sglang-config]",
        )
    shape_ok &= base.layer_ids(ids, n_target, out, "sglang-capture")
    if c.get("draft_vocab_size", c.get("vocab_size")) != c.get("vocab_size"):
        out.add(
            "config.json",
            f"draft_vocab_size={c['draft_vocab_size']}: SGLang's markov_w2 covers the whole vocabulary; "
            "train with train.draft_vocab=0 [sglang-model]",
        )
        shape_ok = False
    if not isinstance(c.get("enable_confidence_head"), bool):
        out.add(
            "config.json",
            "enable_confidence_head is missing: SGLang then assumes a confidence head [sglang-config]",
        )
    if shape_ok:
        base.deepspec_tensors(c, specs, out, "sglang-model")
    if (directory / STS_FILE).is_file():
        _sts(directory / STS_FILE, c, out)
    if (directory / SPS_FILE).is_file():
        _sps(directory / SPS_FILE, out)


def _sts(path: Path, c: Mapping[str, Any], out: base.Problems) -> None:
    doc = base.load_json(path, out)
    valid = {
        "temperatures": lambda x: base.floats(x) and bool(x) and all(t > 0 for t in x),
        "dataset": lambda x: isinstance(x, str),
        "num_samples": base.is_int,
        "ece_before": base.floats,
        "ece_after": base.floats,
    }
    if doc is None or not base.fields(doc, valid, ("temperatures",), path.name, "sglang-sts", out):
        return
    if len(doc["temperatures"]) != c.get("block_size"):
        out.add(
            path.name,
            f"{len(doc['temperatures'])} temperatures, SGLang needs one per draft position "
            f"(block_size={c.get('block_size')}); refit with python -m dspark_jax.calibrate [sglang-sts]",
        )
    if c.get("enable_confidence_head") is False:
        out.add(path.name, "an STS calibration for a draft without confidence head [sglang-config]")


def _sps(path: Path, out: base.Problems) -> None:
    if '"bias_seconds"' in path.read_text():
        out.add(path.name, 'contains "bias_seconds": SGLang would read it as the additive table [sglang-sps]')
        return
    doc = base.load_json(path, out)
    ints = lambda x: isinstance(x, list) and bool(x) and all(base.is_int(v) and v >= 1 for v in x)
    valid = {
        "sample_batch_tokens": ints,
        "sample_steps_per_sec": base.floats,
        "max_batch_tokens": base.is_int,
    }
    if doc is None or not base.fields(doc, valid, tuple(valid), path.name, "sglang-sps", out):
        return
    tokens, sps = doc["sample_batch_tokens"], doc["sample_steps_per_sec"]
    if tokens != sorted(set(tokens)):
        out.add(path.name, f"sample_batch_tokens {tokens} must strictly increase [sglang-sps]")
    if len(tokens) != len(sps):
        out.add(path.name, f"{len(tokens)} batch-token probes but {len(sps)} steps/s values [sglang-sps]")
    if len(tokens) < 2:
        out.add(path.name, "one probe only: SGLang treats it as the uninitialised flat table [sglang-sps]")
    if doc["max_batch_tokens"] < max(tokens):
        out.add(
            path.name,
            f"max_batch_tokens={doc['max_batch_tokens']} below the largest probe {max(tokens)} [sglang-sps]",
        )
    if any(s <= 0 for s in sps):
        out.add(path.name, "steps per second must be positive [sglang-sps]")


CONSUMER = base.Consumer(
    name="sglang",
    release="sglang 0.5.23 (PyPI)",
    check=check,
    refuse=refuse,
    side_files=side_files,
    last_layer="SGLang captures at the input of layer k + 1, and none follows the last [sglang-capture]",
)
