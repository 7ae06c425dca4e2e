"""What the serving engines read from an exported DSpark draft: their side files, and a checker.

An export (`python -m dspark_jax.export`) is DeepSpec's directory (`config.json`, `model.safetensors`,
`deepspec_layout`) plus, per engine, the files that engine takes on its command line:

  engine   reads                                              written here
  vllm     config.json + weights (`--speculative-config`      nothing more
           '{"method": "dspark", "model": DIR, ...}')
  sglang   config.json + weights; optional STS calibration    `STS_FILE`, `SPS_FILE`
           (`--speculative-dspark-confidence-sts-path`) and
           SPS cost table (`--speculative-dspark-sps-table-path`)
  trtllm   config.json + weights; `DSparkDecodingConfig`      `TRTLLM_FILE` (`speculative_config`)
           (`trtllm-serve --extra_llm_api_options FILE`)

`check_directory` validates a directory against each engine's loader, one line per problem, from the
facts below (read in the engines' public sources; repository, file and the commit of the version read;
`docs/serving_engines_notes.md` has the long form). Every rule cites its source by the tag in brackets.

  [vllm-method]   vllm-project/vllm vllm/config/speculative.py @002e77c1, SpeculativeConfig.__post_init__:
                  method 'dspark' from `architectures` Qwen3DSparkModel, or DSparkDraftModel with
                  model_type 'qwen3' (any other DSpark architecture is taken for DeepSeek-V4's).
  [vllm-mask]     vllm/v1/spec_decode/utils.py, get_parallel_drafting_token_id: `dflash_config.mask_token_id`,
                  else the top-level `mask_token_id`; required.
  [vllm-layers]   vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py @0cfdd2e1,
                  get_eagle3_aux_layers_from_config: `dflash_config.target_layer_ids`, else the top-level
                  `target_layer_ids`, each + 1 (layer i's output = capture after layer i + 1).
  [vllm-causal]   vllm/model_executor/models/qwen3_dflash.py, _dflash_layer_causal: a layer is causal when
                  `dflash_config.causal` says so, else when its `layer_types` entry is 'sliding_attention'.
  [vllm-weights]  vllm/model_executor/models/qwen3_dspark.py @0302ff40, Qwen3DSparkForCausalLM: `markov_rank`
                  read at the top level only; load_weights: Qwen3 layers, `fc` [H, target_hidden_size * A]
                  (no fc without `use_aux_hidden_state`), `hidden_norm`, `norm`, `markov_head.markov_w1`
                  [V, R], `markov_w2` [draft_vocab_size, R], `confidence_head.proj` built in float32;
                  `embed_tokens`/`lm_head` optional (the target's are shared when absent).
  [sglang-config] sgl-project/sglang python/sglang/srt/speculative/dspark_components/dspark_config.py
                  @01f47623, parse_dspark_draft_config: `markov_rank` > 0; `markov_head_type` one of
                  vanilla/gated/rnn; `mask_token_id` >= 0 and below the vocabulary, required; gamma from
                  `block_size`; `target_layer_ids` each in [0, num_target_layers) (`num_target_layers` else
                  the draft's own `num_hidden_layers`); `enable_confidence_head` absent = enabled, warned.
  [sglang-model]  python/sglang/srt/models/dspark.py @01f47623: EntryClass Qwen3DSparkModel; load_weights:
                  `fc` [H, A * H], `markov_head.markov_w2` [V, R] (no reduced vocabulary), an unknown
                  `markov_head.*` tensor an error, every `confidence_head.*` required when the head is on,
                  built in float32; `embed_tokens.*`/`lm_head.*` skipped (the target's always used);
                  hidden_act silu.
  [sglang-sts]    python/sglang/srt/speculative/dspark_components/dspark_sts.py @9e16e2d0,
                  DSparkStsCalibration (msgspec): `temperatures` list[float], non-empty, all > 0;
                  optional `dataset` str, `num_samples` int, `ece_before`/`ece_after` list[float];
                  dspark_verify_planner.py @00f7df64: len(temperatures) == gamma.
  [sglang-sps]    python/sglang/srt/speculative/dspark_components/dspark_sps.py @45b76f55, SpsCostTable
                  (msgspec, every key required): `sample_batch_tokens` list[int] strictly increasing,
                  `sample_steps_per_sec` list[float] of the same length, `max_batch_tokens` int >= the last
                  probe; one probe only = the uninitialised (flat) table; a file containing the text
                  "bias_seconds" is read as the other (additive) form.
  [trtllm]        NVIDIA/TensorRT-LLM tensorrt_llm/llmapi/llm_args.py @00043967, DSparkDecodingConfig:
                  decoding_type 'DSpark'; mask_token_id, target_layer_ids, block_size (= max_draft_len),
                  markov_rank, markov_head_type vanilla/gated/rnn; draft_len_schedule {batch size >= 1:
                  draft length in [0, max_draft_len]}, its smallest key mapping to max_draft_len.

Msgspec ignores keys a struct does not name, so the files carry where they came from (device, step)
beside the engine's keys.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from dspark_jax.interop import deepspec_layout as layout

ENGINES = ("vllm", "sglang", "trtllm")
STS_FILE = "sts_calibration.json"
SPS_FILE = "sps_table.json"
TRTLLM_FILE = "trtllm_llm_api_options.yaml"
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
_FLOAT_DTYPES = ("F32", "BF16", "F16")


def parse_engines(text: str) -> tuple[str, ...]:
    """`'all'` or a comma list of `ENGINES` as a tuple; a one-line error naming a wrong one."""
    names = ENGINES if text.strip() == "all" else tuple(n.strip() for n in text.split(",") if n.strip())
    wrong = [n for n in names if n not in ENGINES]
    if wrong or not names:
        raise ValueError(
            f"unknown serving engine {', '.join(wrong) or repr(text)}: choose 'all' or of {ENGINES}"
        )
    return tuple(dict.fromkeys(names))


# ---- The side files --------------------------------------------------------------------------------


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


# ---- The checker -----------------------------------------------------------------------------------


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _first(config: Mapping[str, Any], key: str, *sections: str) -> Any:
    """`config[section][key]` of the first section that has it, else `config[key]` (None when absent)."""
    for section in sections:
        value = (config.get(section) or {}).get(key)
        if value is not None:
            return value
    return config.get(key)


class _Problems(list):
    def add(self, engine: str, where: str, text: str) -> None:
        self.append(f"{engine}: {where}: {text}")


def _check_draft_keys(c: Mapping[str, Any], engine: str, out: _Problems) -> bool:
    """The config keys every engine reads; False when the shape keys are unusable (tensors not checked)."""
    bad = lambda text: out.add(engine, layout.CONFIG_FILE, text)
    arch = c.get("architectures") or []
    if engine == "vllm":
        ok = "Qwen3DSparkModel" in arch or ("DSparkDraftModel" in arch and c.get("model_type") == "qwen3")
        if not ok:
            bad(
                f"architectures={arch!r}: vLLM runs a Qwen3 DSpark draft only as "
                "Qwen3DSparkModel (or DSparkDraftModel with model_type 'qwen3') [vllm-method]",
            )
    elif "Qwen3DSparkModel" not in arch:
        bad(f"architectures={arch!r}: the draft class is Qwen3DSparkModel [sglang-model]")
    if c.get("model_type") != "qwen3":
        bad(f"model_type={c.get('model_type')!r}, expected 'qwen3' (the draft's layers)")
    shape_ok = True
    for key in (
        "hidden_size",
        "vocab_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "block_size",
    ):
        if not (_is_int(c.get(key)) and c[key] > 0):
            bad(f"{key}={c.get(key)!r}, expected a positive integer")
            shape_ok = False
    sections = {"vllm": ("dflash_config",), "sglang": ("dspark_config", "text_config"), "trtllm": ()}[engine]
    mask = _first(c, "mask_token_id", *sections)
    if engine == "sglang" and mask is None:
        mask = (c.get("dflash_config") or {}).get("mask_token_id")
    if not _is_int(mask):
        bad(
            f"mask_token_id={mask!r}: the engine needs the target row used as MASK (an "
            "integer; a learned MASK vector has no row) [vllm-mask, sglang-config]",
        )
    elif _is_int(c.get("vocab_size")) and not 0 <= mask < c["vocab_size"]:
        bad(
            f"mask_token_id={mask} outside the vocabulary [0, {c['vocab_size']}) [sglang-config]",
        )
    ids = _first(c, "target_layer_ids", "dflash_config")
    n_target = _first(c, "num_target_layers", "dflash_config")
    if engine == "sglang" and n_target is None:
        n_target = c.get("num_hidden_layers")
        bad(
            "num_target_layers is missing: SGLang then bounds target_layer_ids by the "
            "draft's own num_hidden_layers [sglang-config]",
        )
    if not (isinstance(ids, list) and ids and all(_is_int(i) for i in ids)):
        bad(f"target_layer_ids={ids!r}, expected a non-empty list of layer indices")
        shape_ok = False
    elif any(b <= a for a, b in itertools.pairwise(ids)) or (
        _is_int(n_target) and not 0 <= ids[0] <= ids[-1] < n_target
    ):
        bad(
            f"target_layer_ids={ids} must increase within [0, num_target_layers={n_target}) "
            "(vLLM captures after layer i + 1) [vllm-layers, sglang-config]",
        )
    rank = c.get("markov_rank")
    if not (_is_int(rank) and rank > 0):
        bad(
            f"markov_rank={rank!r}: a positive integer at the top level is required "
            "[vllm-weights, sglang-config]",
        )
        shape_ok = False
    if c.get("markov_head_type") not in MARKOV_HEAD_TYPES:
        bad(
            f"markov_head_type={c.get('markov_head_type')!r}, expected one of "
            f"{MARKOV_HEAD_TYPES} [sglang-config, trtllm]",
        )
    if c.get("hidden_act", "silu") != "silu":
        bad(
            f"hidden_act={c.get('hidden_act')!r}: the engines' draft MLP is silu [sglang-model]",
        )
    causal = (c.get("dflash_config") or {}).get("causal") or c.get("is_causal")
    sliding = [i for i, t in enumerate(c.get("layer_types") or []) if t == "sliding_attention"]
    if causal or sliding:
        bad(
            f"causal attention ({'causal set' if causal else f'sliding layers {sliding}'}): the "
            "draft was trained with bidirectional attention inside its block [vllm-causal]",
        )
    if (
        engine == "vllm"
        and (c.get("dflash_config") or {}).get("use_aux_hidden_state", c.get("use_aux_hidden_state", True))
        is False
    ):
        bad(
            "use_aux_hidden_state=false: vLLM then builds no fc for the target's layers [vllm-weights]",
        )
    if engine == "sglang" and not isinstance(c.get("enable_confidence_head"), bool):
        bad(
            "enable_confidence_head is missing: SGLang then assumes a confidence head [sglang-config]",
        )
    return shape_ok


def _expected_tensors(c: Mapping[str, Any], engine: str) -> dict[str, tuple[int, ...]]:
    """Tensor name -> the shape the engine's loader builds for it (optional tensors excluded)."""
    h, v, r, a = c["hidden_size"], c["vocab_size"], c["markov_rank"], len(c["target_layer_ids"])
    d = c.get("head_dim") or h // c["num_attention_heads"]
    q, g, i = c["num_attention_heads"] * d, c["num_key_value_heads"] * d, c["intermediate_size"]
    fc_in = (c.get("target_hidden_size") or h) * a if engine == "vllm" else a * h
    w2_rows = (c.get("draft_vocab_size") or v) if engine == "vllm" else v
    out = {"fc.weight": (h, fc_in), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for n in range(c["num_hidden_layers"]):
        p = f"layers.{n}."
        out |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (g, h),
            p + "self_attn.v_proj.weight": (g, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
    out |= {"markov_head.markov_w1.weight": (v, r), "markov_head.markov_w2.weight": (w2_rows, r)}
    if c.get("enable_confidence_head", engine == "sglang"):
        width = h + r if c.get("confidence_head_with_markov", engine == "sglang") else h
        out |= {"confidence_head.proj.weight": (1, width), "confidence_head.proj.bias": (1,)}
    return out


def _check_tensors(c, specs: Mapping[str, tuple[tuple[int, ...], str]], engine: str, out: _Problems) -> None:
    expected = _expected_tensors(c, engine)
    optional = dict.fromkeys(layout.TARGET_TENSORS, (c["vocab_size"], c["hidden_size"]))
    for name, shape in expected.items():
        if name not in specs:
            out.add(engine, "weights", f"missing tensor {name} {list(shape)} [vllm-weights, sglang-model]")
    for name, (shape, dtype) in specs.items():
        want = expected.get(name, optional.get(name))
        if want is None:
            confidence_off = name.startswith("confidence_head.") and not c.get("enable_confidence_head", True)
            if not confidence_off:
                out.add(
                    engine,
                    "weights",
                    f"unexpected tensor {name} {list(shape)}: no {engine} DSpark loader "
                    "names it [vllm-weights, sglang-model]",
                )
        elif tuple(shape) != want:
            out.add(
                engine,
                "weights",
                f"tensor {name} has shape {list(shape)}, the loader builds {list(want)} "
                "[vllm-weights, sglang-model]",
            )
        if name.startswith("confidence_head.") and dtype != "F32":
            out.add(
                engine,
                "weights",
                f"tensor {name} is {dtype}: the confidence head is built and read in "
                "float32 [vllm-weights, sglang-model]",
            )
        elif dtype not in _FLOAT_DTYPES:
            out.add(engine, "weights", f"tensor {name} is {dtype}, expected one of {_FLOAT_DTYPES}")


def _load_json(path: Path, engine: str, out: _Problems) -> Any:
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        out.add(engine, path.name, f"not valid JSON ({e})")
        return None


def _check_fields(
    doc: Any,
    fields: Mapping[str, Callable[[Any], bool]],
    required: Sequence[str],
    engine: str,
    where: str,
    tag: str,
    out: _Problems,
) -> bool:
    if not isinstance(doc, dict):
        out.add(engine, where, f"expected a JSON object, got {type(doc).__name__} [{tag}]")
        return False
    ok = True
    for key, valid in fields.items():
        if key not in doc:
            if key in required:
                out.add(engine, where, f"{key} is missing [{tag}]")
                ok = False
        elif not valid(doc[key]):
            out.add(engine, where, f"{key}={doc[key]!r} has the wrong type or value [{tag}]")
            ok = False
    return ok


def _floats(x) -> bool:
    return isinstance(x, list) and all(_is_number(v) for v in x)


def _check_sts(path: Path, c: Mapping[str, Any], out: _Problems) -> None:
    doc = _load_json(path, "sglang", out)
    fields = {
        "temperatures": lambda x: _floats(x) and bool(x) and all(t > 0 for t in x),
        "dataset": lambda x: isinstance(x, str),
        "num_samples": _is_int,
        "ece_before": _floats,
        "ece_after": _floats,
    }
    if doc is None or not _check_fields(
        doc, fields, ("temperatures",), "sglang", path.name, "sglang-sts", out
    ):
        return
    if len(doc["temperatures"]) != c.get("block_size"):
        out.add(
            "sglang",
            path.name,
            f"{len(doc['temperatures'])} temperatures, SGLang needs one per draft position "
            f"(block_size={c.get('block_size')}); refit with python -m dspark_jax.calibrate [sglang-sts]",
        )
    if c.get("enable_confidence_head") is False:
        out.add("sglang", path.name, "an STS calibration for a draft without confidence head [sglang-config]")


def _check_sps(path: Path, out: _Problems) -> None:
    text = path.read_text()
    if '"bias_seconds"' in text:
        out.add(
            "sglang",
            path.name,
            'contains "bias_seconds": SGLang would read it as the additive table [sglang-sps]',
        )
        return
    doc = _load_json(path, "sglang", out)
    ints = lambda x: isinstance(x, list) and bool(x) and all(_is_int(v) and v >= 1 for v in x)
    fields = {"sample_batch_tokens": ints, "sample_steps_per_sec": _floats, "max_batch_tokens": _is_int}
    if doc is None or not _check_fields(doc, fields, tuple(fields), "sglang", path.name, "sglang-sps", out):
        return
    tokens, sps = doc["sample_batch_tokens"], doc["sample_steps_per_sec"]
    if tokens != sorted(set(tokens)):
        out.add("sglang", path.name, f"sample_batch_tokens {tokens} must strictly increase [sglang-sps]")
    if len(tokens) != len(sps):
        out.add(
            "sglang",
            path.name,
            f"{len(tokens)} batch-token probes but {len(sps)} steps/s values [sglang-sps]",
        )
    if len(tokens) < 2:
        out.add(
            "sglang",
            path.name,
            "one probe only: SGLang treats it as the uninitialised flat table [sglang-sps]",
        )
    if doc["max_batch_tokens"] < max(tokens):
        out.add(
            "sglang",
            path.name,
            f"max_batch_tokens={doc['max_batch_tokens']} below the largest probe {max(tokens)} [sglang-sps]",
        )
    if any(s <= 0 for s in sps):
        out.add("sglang", path.name, "steps per second must be positive")


def _check_trtllm(path: Path, c: Mapping[str, Any], out: _Problems) -> None:
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        out.add("trtllm", path.name, f"not valid YAML ({str(e).splitlines()[0]})")
        return
    spec = (doc or {}).get("speculative_config") if isinstance(doc, dict) else None
    fields = {
        "decoding_type": lambda x: x == "DSpark",
        "max_draft_len": lambda x: _is_int(x) and x >= 1,
        "speculative_model_dir": lambda x: isinstance(x, str) and bool(x),
        "mask_token_id": lambda x: x == c.get("mask_token_id"),
        "target_layer_ids": lambda x: x == c.get("target_layer_ids"),
        "block_size": lambda x: x == c.get("block_size"),
        "markov_rank": lambda x: x == c.get("markov_rank"),
        "markov_head_type": lambda x: x in MARKOV_HEAD_TYPES and x == c.get("markov_head_type"),
        "draft_len_schedule": lambda x: isinstance(x, dict),
    }
    required = ("decoding_type", "max_draft_len", "speculative_model_dir")
    if not _check_fields(spec, fields, required, "trtllm", f"{path.name} speculative_config", "trtllm", out):
        return
    if spec.get("block_size", spec["max_draft_len"]) != spec["max_draft_len"]:
        out.add(
            "trtllm",
            path.name,
            f"block_size={spec['block_size']} differs from max_draft_len={spec['max_draft_len']} [trtllm]",
        )
    schedule = spec.get("draft_len_schedule")
    if schedule:
        keys = sorted(schedule)
        bad = [
            k
            for k in keys
            if not (
                _is_int(k) and k >= 1 and _is_int(schedule[k]) and 0 <= schedule[k] <= spec["max_draft_len"]
            )
        ]
        if bad:
            out.add(
                "trtllm",
                path.name,
                f"draft_len_schedule entries {bad}: batch sizes >= 1 to lengths in "
                f"[0, {spec['max_draft_len']}] [trtllm]",
            )
        elif schedule[keys[0]] != spec["max_draft_len"]:
            out.add(
                "trtllm",
                path.name,
                f"draft_len_schedule[{keys[0]}]={schedule[keys[0]]}: the smallest batch size must "
                f"map to max_draft_len={spec['max_draft_len']} [trtllm]",
            )


def check_directory(directory: str | Path, engines: Sequence[str] = ENGINES) -> list[str]:
    """Every problem an engine's loader would have with the exported `directory`, one line each
    (`'<engine>: <file>: <problem> [<source tag>]'`); empty when each of `engines` can load it. Side files
    are checked when present (an engine runs without them)."""
    directory = Path(directory)
    out = _Problems()
    try:
        c = layout.read_config(directory)
        specs = layout.tensor_specs(directory)
    except (FileNotFoundError, ValueError) as e:
        return [f"{engine}: {e}" for engine in engines]
    for engine in engines:
        if _check_draft_keys(c, engine, out):
            _check_tensors(c, specs, engine, out)
    if "sglang" in engines:
        if (directory / STS_FILE).is_file():
            _check_sts(directory / STS_FILE, c, out)
        if (directory / SPS_FILE).is_file():
            _check_sps(directory / SPS_FILE, out)
    if "trtllm" in engines and (directory / TRTLLM_FILE).is_file():
        _check_trtllm(directory / TRTLLM_FILE, c, out)
    return list(out)
