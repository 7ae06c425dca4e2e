"""vllm-project's `speculators` as a consumer: its own DSpark format, `OUT/speculators/`.

`SpeculatorModel.from_pretrained` reads a directory whose config.json names `speculators_model_type`; any
other directory goes to its auto-conversion, which knows DFlash only, so a DSpark draft needs the
speculators form: the draft's layer shape nested as `transformer_layer_config`, the aux layers in vLLM's
capture convention (the state entering layer i: DeepSpec's id + 1), the block laid out from the anchor
(`sample_from_anchor`, the layout this project trains: slot 0 holds the anchor and predicts the next
token, as DeepSpec's). The tensors keep DeepSpec's names; a draft vocabulary adds `t2d` and `d2t`. Rules,
from the PyPI release speculators 0.9.0 (paths below `speculators/`):

  [speculators-load]    model.py `SpeculatorModel.from_pretrained`, convert/entrypoints.py
                        `maybe_convert_external_checkpoint` ("unrecognized external format. Supported
                        auto-conversion: DFlash"): without `speculators_model_type` a directory must
                        convert.
  [speculators-config]  models/dspark/config.py `DSparkSpeculatorConfig` (over models/dflash/config.py
                        `DFlashSpeculatorConfig`): transformer_layer_config, draft_vocab_size (default 32000),
                        block_size, aux_hidden_state_layer_ids, mask_token_id, sample_from_anchor (False: the
                        DFlash 1 + N layout, one slot off), markov_rank, markov_head_type,
                        enable_confidence_head, confidence_head_with_markov.
  [speculators-weights] models/dflash/core.py `DFlashDraftModel.__init__`, models/dspark/model_definitions.py,
                        model.py `DraftVocabMixin._init_vocab` / `load_vocab_mappings`: DeepSpec's names;
                        markov_w1 [V, R] over target ids, markov_w2 and lm_head over the draft vocabulary;
                        `t2d` bool [V] and `d2t` int64 [K] (target id = i + d2t[i]) present only with a draft
                        vocabulary; embed_tokens / lm_head from the file when no verifier path is named.
  [speculators-layers]  models/utils.py `resolve_target_layer_ids` (ids up to num_layers), convert/dflash/
                        converter.py `_build_config` (speculators id = DeepSpec id + 1),
                        scripts/launch_vllm.py `--include-last-layer` and train/data.py: the last layer is
                        split off as the training target, so a draft tapping it cannot be trained further on
                        speculators' data.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from dspark_jax.interop.consumers import base

MODEL_TYPE = "dspark"
LAYER_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "max_position_embeddings",
    "rope_parameters",
    "hidden_act",
    "attention_bias",
    "layer_types",
    "bos_token_id",
    "eos_token_id",
    "tie_word_embeddings",
    "model_type",
)


def form(config: dict[str, Any], tensors: base.Tensors) -> tuple[dict[str, Any], base.Tensors]:
    """The speculators config.json and tensors (with a draft vocabulary, `t2d` added beside `d2t`)."""
    vocab = config["vocab_size"]
    own = {
        "speculators_model_type": MODEL_TYPE,
        "architectures": ["DSparkDraftModel"],
        "transformer_layer_config": {k: config[k] for k in LAYER_KEYS if k in config},
        "draft_vocab_size": config.get("draft_vocab_size") or vocab,
        "block_size": config["block_size"],
        "aux_hidden_state_layer_ids": [i + 1 for i in config["target_layer_ids"]],
        "mask_token_id": config["mask_token_id"],
        "sample_from_anchor": True,
        "markov_rank": config["markov_rank"],
        "markov_head_type": config["markov_head_type"],
        "enable_confidence_head": config["enable_confidence_head"],
        "confidence_head_with_markov": config["confidence_head_with_markov"],
        "num_target_layers": config["num_target_layers"],  # not speculators' (extra keys pass): the checks'
        "torch_dtype": config.get("torch_dtype"),
        "dspark_jax": config.get("dspark_jax"),
    }
    tensors = dict(tensors)
    if "d2t" in tensors:
        t2d = np.zeros(vocab, bool)
        t2d[np.arange(len(tensors["d2t"])) + tensors["d2t"]] = True
        tensors["t2d"] = t2d
    return own, tensors


def reads(config: Mapping[str, Any]) -> bool:
    return config.get("speculators_model_type") == MODEL_TYPE


def read(config: Mapping[str, Any]) -> dict[str, Any]:
    """The DeepSpec config of a speculators DSpark draft: the layer shape from `transformer_layer_config`,
    the aux ids back to layer outputs (- 1) [speculators-layers]; `num_target_layers` only where `form`
    wrote it (speculators records no target depth). A block laid out DFlash's way is refused."""
    if config.get("sample_from_anchor") is not True:
        raise ValueError(
            "sample_from_anchor is not true: the draft's blocks are DFlash's 1 + N layout (slot 0 the bonus "
            "token), one slot off this project's [speculators-config]"
        )
    if config.get("markov_head_type") != "vanilla":
        raise ValueError(
            f"a {config.get('markov_head_type')!r} Markov head: this project's drafts are vanilla"
        )
    layer = dict(config["transformer_layer_config"])
    rope = layer.get("rope_parameters") or {}
    keys = ("block_size", "mask_token_id", "markov_rank", "markov_head_type", "enable_confidence_head")
    return (
        layer
        | {key: config[key] for key in keys}
        | {
            "architectures": ["Qwen3DSparkModel"],
            "model_type": "qwen3",
            "rope_theta": layer.get("rope_theta", rope.get("rope_theta")),
            "target_layer_ids": [i - 1 for i in config["aux_hidden_state_layer_ids"]],
            "confidence_head_with_markov": config["confidence_head_with_markov"],
            "num_target_layers": config.get("num_target_layers"),
            "draft_vocab_size": config.get("draft_vocab_size"),
        }
    )


