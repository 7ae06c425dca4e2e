"""speculators (vllm-project, 0.9.0 from PyPI) runs an exported DSpark draft with its own code.

    python consumer_speculators.py DIRECTORY INPUTS.npz OUTPUTS.npz

DIRECTORY is what speculators reads (`<export>/speculators`). `SpeculatorModel.from_pretrained` loads it as
exported (a directory without `speculators_model_type` goes to its auto-conversion, which refuses it), with
the file's `t2d` / `d2t` handed to its `load_vocab_mappings` when the draft has its own vocabulary. The
loaded state is held strictly to the file: each tensor the model has is in the file with the file's value,
except those speculators takes from its verifier, and the file has no other tensor. The target's states
are picked by speculators' layer convention from its parsed `aux_hidden_state_layer_ids` (vLLM's: id i is
the state entering decoder layer i, transformers' `hidden_states[i]`), and its training forward
`DSparkDraftModel.forward` runs on the anchored blocks, the two sequences packed into one row with
`document_ids` as its trainer packs them. Its forward returns only a loss: the logits are read on the way,
the base logits from `lm_head`'s output, the Markov and confidence logits from the arguments of the loss
(`speculators.models.dspark.core.compute_metrics`), the predecessors from `markov_w1`'s input.

OUTPUTS: base, markov [B, N, S, V or K], confidence, predecessors [B, N, S]; beside them layer_ids (the
indices of `hidden` read), t2d and d2t as loaded (with a draft vocabulary) and `parsed`, the JSON of the
config speculators parsed.
"""

import json
import sys
from pathlib import Path

import numpy as np
import speculators.models.dflash.core as dflash_core
import speculators.models.dspark.core as dspark_core
import torch
from safetensors import safe_open
from speculators import SpeculatorModel
from speculators.models.attention import create_float_mask
from speculators.models.dspark import DSparkDraftModel

PARSED = (  # DSparkSpeculatorConfig's fields that the draft's layout depends on
    "draft_vocab_size",
    "block_size",
    "aux_hidden_state_layer_ids",
    "mask_token_id",
    "sample_from_anchor",
    "markov_rank",
    "markov_head_type",
    "enable_confidence_head",
    "confidence_head_with_markov",
)


def load(directory: Path) -> DSparkDraftModel:
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        file = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    model = SpeculatorModel.from_pretrained(str(directory), t2d=file.get("t2d"), d2t=file.get("d2t"))
    if not isinstance(model, DSparkDraftModel):
        sys.exit(f"speculators loaded a {type(model).__name__}, not a DSparkDraftModel")
    state = model.state_dict()
    # What speculators never saves and takes from its verifier (the target): the training targets' head, norm.
    from_target = set(type(model)._keys_to_ignore_on_save)
    missing, unexpected = sorted(set(state) - set(file) - from_target), sorted(set(file) - set(state))
    if missing or unexpected:
        sys.exit(f"not a strict load of {directory}: missing {missing}, unexpected {unexpected}")
    differ = [k for k in file if state[k].shape != file[k].shape or not torch.equal(state[k], file[k])]
    if differ:
        sys.exit(f"the loaded model does not hold the file's values of {differ}")
    return model.eval()


def run_on_cpu(model: DSparkDraftModel, packed_anchors: torch.Tensor) -> None:
    """The replacements, all here: only what a CPU run without a GPU needs, none of the draft's arithmetic.

    1. Attention: speculators defaults to `simple_flex_attention`, whose block mask is built by a
       `torch.compile`d `create_block_mask` (a C compiler, about a minute on this CPU). Its own eager path is
       taken instead, the two settings its `__init__` makes for `eager`: the layers' attention function
       (read from the shared `transformer_layer_config` at each call) and its float mask builder.
    2. Anchors: its trainer samples them at random (`speculators.models.dflash.utils.select_anchors`, which
       `dflash.core` calls by its module name); the fixed ones of the inputs are returned instead.
    (3. The loss: `loss_implementation="eager"` in `main`, an option of its own; the default fused loss is a
       Triton kernel.)"""
    layer_config = model.config.transformer_layer_config
    assert all(layer.self_attn.config is layer_config for layer in model.layers)
    layer_config._attn_implementation = "eager"
    model._attn_impl, model._create_mask_fn = "eager", create_float_mask

    def fixed_anchors(loss_mask, num_anchors, block_size):
        assert num_anchors == packed_anchors.numel()
        return packed_anchors.clone(), torch.ones(num_anchors, dtype=torch.bool)

    dflash_core.select_anchors = fixed_anchors


def main(directory: Path, inputs_path: Path, outputs_path: Path) -> None:
    torch.manual_seed(0)
    inputs = np.load(inputs_path)
    ids = torch.from_numpy(inputs["input_ids"]).long()  # [B, T]
    hidden = torch.from_numpy(inputs["hidden"])  # [B, L + 1, T, H]
    anchors = torch.from_numpy(inputs["anchors"]).long()  # [B, N]
    (b, t), n, num_layers = ids.shape, anchors.shape[1], hidden.shape[1] - 1

    model = load(directory)
    s = model.block_size
    layer_ids = list(model.target_layer_ids)  # its parsed ids: the state entering layer i, hidden[i]
    aux = hidden[:, layer_ids].permute(0, 2, 1, 3).reshape(1, b * t, -1)  # fc's input: the states in id order
    last = hidden[:, num_layers].reshape(1, b * t, -1)  # id num_layers: what its data splits off as the last
    run_on_cpu(model, (anchors + torch.arange(b)[:, None] * t).reshape(-1))

    captured = {}
    loss_of = dspark_core.compute_metrics

    def read_loss_arguments(logits, targets, confidence_logits, *args, **kwargs):
        captured["markov"], captured["confidence"] = logits, confidence_logits
        return loss_of(logits, targets, confidence_logits, *args, **kwargs)

    dspark_core.compute_metrics = read_loss_arguments
    model.lm_head.register_forward_hook(lambda m, i, o: captured.__setitem__("base", o))
    markov_w1 = model.markov_head.markov_w1
    markov_w1.register_forward_hook(lambda m, i, o: captured.__setitem__("predecessors", i[0]))
    kwargs, _ = DSparkDraftModel.get_trainer_kwargs(loss_fn="kl_div", loss_implementation="eager")
    kwargs["max_anchors"] = b * n
    with torch.no_grad():
        model(
            hidden_states=aux,
            input_ids=ids.reshape(1, b * t),
            loss_mask=torch.ones(1, b * t, dtype=torch.long),
            verifier_last_hidden_states=last,
            document_ids=torch.arange(b).repeat_interleave(t)[None],
            position_ids=torch.arange(t).repeat(b)[None],
            **kwargs,
        )

    c = model.config
    parsed = {k: getattr(c, k) for k in PARSED} | {
        "class": type(c).__name__,
        "transformer_layer_config": c.transformer_layer_config.to_dict(),
    }
    out = {
        "base": captured["base"].reshape(b, n, s, -1),
        "markov": captured["markov"].reshape(b, n, s, -1),
        "confidence": captured["confidence"].reshape(b, n, s),
        "predecessors": captured["predecessors"].reshape(b, n, s),
        "layer_ids": torch.tensor(layer_ids),
    }
    out |= {k: getattr(model, k) for k in ("t2d", "d2t") if getattr(model, k) is not None}
    arrays = {k: v.detach().cpu().numpy() for k, v in out.items()}
    np.savez(outputs_path, **arrays, parsed=np.asarray(json.dumps(parsed, default=str)))


if __name__ == "__main__":
    main(*map(Path, sys.argv[1:4]))
