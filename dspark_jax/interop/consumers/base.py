"""What a consumer of an exported draft is, and the checks the consumers share.

A consumer (a serving engine, a trainer, DeepSpec's evaluator) reads an exported draft with its own loader.
Each module of this package describes one: the directory it reads (the export's main one, in DeepSpec's
layout, or one of its own below it), how that directory is made from the main one (`form`), the files of its
own written beside the draft (`side_files`), which drafts it cannot run and what would make them work
(`refuse`, `last_layer`), and `check`, every rule its loader applies, each citing the file and symbol of the
consumer's code it comes from by a tag in brackets (the module's docstring lists the tags). Tensors are
described by their safetensors headers: `{name: (shape, dtype)}`.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

Specs = Mapping[str, tuple[tuple[int, ...], str]]
Tensors = dict[str, np.ndarray]
FLOAT_DTYPES = ("F32", "BF16", "F16")
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")


@dataclasses.dataclass(frozen=True)
class DraftFacts:
    """What an export is about to write, known before anything is: the consumers' refusals read it."""

    num_target_layers: int
    target_layer_ids: tuple[int, ...]
    vocab_size: int
    draft_vocab_size: int | None  # None: the whole vocabulary


class Problems(list):
    """One line per problem: `'<consumer>: <where>: <what> [<source tag>]'`; `last_layer` is the consumer's
    (`Consumer.last_layer`), which `layer_ids` applies."""

    def __init__(self, consumer: str, last_layer: str | None = None):
        super().__init__()
        self.consumer = consumer
        self.last_layer = last_layer

    def add(self, where: str, text: str) -> None:
        self.append(f"{self.consumer}: {where}: {text}")


@dataclasses.dataclass(frozen=True)
class Calibration:
    """The exported step's calibration (`python -m dspark_jax.calibrate`) of one acceptance, per draft
    position."""

    mode: str  # the acceptance calibrated: 'greedy' or 'sampling'
    dataset: str  # the text its blocks came from
    num_samples: int  # blocks the temperatures were fitted on
    temperatures: tuple[float, ...]
    ece_before: tuple[float, ...]  # on the held-out blocks, before and after the fit
    ece_after: tuple[float, ...]
    survival: tuple[float, ...]  # the measured cumulative acceptance over the held-out blocks


@dataclasses.dataclass(frozen=True)
class RunFile:
    """One of the run's files a side file is made from: where it is, what it holds (None: not made), and
    the command that makes it."""

    path: str
    content: Any
    made_by: str


@dataclasses.dataclass(frozen=True)
class SideSources:
    """What the exporter hands each consumer's `side_files`."""

    directory: Path  # the export's main directory, absolute
    config_json: Mapping[str, Any]  # the main directory's config.json
    step: int
    experiment: str
    calibration: RunFile  # a `Calibration` of the exported step, of the acceptance asked for
    sps_table: RunFile  # the run's profiled verify-cost table (`side_files.sps_file`)


@dataclasses.dataclass(frozen=True)
class Consumer:
    """One consumer of exported drafts (see the module docstring).

    `check(config, specs, problems, directory)` adds a line per rule the directory breaks (its side files
    read from `directory`); `form(config, tensors)` makes
    the consumer's own `(config.json, tensors)` from the main directory's (None: it reads the main one);
    `side_files(sources)` its own files, `{file name: JSON or YAML content}`, written into its directory;
    `refuse(facts)` says why the consumer cannot run the draft and what would make it work (None: it can);
    `last_layer` why it cannot read the target's last layer's output (None: it can; the ids are layer
    outputs, DeepSpec's `target_layer_ids`);
    `reads` / `read` import a draft in the consumer's own form (a trainer's checkpoint).
    """

    name: str
    release: str  # the release whose code the rules come from (and the tests run), or the commit read
    check: Callable[[Mapping[str, Any], Specs, Problems, Path], None]
    refuse: Callable[[DraftFacts], str | None]
    subdir: str = ""  # '' = the export's main directory
    form: Callable[[dict[str, Any], Tensors], tuple[dict[str, Any], Tensors]] | None = None
    side_files: Callable[[SideSources], dict[str, Any]] | None = None
    last_layer: str | None = None
    # A draft this consumer wrote (trained elsewhere) read back: `reads(config)` says whether a config.json is
    # of its form, `read(config)` gives the DeepSpec config.json it describes (its tensors keep their names).
    reads: Callable[[Mapping[str, Any]], bool] | None = None
    read: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None


