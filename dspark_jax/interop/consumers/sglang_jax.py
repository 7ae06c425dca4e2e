"""sglang-jax (SGLang's JAX engine, TPU) as a consumer: its DSpark worker reads the main directory.

sgl-project/sglang-jax gained a DSpark draft in PR #1632, read at commit 8941115b of the PR's branch (no
release on the package registry holds it: PyPI's sglang-jax 0.0.1.post1 predates DFlash; its code ran on
the sample export to ~1e-6 with the paged attention kernel replaced, nothing here runs it in the tests):
a vanilla Markov head, no confidence head (its tensors are not read), the target's embedding and LM head,
`--speculative-sample-from-anchor` (PR #1619) for DSpark's block layout. Rules:

  [sgljax-model]    python/sgl_jax/srt/models/dspark.py `DSparkDraftModel.__init__` (markov_rank > 0 and
                    markov_head_type exactly 'vanilla') and `_create_weight_mappings` (over models/dflash.py
                    `DFlashDraftModel`: fc, hidden_norm, norm, the Qwen3 layers, `markov_head.markov_w1` /
                    `markov_w2` [V, R]; a missing one a ValueError; the top-level `rope_theta`, 1e6 when
                    absent); speculative/dspark_worker.py `DSparkWorker._validate_draft_model`: the Markov
                    head over the target's vocabulary (no draft vocabulary).
  [sgljax-capture]  python/sgl_jax/srt/models/qwen3.py `set_dflash_layers_to_capture`: layer k's output taken
                    at the input of layer k + 1; the last layer's never ("DFLASH target hidden feature
                    mismatch" at the first draft step).
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
            "sglang-jax's Markov head covers the whole vocabulary (no draft-to-target map; this draft "
            f"proposes from {facts.draft_vocab_size} tokens): train with train.draft_vocab=0 [sgljax-model]"
        )
    return None


def check(c: Mapping[str, Any], specs: base.Specs, out: base.Problems, directory: Path) -> None:
    arch_ok = layout.ARCHITECTURE in (c.get("architectures") or [])
    c = dict(c) | {key: base.first(c, key, "dflash_config") for key in ("mask_token_id", "target_layer_ids")}
    shape_ok = base.main_keys(c, out, arch_ok=arch_ok, tag="sgljax-model")
    ids = c["target_layer_ids"]
    shape_ok &= base.layer_ids(ids, c.get("num_target_layers"), out, "sgljax-capture")
    if c.get("markov_head_type") not in (None, "vanilla"):
        out.add(
            "config.json",
            f"markov_head_type={c['markov_head_type']!r}: sglang-jax runs the vanilla head [sgljax-model]",
        )
    if c.get("draft_vocab_size", c.get("vocab_size")) != c.get("vocab_size"):
        out.add(
            "config.json", f"draft_vocab_size={c['draft_vocab_size']}: no draft vocabulary [sgljax-model]"
        )
        shape_ok = False
    if not shape_ok:
        return
    h, v, r, a = c["hidden_size"], c["vocab_size"], c["markov_rank"], len(ids)
    expected = base.float_shapes(
        base.qwen3_layers(c)
        | {
            "fc.weight": (h, a * h),
            "markov_head.markov_w1.weight": (v, r),
            "markov_head.markov_w2.weight": (v, r),
        }
    )
    unread = {"confidence_head.proj.weight": (1, h + r), "confidence_head.proj.bias": (1,)}
    optional = base.float_shapes(dict.fromkeys(layout.TARGET_TENSORS, (v, h)) | unread)
    base.tensors(specs, expected, optional, out, "sgljax-model")


CONSUMER = base.Consumer(
    name="sglang_jax",
    release="sgl-project/sglang-jax PR #1632 @8941115b (read)",
    check=check,
    refuse=refuse,
    last_layer="sglang-jax captures at the input of layer k + 1; none follows the last [sgljax-capture]",
)
