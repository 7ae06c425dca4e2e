"""DeepSpec (deepseek-ai/DeepSpec) as a consumer: `Qwen3DSparkModel.from_pretrained(OUT)` and its evaluator.

The export's main directory is DeepSpec's own layout (`dspark_jax.interop.deepspec_layout`, which cites
the modeling files); the draft carries the target's embedding and LM head. DeepSpec has no release on the
package registry; its rules were read at commit afdfa7c9 (its code ran on the sample export there, to
~1e-6, with its pinned transformers 5.10.2; `tests/test_export.py` holds an independent float64 forward):

  [deepspec-model]   deepspec/modeling/dspark/qwen3/modeling.py `Qwen3DSparkModel` (asserts
                     target_layer_ids, mask_token_id, num_anchors, enable_confidence_head, markov_rank,
                     markov_head_type, confidence_head_with_markov, block_size) and its config
                     `build_draft_config`: the tensors of `deepspec_layout.tensor_layout` plus embed_tokens /
                     lm_head [V, H], a vanilla Markov head over the whole vocabulary (no draft vocabulary),
                     the confidence head on [h; m], `fc` over A x the draft's hidden size.
  [deepspec-layers]  deepspec/eval/base_evaluator.py `assert_no_final_target_layer` (called by
                     eval/dspark/evaluator.py `Qwen3DSparkEvaluator.build_models`): no target_layer_ids entry
                     is the target's last layer (transformers' hidden_states[N] is the final norm's output,
                     while its training cache hooks the raw layer outputs); `extract_context_feature` reads
                     layer k as hidden_states[k + 1].
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dspark_jax.interop import deepspec_layout as layout
from dspark_jax.interop.consumers import base


def refuse(facts: base.DraftFacts) -> str | None:
    if facts.draft_vocab_size:
        return (
            "DeepSpec's Markov head and LM head cover the whole vocabulary (no draft-to-target map; this "
            f"draft proposes from {facts.draft_vocab_size} tokens): train with train.draft_vocab=0 "
            "[deepspec-model]"
        )
    return None


def check(c: Mapping[str, Any], specs: base.Specs, out: base.Problems, directory: Path) -> None:
    shape_ok = base.main_keys(
        c, out, arch_ok=c.get("architectures") == [layout.ARCHITECTURE], tag="deepspec-model"
    )
    shape_ok &= base.layer_ids(c.get("target_layer_ids"), c.get("num_target_layers"), out, "deepspec-layers")
    if c.get("draft_vocab_size", c.get("vocab_size")) != c.get("vocab_size"):
        out.add(
            "config.json",
            f"draft_vocab_size={c['draft_vocab_size']}: DeepSpec has no draft vocabulary [deepspec-model]",
        )
        shape_ok = False
    if not shape_ok:
        return
    h, v, a = c["hidden_size"], c["vocab_size"], len(c["target_layer_ids"])
    expected = base.float_shapes(base.qwen3_layers(c)) | base.markov_and_confidence(c, v, None)
    expected |= base.float_shapes({"fc.weight": (h, a * h)} | dict.fromkeys(layout.TARGET_TENSORS, (v, h)))
    base.tensors(specs, expected, {}, out, "deepspec-model")


CONSUMER = base.Consumer(
    name="deepspec",
    release="deepseek-ai/DeepSpec (GitHub)",
    check=check,
    refuse=refuse,
    last_layer="DeepSpec's evaluator refuses [deepspec-layers]",
)