# ---- Shared rules --------------------------------------------------------------------------------------


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def first(config: Mapping[str, Any], key: str, *sections: str) -> Any:
    """`config[section][key]` of the first section that has it, else `config[key]` (None when absent)."""
    for section in sections:
        value = (config.get(section) or {}).get(key)
        if value is not None:
            return value
    return config.get(key)


def positive_ints(c: Mapping[str, Any], keys, out: Problems, where: str = "config.json") -> bool:
    """Each of `keys` a positive integer in `c`; False (with a line each) where one is not."""
    ok = True
    for key in keys:
        if not (is_int(c.get(key)) and c[key] > 0):
            out.add(where, f"{key}={c.get(key)!r}, expected a positive integer")
            ok = False
    return ok


QWEN3_SHAPE_KEYS = (
    "hidden_size",
    "vocab_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
)


def layer_ids(ids: Any, num_target_layers: Any, out: Problems, tag: str, where: str = "config.json") -> bool:
    """`ids` (layer outputs, DeepSpec's convention) increase within the target's layers, and spare its last
    where the consumer cannot read that layer's output (`out.last_layer`); False when they are not a list of
    layer indices."""
    if not (isinstance(ids, list) and ids and all(is_int(i) for i in ids)):
        out.add(where, f"target_layer_ids={ids!r}, expected a non-empty list of layer indices [{tag}]")
        return False
    if any(b <= a for a, b in itertools.pairwise(ids)) or ids[0] < 0:
        out.add(where, f"target_layer_ids={ids} must increase from 0 [{tag}]")
    if is_int(num_target_layers):
        if ids[-1] >= num_target_layers:
            out.add(where, f"target_layer_ids={ids} past the target's {num_target_layers} layers [{tag}]")
        elif ids[-1] == num_target_layers - 1 and out.last_layer:
            out.add(
                where,
                f"target_layer_ids={ids} taps the target's last layer {num_target_layers - 1}, whose output "
                f"{out.last_layer}; retrain on inner layers (data.aux_layer_ids)",
            )
    return True


