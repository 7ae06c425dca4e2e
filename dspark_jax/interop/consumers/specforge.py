"""SpecForge (sgl-project's trainer) as a consumer: warm-starting or evaluating a draft, `OUT/specforge/`.

SpecForge names the draft `DSparkDraftModel` and reads every DSpark setting from a nested `dflash_config`
only; SGLang's loader names it `Qwen3DSparkModel`, and SpecForge accepts exactly one architecture, so no
config.json serves both: the export writes SpecForge its own directory, as `specforge export --to hf` does
(the 40 draft tensors; the target's embedding and LM head come from the target). Rules, from the PyPI
release specforge 0.2.0 (paths below `specforge/`):

  [specforge-arch]     training/model_loading.py `_draft_config_from_dict` and modeling/auto.py
                       `AutoDraftModel._model_cls_from_config`: `architectures` holds exactly one name, a
                       registered one; algorithms/dspark/providers.py: a DSpark run takes `DSparkDraftModel`.
  [specforge-keys]     modeling/draft/dflash.py `DFlashDraftModel.__init__` and modeling/draft/dspark.py
                       `DSparkDraftModel.__init__` / `_init_draft_head` / `build_markov_head`:
                       target_layer_ids, mask_token_id, markov_rank, markov_head_type, enable_confidence_head,
                       confidence_head_with_markov read from `dflash_config` only (top-level copies ignored):
                       without them the draft silently loses its Markov and confidence heads and reads layers
                       [1, 1, 1]; top-level `block_size` (>= 2) and `num_target_layers` are required;
                       `projector_type` is 'dspark'; `attention_mode` 'gqa' needs fewer KV than query heads.
  [specforge-weights]  modeling/draft/dspark.py `VanillaMarkovHead` (markov_w1 nn.Embedding [V, R], markov_w2
                       nn.Linear(R, V): no draft vocabulary), `AcceptRatePredictor` (proj [1, H + R] with
                       Markov input); training/model_loading.py `warm_start_draft_model`: a missing tensor
                       is an error, an unexpected one dropped silently; no embed_tokens / lm_head in the
                       draft.
  [specforge-layers]   modeling/draft/dflash.py `extract_context_feature`: layer k read as
                       hidden_states[k + 1] (transformers' output_hidden_states), concatenated in
                       target_layer_ids order.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dspark_jax.interop import deepspec_layout as layout
from dspark_jax.interop.consumers import base

ARCHITECTURE = "DSparkDraftModel"
KEYS = (
    "target_layer_ids",
    "mask_token_id",
    "markov_rank",
    "markov_head_type",
    "enable_confidence_head",
    "confidence_head_with_markov",
)


def form(config: dict[str, Any], tensors: base.Tensors) -> tuple[dict[str, Any], base.Tensors]:
    """SpecForge's config.json (one architecture, the DSpark keys nested) and its 40 draft tensors."""
    nested = {key: config[key] for key in KEYS} | {
        "projector_type": "dspark",
        "attention_mode": "gqa" if config["num_key_value_heads"] < config["num_attention_heads"] else "mha",
    }
    own = config | {"architectures": [ARCHITECTURE], "dflash_config": nested}
    return own, {k: v for k, v in tensors.items() if k not in layout.TARGET_TENSORS}


def reads(config: Mapping[str, Any]) -> bool:
    return config.get("architectures") == [ARCHITECTURE] and isinstance(config.get("dflash_config"), dict)


def read(config: Mapping[str, Any]) -> dict[str, Any]:
    """The DeepSpec config of a SpecForge draft (its `specforge export --to hf` or `form`'s): the DSpark keys
    from `dflash_config`, where SpecForge reads them [specforge-keys]."""
    nested = config["dflash_config"]
    if nested.get("markov_head_type", "vanilla") != "vanilla":
        raise ValueError(f"a {nested['markov_head_type']!r} Markov head: this project's drafts are vanilla")
    return (
        dict(config)
        | {key: nested[key] for key in KEYS if key in nested}
        | {"architectures": ["Qwen3DSparkModel"]}
    )


def refuse(facts: base.DraftFacts) -> str | None:
    if facts.draft_vocab_size:
        return (
            f"SpecForge's Markov head covers the whole vocabulary ({facts.vocab_size} rows of markov_w2) and "
            f"it maps no draft vocabulary (this draft has {facts.draft_vocab_size}): train with "
            "train.draft_vocab=0 [specforge-weights]"
        )
    return None


