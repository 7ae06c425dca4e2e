"""SpecForge 0.2.0 (PyPI) runs an export's `specforge/` directory: `python consumer_specforge.py DIR IN OUT`.

SpecForge's own composition builds a DSpark training run on DIR: its typed run config (`Config`, strategy
dspark, `model.draft_model_config` and `model.draft_checkpoint_path` = DIR, `model.target_model_path` = the
export's main directory above DIR, whose `embed_tokens.weight` / `lm_head.weight` stand in for the target's),
`resolve_run` and `build_model_bundle` (`resolve_draft_config`, `AutoDraftModel.from_config`,
`warm_start_draft_model`, `TargetEmbeddingsAndHead`, `resolve_mask_token_id`, `OnlineDSparkModel`). Then DIR's
tensors are held strictly to the draft's state dict (SpecForge itself drops an unexpected tensor silently),
the context is `extract_context_feature` (transformers' `output_hidden_states`, layer k at [k + 1]) of the
run's capture layers, and `OnlineDSparkModel.forward` runs, loss included, on the blocks at IN's `anchors`.
OUT gets the base and Markov logits that `apply_logits_head` receives and returns, the confidence logits of
`predict_confidence` and the predecessors it was given, plus what SpecForge parsed from DIR's config
(`capture_layers`, `target_layer_ids`, `mask_token_id`, `block_size`, `markov_rank`, `confidence_inputs`)
and the strict comparison's findings (`unexpected`, `missing`, `different`).

Where DIR's tensors and the draft differ, OUT is still written (what SpecForge itself, which warm-starts
such a directory without a word, computes) and the script then fails naming them. SpecForge takes MASK
from the run config, else `dflash_config`, else the tokenizer (none in an export): a config without
`dflash_config.mask_token_id` gets its top-level one in the run config, as its user would have to name it.
A head SpecForge did not build gives base logits (no Markov head: `apply_logits_head` returns its input)
or NaN confidence logits (no confidence head: `predict_confidence` returns None).
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from specforge.application.composition import resolve_run  # noqa: E402
from specforge.config.schema import Config  # noqa: E402
from specforge.modeling.draft.dflash import extract_context_feature  # noqa: E402
from specforge.training.assembly import build_model_bundle  # noqa: E402


def run_config(directory: Path) -> Config:
    """A SpecForge DSpark run warm-starting from `directory`, the target's pieces from the export above it."""
    model = {
        "target_model_path": str(directory.parent),
        "draft_model_config": str(directory),
        "draft_checkpoint_path": str(directory),
        "embedding_key": "embed_tokens.weight",  # the export's name for the target's embedding
        "torch_dtype": "float32",
    }
    config = json.loads((directory / "config.json").read_text())
    if "mask_token_id" not in (config.get("dflash_config") or {}):
        model["mask_token_id"] = config.get("mask_token_id")
    return Config.model_validate(
        {
            "model": model,
            "data": {"hidden_states_path": str(directory / "no-features")},  # offline mode; never read here
            "training": {"strategy": "dspark", "attention_backend": "sdpa"},
        }
    )


def strict(draft: torch.nn.Module, directory: Path) -> dict[str, list[str]]:
    """DIR's tensors against the draft's state dict: names, shapes and values as loaded."""
    state = draft.state_dict()
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        return {
            "unexpected": sorted(names - set(state)),
            "missing": sorted(set(state) - names),
            "different": sorted(k for k in names & set(state) if not torch.equal(f.get_tensor(k), state[k])),
        }


def main(directory: str, inputs: str, outputs: str) -> None:
    directory = Path(directory).resolve()
    cfg = run_config(directory)
    bundle = build_model_bundle(cfg, algorithm=resolve_run(cfg).algorithm)
    online, draft = bundle.model.eval(), bundle.draft_model.eval()
    found = strict(draft, directory)

    z = np.load(inputs)
    ids = torch.from_numpy(z["input_ids"]).long()
    # transformers' output_hidden_states: [0] the embedding output, [k + 1] layer k's output
    hidden = list(torch.from_numpy(z["hidden"]).unbind(1))
    anchors = torch.from_numpy(z["anchors"]).long()

    # The one replacement: OnlineDSparkModel samples its anchors at random; these blocks are IN's anchors.
    keep = torch.ones_like(anchors, dtype=torch.bool)
    online._sample_anchor_positions = lambda seq_len, loss_mask, device: (anchors, keep)

    # Observation only: record what SpecForge's own heads receive and return (per objective chunk).
    seen: dict[str, list[torch.Tensor]] = {"base": [], "markov": [], "predecessors": [], "confidence": []}
    logits_head, confidence_head = draft.apply_logits_head, draft.predict_confidence

    def apply_logits_head(base_logits, **kw):
        out = logits_head(base_logits, **kw)
        seen["base"].append(base_logits)
        seen["markov"].append(out)
        seen["predecessors"].append(kw["prev_token_ids"])
        return out

    def predict_confidence(h, **kw):
        out = confidence_head(h, **kw)
        seen["confidence"].append(torch.full(h.shape[:-1], float("nan")) if out is None else out)
        return out

    draft.apply_logits_head, draft.predict_confidence = apply_logits_head, predict_confidence
    with torch.no_grad():
        online(
            input_ids=ids,
            hidden_states=extract_context_feature(hidden, bundle.capture_layers),
            loss_mask=torch.ones(ids.shape),
            target_last_hidden_states=hidden[-1],  # the last entry: the target's final (normed) state
        )
    out = {k: torch.cat(v, dim=1).numpy() for k, v in seen.items()}
    head = draft.confidence_head
    np.savez(
        outputs,
        **out,
        capture_layers=np.asarray(bundle.capture_layers),
        target_layer_ids=np.asarray(draft.target_layer_ids),
        mask_token_id=np.asarray(online.mask_token_id),
        block_size=np.asarray(online.block_size),
        markov_rank=np.asarray(draft.markov_head.markov_rank if draft.markov_head is not None else 0),
        confidence_inputs=np.asarray(head.proj.in_features if head is not None else 0),
        **{k: np.asarray(v, dtype=str) for k, v in found.items()},
    )
    if any(found.values()):
        raise SystemExit(
            f"{directory}/model.safetensors does not match SpecForge's DSparkDraftModel: {found}"
        )


if __name__ == "__main__":
    main(*sys.argv[1:])