def qwen3_layers(c: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """The draft's Qwen3 decoder layers and norms (`norm`, `hidden_norm`) by tensor name -> shape."""
    h = c["hidden_size"]
    d = c.get("head_dim") or h // c["num_attention_heads"]
    q, g, i = c["num_attention_heads"] * d, c["num_key_value_heads"] * d, c["intermediate_size"]
    out = {"hidden_norm.weight": (h,), "norm.weight": (h,)}
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
    return out


def tensors(
    specs: Specs,
    expected: Mapping[str, tuple[tuple[int, ...], str | None]],
    optional: Mapping[str, tuple[tuple[int, ...], str | None]],
    out: Problems,
    tag: str,
) -> None:
    """Every `expected` tensor present with its shape (and dtype where one is named; a float otherwise), an
    `optional` one right where present, nothing else (what the consumer's loader builds or refuses)."""
    for name, (shape, _) in expected.items():
        if name not in specs:
            out.add("weights", f"missing tensor {name} {list(shape)} [{tag}]")
    for name, (shape, dtype) in specs.items():
        want = expected.get(name) or optional.get(name)
        if want is None:
            out.add(
                "weights", f"unexpected tensor {name} {list(shape)}: the loader has no such parameter [{tag}]"
            )
            continue
        if tuple(shape) != tuple(want[0]):
            out.add(
                "weights", f"tensor {name} has shape {list(shape)}, the loader builds {list(want[0])} [{tag}]"
            )
        if want[1] is not None and dtype != want[1]:
            out.add("weights", f"tensor {name} is {dtype}, the loader reads {want[1]} [{tag}]")
        elif want[1] is None and dtype not in FLOAT_DTYPES:
            out.add("weights", f"tensor {name} is {dtype}, expected one of {FLOAT_DTYPES} [{tag}]")


def float_shapes(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[tuple[int, ...], None]]:
    return {name: (shape, None) for name, shape in shapes.items()}


def main_keys(c: Mapping[str, Any], out: Problems, *, arch_ok: bool, tag: str) -> bool:
    """The keys of the export's main directory (DeepSpec's config.json) that every engine reading it takes,
    at the top level of `c` (a consumer reading some elsewhere passes `c` with them resolved there); False
    when the draft's shape cannot be read from them (tensors not checked then). `arch_ok`: the consumer's
    own verdict on `architectures`."""
    if not arch_ok:
        out.add(
            "config.json",
            f"architectures={c.get('architectures')!r}: the draft class is Qwen3DSparkModel [{tag}]",
        )
    if c.get("model_type") != "qwen3":
        out.add(
            "config.json",
            f"model_type={c.get('model_type')!r}, expected 'qwen3' (the draft's layers) [{tag}]",
        )
    shape_ok = positive_ints(c, (*QWEN3_SHAPE_KEYS, "block_size"), out)
    mask = c.get("mask_token_id")
    if not is_int(mask):
        out.add(
            "config.json",
            f"mask_token_id={mask!r}: the target row used as MASK (an integer; a learned MASK vector has no "
            f"row) [{tag}]",
        )
    elif is_int(c.get("vocab_size")) and not 0 <= mask < c["vocab_size"]:
        out.add("config.json", f"mask_token_id={mask} outside the vocabulary [0, {c['vocab_size']}) [{tag}]")
    rank = c.get("markov_rank")
    if not (is_int(rank) and rank > 0):
        out.add(
            "config.json", f"markov_rank={rank!r}: a positive integer at the top level is required [{tag}]"
        )
        shape_ok = False
    if c.get("markov_head_type") not in MARKOV_HEAD_TYPES:
        out.add(
            "config.json",
            f"markov_head_type={c.get('markov_head_type')!r}, expected one of {MARKOV_HEAD_TYPES} [{tag}]",
        )
    if c.get("hidden_act", "silu") != "silu":
        out.add("config.json", f"hidden_act={c.get('hidden_act')!r}: the draft MLP is silu [{tag}]")
    causal = (c.get("dflash_config") or {}).get("causal") or c.get("is_causal")
    sliding = [i for i, t in enumerate(c.get("layer_types") or []) if t == "sliding_attention"]
    if causal or sliding:
        what = "causal set" if causal else f"sliding layers {sliding}"
        out.add(
            "config.json",
            f"causal attention ({what}): the draft was trained bidirectional inside its block [{tag}]",
        )
    return shape_ok


def deepspec_tensors(
    c: Mapping[str, Any], specs: Specs, out: Problems, tag: str, *, confidence_dtype: str | None = "F32"
) -> None:
    """The tensors of DeepSpec's layout for the config `c` (whole vocabulary, `fc` over A x H): every one
    required, the target's embedding and LM head optional, nothing else (`tensors`)."""
    h, v, a = c["hidden_size"], c["vocab_size"], len(c["target_layer_ids"])
    expected = float_shapes(qwen3_layers(c) | {"fc.weight": (h, a * h)})
    expected |= markov_and_confidence(c, v, confidence_dtype)
    target = float_shapes(dict.fromkeys(("embed_tokens.weight", "lm_head.weight"), (v, h)))
    tensors(specs, expected, target, out, tag)


def markov_and_confidence(
    c: Mapping[str, Any], w2_rows: int, confidence_dtype: str | None = "F32"
) -> dict[str, tuple[tuple[int, ...], str | None]]:
    """The vanilla Markov head over `w2_rows` proposals and the confidence head on `[h; m]` (the engines
    build it in float32; None: any float)."""
    h, v, r = c["hidden_size"], c["vocab_size"], c["markov_rank"]
    return {
        "markov_head.markov_w1.weight": ((v, r), None),
        "markov_head.markov_w2.weight": ((w2_rows, r), None),
        "confidence_head.proj.weight": ((1, h + r), confidence_dtype),
        "confidence_head.proj.bias": ((1,), confidence_dtype),
    }


def load_json(path: Path, out: Problems) -> Any:
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        out.add(path.name, f"not valid JSON ({e})")
        return None


def fields(
    doc: Any, valid: Mapping[str, Callable[[Any], bool]], required, where: str, tag: str, out: Problems
) -> bool:
    """Each key of `valid` that `doc` holds passes its test, and the `required` ones are there."""
    if not isinstance(doc, dict):
        out.add(where, f"expected a JSON object, got {type(doc).__name__} [{tag}]")
        return False
    ok = True
    for key, test in valid.items():
        if key not in doc:
            if key in required:
                out.add(where, f"{key} is missing [{tag}]")
                ok = False
        elif not test(doc[key]):
            out.add(where, f"{key}={doc[key]!r} has the wrong type or value [{tag}]")
            ok = False
    return ok


def floats(x: Any) -> bool:
    return isinstance(x, list) and all(is_number(v) for v in x)