def check(c: Mapping[str, Any], specs: base.Specs, out: base.Problems, directory: Path) -> None:
    arch = c.get("architectures")
    if arch != [ARCHITECTURE]:
        out.add(
            "config.json",
            f"architectures={arch!r}: SpecForge takes exactly one registered name, {ARCHITECTURE!r} "
            "(export --for=specforge writes it its own directory) [specforge-arch]",
        )
    nested = c.get("dflash_config")
    if not isinstance(nested, dict):
        out.add(
            "config.json",
            "no dflash_config: SpecForge reads the DSpark keys only there, and without them builds a draft "
            "with no Markov or confidence head, on layers of its own choosing (export --for=specforge) "
            "[specforge-keys]",
        )
        return
    missing = [key for key in KEYS if key not in nested]
    if missing:
        out.add("config.json", f"dflash_config lacks {', '.join(missing)} [specforge-keys]")
    drifted = [key for key in KEYS if key in nested and key in c and c[key] != nested[key]]
    if drifted:
        out.add(
            "config.json",
            f"dflash_config's {', '.join(drifted)} differ from the top level's: SpecForge reads the nested "
            "ones [specforge-keys]",
        )
    shape_ok = base.positive_ints(c, base.QWEN3_SHAPE_KEYS, out)
    if not (base.is_int(c.get("block_size")) and c["block_size"] >= 2):
        out.add(
            "config.json",
            f"block_size={c.get('block_size')!r}: an integer >= 2 at the top level [specforge-keys]",
        )
    if not base.is_int(c.get("num_target_layers")):
        out.add("config.json", "num_target_layers is missing at the top level [specforge-keys]")
    ids_ok = base.layer_ids(
        nested.get("target_layer_ids"), c.get("num_target_layers"), out, "specforge-layers"
    )
    rank = nested.get("markov_rank")
    if not (base.is_int(rank) and rank > 0):
        out.add("config.json", f"dflash_config.markov_rank={rank!r}: a positive integer [specforge-keys]")
        shape_ok = False
    if nested.get("markov_head_type", "vanilla") != "vanilla":
        out.add(
            "config.json", "only the vanilla Markov head is a DSpark draft of this project [specforge-keys]"
        )
    mask = nested.get("mask_token_id")
    if not (base.is_int(mask) and 0 <= mask < c.get("vocab_size", 0)):
        out.add(
            "config.json", f"dflash_config.mask_token_id={mask!r}: a row of the vocabulary [specforge-keys]"
        )
    if nested.get("projector_type", "dspark") != "dspark":
        out.add(
            "config.json",
            f"dflash_config.projector_type={nested['projector_type']!r}, must be 'dspark' [specforge-keys]",
        )
    if (
        nested.get("enable_confidence_head") is not True
        or nested.get("confidence_head_with_markov") is not True
    ):
        out.add(
            "config.json",
            "enable_confidence_head and confidence_head_with_markov must be true: the draft's confidence "
            "head reads [h; m] (otherwise SpecForge drops it silently) [specforge-keys]",
        )
    if not (shape_ok and ids_ok):
        return
    h, v, r, a = c["hidden_size"], c["vocab_size"], rank, len(nested["target_layer_ids"])
    expected = base.float_shapes(base.qwen3_layers(c)) | {
        "fc.weight": ((h, a * h), None),
        "markov_head.markov_w1.weight": ((v, r), None),
        "markov_head.markov_w2.weight": ((v, r), None),
        "confidence_head.proj.weight": ((1, h + r), None),
        "confidence_head.proj.bias": ((1,), None),
    }
    optional = base.float_shapes(dict.fromkeys(layout.TARGET_TENSORS, (v, h)))  # dropped, as SpecForge does
    base.tensors(specs, expected, optional, out, "specforge-weights")


CONSUMER = base.Consumer(
    name="specforge",
    release="specforge 0.2.0 (PyPI)",
    check=check,
    refuse=refuse,
    subdir="specforge",
    form=form,
    last_layer="SpecForge reads as hidden_states[k + 1], there the final norm's output [specforge-layers]",
    reads=reads,
    read=read,
)