def refuse(facts: base.DraftFacts) -> str | None:
    return None  # a draft vocabulary maps through t2d / d2t


def check(c: Mapping[str, Any], specs: base.Specs, out: base.Problems, directory: Path) -> None:
    if c.get("speculators_model_type") != MODEL_TYPE:
        out.add(
            "config.json",
            f"speculators_model_type={c.get('speculators_model_type')!r}: without 'dspark' speculators tries "
            "its auto-conversion, which knows DFlash only (export --for=speculators) [speculators-load]",
        )
        return
    layer = c.get("transformer_layer_config")
    if not isinstance(layer, dict):
        out.add(
            "config.json", "transformer_layer_config is missing: the draft's layer shape [speculators-config]"
        )
        return
    shape_ok = base.positive_ints(layer, base.QWEN3_SHAPE_KEYS, out, "config.json transformer_layer_config")
    for key in ("block_size", "markov_rank"):
        shape_ok &= base.positive_ints(c, (key,), out)
    vocab, draft_vocab = layer.get("vocab_size"), c.get("draft_vocab_size")
    if not (base.is_int(draft_vocab) and 0 < draft_vocab <= (vocab or 0)):
        out.add(
            "config.json",
            f"draft_vocab_size={draft_vocab!r}: the draft's vocabulary, <= "
            f"transformer_layer_config.vocab_size {vocab!r} (absent, speculators takes 32000) "
            "[speculators-config]",
        )
        shape_ok = False
    if c.get("sample_from_anchor") is not True:
        out.add(
            "config.json",
            f"sample_from_anchor={c.get('sample_from_anchor')!r}: the draft's slot 0 holds the anchor and "
            "predicts the next token; False is DFlash's 1 + N layout, one slot off [speculators-config]",
        )
    if c.get("markov_head_type") != "vanilla":
        out.add(
            "config.json",
            f"markov_head_type={c.get('markov_head_type')!r}, expected 'vanilla' [speculators-config]",
        )
    if c.get("enable_confidence_head") is not True or c.get("confidence_head_with_markov") is not True:
        out.add(
            "config.json",
            "enable_confidence_head and confidence_head_with_markov must be true (the head reads [h; m]) "
            "[speculators-config]",
        )
    mask = c.get("mask_token_id")
    if not (base.is_int(mask) and 0 <= mask < (vocab or 0)):
        out.add("config.json", f"mask_token_id={mask!r}: a row of the vocabulary [speculators-config]")
    aux = c.get("aux_hidden_state_layer_ids")
    deepspec_ids = [i - 1 for i in aux] if isinstance(aux, list) and all(map(base.is_int, aux)) else aux
    shape_ok &= base.layer_ids(
        deepspec_ids,
        c.get("num_target_layers"),
        out,
        "speculators-layers",
        "config.json aux_hidden_state_layer_ids - 1",
    )
    if not shape_ok:
        return
    h, r, k, a = layer["hidden_size"], c["markov_rank"], draft_vocab, len(aux)
    expected = base.float_shapes(base.qwen3_layers(layer)) | {
        "fc.weight": ((h, a * h), None),
        "markov_head.markov_w1.weight": ((vocab, r), None),
        "markov_head.markov_w2.weight": ((k, r), None),
        "confidence_head.proj.weight": ((1, h + r), None),
        "confidence_head.proj.bias": ((1,), None),
        "embed_tokens.weight": ((vocab, h), None),  # no verifier path is named: the file's are used
        "lm_head.weight": ((k, h), None),
    }
    if k < vocab:
        expected |= {"t2d": ((vocab,), "BOOL"), "d2t": ((k,), "I64")}
    base.tensors(specs, expected, {}, out, "speculators-weights")


CONSUMER = base.Consumer(
    name="speculators",
    release="speculators 0.9.0 (PyPI)",
    check=check,
    refuse=refuse,
    subdir="speculators",
    form=form,
    last_layer="speculators' data pipeline splits off as the training target [speculators-layers]",
    reads=reads,
    read=read,
)
