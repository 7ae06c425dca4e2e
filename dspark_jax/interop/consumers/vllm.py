"""vLLM as a consumer: `--speculative-config '{"method": "dspark", "model": OUT}'` reads the main directory.

vLLM takes DeepSpec's layout as it is, and a draft vocabulary in the EAGLE-3 convention: `draft_vocab_size`
K, `lm_head` and `markov_w2` over the K proposals, `d2t` int64 [K] with target id = i + d2t[i] (`t2d` is
skipped), the Markov head's `markov_w1` still over the target's ids (the predecessor is a target token).
Rules, from the PyPI release vllm 0.34.0 (paths below `vllm/`):

  [vllm-method]   model_executor/models/registry.py (Qwen3DSparkModel -> qwen3_dspark.Qwen3DSparkForCausalLM,
                  whose `speculator_config_class` is DSparkSpeculatorConfig: method 'dspark'); config/
                  speculative.py `SpeculativeConfig.hf_config_override`: DSparkDraftModel with model_type
                  'qwen3' rewritten to Qwen3DSparkModel, any other model_type taken for DeepSeek-V4's draft.
  [vllm-mask]     model_executor/models/qwen3_dflash.py: `dflash_config.mask_token_id`, else the top level.
  [vllm-layers]   v1/worker/gpu/spec_decode/eagle/eagle3_utils.py `get_eagle3_aux_layers_from_config`:
                  `dflash_config.target_layer_ids`, else the top-level `target_layer_ids`, each + 1;
                  model_executor/models/qwen2.py `Qwen2Model.forward` captures id j at the input of layer j
                  (after the last layer for j = num_layers: its raw output, which no trainer here reads), in
                  ascending order (interfaces.py `_set_aux_hidden_state_layers` sorts them).
  [vllm-weights]  model_executor/models/qwen3_dspark.py `Qwen3DSparkModel.__init__` / `DSparkMarkovHead` /
                  `DSparkConfidenceHead` / `Qwen3DSparkForCausalLM.load_weights`: `markov_rank` required;
                  `fc` [H, (target_hidden_size or H) * A]; `markov_w1` [V, R], `markov_w2` [K, R];
                  `confidence_head.proj` in float32, read only with `enable_confidence_head` (default
                  False), its width H + R only with `confidence_head_with_markov` (default False); `d2t`
                  renamed draft_id_to_target_id (absent: silently the identity map), `t2d` skipped;
                  `lm_head` [K, H] kept as the draft's own with K < V; `embed_tokens` / `lm_head` equal to
                  the target's shared with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dspark_jax.interop.consumers import base


def refuse(facts: base.DraftFacts) -> str | None:
    return None  # DeepSpec's layout, a draft vocabulary through d2t


def check(c: Mapping[str, Any], specs: base.Specs, out: base.Problems, directory: Path) -> None:
    arch = c.get("architectures") or []
    arch_ok = "Qwen3DSparkModel" in arch or ("DSparkDraftModel" in arch and c.get("model_type") == "qwen3")
    if not arch_ok:
        out.add(
            "config.json",
            f"architectures={arch!r}: vLLM runs a Qwen3 DSpark draft only as Qwen3DSparkModel (or "
            "DSparkDraftModel with model_type 'qwen3') [vllm-method]",
        )
    c = dict(c) | {  # [vllm-mask, vllm-layers]: dflash_config first
        key: base.first(c, key, "dflash_config")
        for key in ("mask_token_id", "target_layer_ids", "num_target_layers")
    }
    shape_ok = base.main_keys(c, out, arch_ok=True, tag="vllm-weights")
    ids = c["target_layer_ids"]
    shape_ok &= base.layer_ids(ids, c["num_target_layers"], out, "vllm-layers")
    if (c.get("dflash_config") or {}).get(
        "use_aux_hidden_state", c.get("use_aux_hidden_state", True)
    ) is False:
        out.add(
            "config.json",
            "use_aux_hidden_state=false: vLLM then builds no fc for the target's layers [vllm-weights]",
        )
    v = c.get("vocab_size")
    k = c.get("draft_vocab_size") or v
    if not (base.is_int(k) and base.is_int(v) and 0 < k <= v):
        out.add("config.json", f"draft_vocab_size={k!r} must be in [1, vocab_size={v}] [vllm-weights]")
        shape_ok = False
    if not shape_ok:
        return
    h, a = c["hidden_size"], len(ids)
    expected = base.float_shapes(base.qwen3_layers(c)) | base.markov_and_confidence(c, k)
    expected["fc.weight"] = ((h, (c.get("target_hidden_size") or h) * a), None)
    optional = base.float_shapes({"embed_tokens.weight": (v, h), "lm_head.weight": (k, h)})
    if k < v:
        expected |= {"lm_head.weight": ((k, h), None), "d2t": ((k,), "I64")}
        optional |= {"t2d": ((v,), "BOOL")}
    if not c.get("enable_confidence_head", False):  # then dropped, present or not
        optional |= {
            name: expected.pop(name) for name in list(expected) if name.startswith("confidence_head.")
        }
    base.tensors(specs, expected, optional, out, "vllm-weights")


CONSUMER = base.Consumer(name="vllm", release="vllm-project/vllm (commits above)", check=check, refuse=refuse)
