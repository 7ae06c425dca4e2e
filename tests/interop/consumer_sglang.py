"""SGLang (PyPI sglang 0.5.23) reads an export's main directory and runs its DSpark draft forward on CPU.

  python consumer_sglang.py DIRECTORY INPUTS.npz OUTPUTS.npz       the draft's forward (see `forward`)
  python consumer_sglang.py --parse DIRECTORY OUTPUT.json          its config, STS and SPS files (see `parse`)

Everything below is SGLang's own code, as its server runs it for `--speculative-algorithm DSPARK
--speculative-draft-model-path DIRECTORY` (paths below `sglang/srt/`):
  config       utils/hf_transformers `get_config`; speculative/dspark_components/dspark_config.py
               `parse_dspark_draft_config` and `resolve_runtime_config` (gamma, MASK);
  layers       spec_aux_hidden_state.py's choice: `parse_dflash_draft_config(...).resolve_target_layer_ids`
               against the target's layer count, then the DSpark parser's `target_layer_ids`; the target
               captures them as models/qwen3.py `set_dflash_layers_to_capture` says (layer k at the input
               of layer k + 1, in ascending layer order; the input of layer k + 1 is `hidden[k + 1]`);
  model        models/dspark.py `EntryClass` by `architectures`, built under the config's dtype, and its
               `load_weights`; the target's embedding and LM head are SGLang's `VocabParallelEmbedding` /
               `ParallelLMHead` (loaded from the copies the export carries) given by
               `attach_shared_modules`;
  forward      `write_target_hidden_kv` (the context K/V of the positions before each anchor),
               `forward_embed` + `forward` over a `MHATokenToKVPool` with `TorchNativeAttnBackend`,
               `compute_base_logits`, the draft step of `dspark_draft._draft_step` (the Markov head's
               `step_bias`, then `MarkovSampleStep` keeps the step logits), `compute_confidence` (the raw
               confidence logit).
What is this script's and not SGLang's:
  * the batch layout: one `ForwardMode.EXTEND` request per (sequence, anchor) whose prefix is the context
    before the anchor and whose extension is the block `[anchor token, MASK x (gamma - 1)]` at positions
    a .. a + gamma - 1 (the server runs the same rows as TARGET_VERIFY on a GPU attention backend;
    `torch_native` is SGLang's CPU one, non-causal here because the DSpark layers are ENCODER_ONLY);
  * teacher forcing: the Markov predecessor of step i > 0 is the sequence's token a + i (the server's
    `draft_markov_block` feeds the token it drafted at step i - 1); step 0's is the anchor token, as there;
  * strictness: SGLang's `load_weights` skips `embed_tokens.*` / `lm_head.*` (the target's) and silently
    ignores a backbone tensor it has no parameter for, and a parameter no tensor fills stays as built. So
    every parameter is filled with NaN first and every weight loader is wrapped to note the tensor it was
    given: a parameter left NaN, or a tensor of the file that no loader was given (other than the
    target's two), fails the run with a message naming it;
  * the stand-ins of `_stand_ins` (below) and `SGLANG_RAGGED_VERIFY_MODE=compact` (the server's default,
    'static', builds no confidence head, and reads neither side file).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import socket
import sys
import types
from pathlib import Path

# ---- Stand-ins: the one place where anything of SGLang's is replaced -----------------------------------
# SGLang imports these modules at module level on the way to models/dspark.py, and the DSpark draft never
# calls them: `sglang.srt.multimodal.internvl_utils` and `sglang.srt.configs.deepseek_ocr` import
# torchvision at module level (image processors; PyPI's torchvision wheel needs CUDA torch, and stubbing
# torchvision itself makes transformers believe it is installed), and `vllm` is
# layers/rotary_embedding/base.py's import of a fallback kernel on a host that is neither CUDA nor SGLang's
# CPU engine (only `forward_cuda` calls it). Each name of a stood-in module is a class whose attributes are
# stand-ins too (so the config registry and the subclasses defined at import time build); calling one
# raises, so a stand-in that the forward did use would fail the run.
_STOOD_IN = ("sglang.srt.multimodal.internvl_utils", "sglang.srt.configs.deepseek_ocr", "vllm")


class _StandIn(type):
    def __getattr__(cls, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _StandIn(f"{cls.__name__}.{attr}", (), {})

    def __call__(cls, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:  # used as a decorator
            return args[0]
        raise RuntimeError(
            f"{cls.__name__} is a stand-in (consumer_sglang.py): SGLang's DSpark path called it"
        )


class _StandIns(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if any(name == n or name.startswith(n + ".") for n in _STOOD_IN):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = lambda attr: _StandIn(f"{spec.name}.{attr}", (), {})
        return module

    def exec_module(self, module):
        pass


def _stand_ins() -> None:
    sys.meta_path.insert(0, _StandIns())
    os.environ["SGLANG_RAGGED_VERIFY_MODE"] = "compact"


# ---------------------------------------------------------------------------------------------------------


def fail(message: str) -> None:
    sys.exit(f"consumer_sglang: {message}")


def init_process_group() -> None:
    """SGLang's layers need a (world 1) process group and published server args: its own test helper."""
    with socket.socket() as s:  # a free port for the gloo group
        s.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    from sglang.test.layer_ut_utils import init_single_process_dist

    init_single_process_dist(backend="gloo")


def read_config(directory: Path):
    """The draft's config as the server reads it, SGLang's DSpark parse of it and its runtime knobs."""
    from safetensors import safe_open
    from sglang.srt.speculative.dspark_components.dspark_config import (
        parse_dspark_draft_config,
        resolve_runtime_config,
    )
    from sglang.srt.utils.hf_transformers_utils import get_config

    hf = get_config(str(directory), trust_remote_code=False)
    parsed = parse_dspark_draft_config(draft_hf_config=hf)
    with safe_open(directory / "model.safetensors", "pt") as f:  # the target's vocabulary: its embedding rows
        if "embed_tokens.weight" not in set(f.keys()):
            fail("model.safetensors carries no embed_tokens.weight: the target's embedding is needed")
        target_vocab = f.get_slice("embed_tokens.weight").get_shape()[0]
    runtime = resolve_runtime_config(
        draft_hf_config=hf, speculative_num_draft_tokens=None, target_vocab_size=target_vocab
    )
    return hf, parsed, runtime


def captured_states(hf, parsed, hidden):
    """The target's states SGLang feeds the draft, [B, T, A * H], from `hidden` [B, L + 1, T, H]."""
    import torch
    from sglang.srt.models.qwen3 import Qwen3ForCausalLM
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config

    target_layers = hidden.shape[1] - 1
    dflash = parse_dflash_draft_config(draft_hf_config=hf)
    ids = dflash.resolve_target_layer_ids(
        target_num_layers=target_layers, draft_num_layers=dflash.require_num_layers()
    )
    if parsed.target_layer_ids is not None:  # a DSpark draft's own ids replace them once range-checked
        ids = list(parsed.target_layer_ids)
    # The target's hook, on a stand-in for the target model: it records which layers' inputs are captured.
    target = types.SimpleNamespace(
        pp_group=types.SimpleNamespace(is_last_rank=True), model=types.SimpleNamespace()
    )
    Qwen3ForCausalLM.set_dflash_layers_to_capture(target, ids)
    capture = target.model.layers_to_capture
    # Qwen3Model.forward captures the input of layer i for i in range(num layers) if i in layers_to_capture;
    # layer i's input is transformers' hidden_states[i].
    states = [hidden[:, i] for i in range(target_layers) if i in capture]
    print(
        f"consumer_sglang: target_layer_ids {ids} -> captured at layer inputs {capture}: "
        f"{len(states)} states of {target_layers} layers",
        file=sys.stderr,
    )
    return torch.cat([torch.from_numpy(s) for s in states], dim=-1) if states else None, ids


def build_and_load(hf, directory: Path):
    """SGLang's draft model for `architectures`, loaded by its own `load_weights`, strictly (see the top)."""
    import torch
    from safetensors.torch import load_file
    from sglang.srt.model_loader.utils import set_default_torch_dtype
    from sglang.srt.model_loader.weight_utils import default_weight_loader
    from sglang.srt.models import dspark

    classes = {cls.__name__: cls for cls in dspark.EntryClass}
    arch = (getattr(hf, "architectures", None) or ["<none>"])[0]
    if arch not in classes:
        fail(f"architectures {hf.architectures} is none of models/dspark.py's {sorted(classes)}")
    dtype = getattr(hf, "torch_dtype", None) or getattr(hf, "dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with set_default_torch_dtype(dtype):  # as `--dtype <the config's>` (auto would take float16 for float32)
        model = classes[arch](hf).eval()

    tensors = load_file(directory / "model.safetensors")
    given: set[int] = set()

    def noting(loader):
        def load(param, loaded_weight, *args, **kwargs):
            given.add(id(loaded_weight))
            return loader(param, loaded_weight, *args, **kwargs)

        return load

    params = dict(model.named_parameters())
    with torch.no_grad():
        for p in params.values():
            p.fill_(float("nan"))
            p.weight_loader = noting(getattr(p, "weight_loader", default_weight_loader))
    try:
        model.load_weights(list(tensors.items()))
    except Exception as e:  # SGLang's own refusal, as the server would report it
        fail(f"SGLang's load_weights refused {directory}: {type(e).__name__}: {e}")
    unloaded = sorted(n for n, p in params.items() if torch.isnan(p).any())
    target = ("embed_tokens.weight", "lm_head.weight")  # the target's: SGLang attaches its own
    unused = sorted(n for n, t in tensors.items() if id(t) not in given and n not in target)
    if unloaded or unused:
        fail(
            f"not a strict load: parameters no tensor filled {unloaded}; "
            f"tensors of the file SGLang left unused {unused}"
        )
    for name in target:
        if name not in tensors or tensors[name].ndim != 2 or tensors[name].shape[1] != hf.hidden_size:
            fail(f"{name} [V, {hf.hidden_size}] (the target's) missing or misshapen")
    return model, tensors


def attach_target(model, tensors):
    """The target's embedding and LM head, SGLang's modules, attached as the DSpark worker does."""
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    v, h = tensors["embed_tokens.weight"].shape
    embed, head = VocabParallelEmbedding(v, h), ParallelLMHead(tensors["lm_head.weight"].shape[0], h)
    embed.weight_loader(embed.weight, tensors["embed_tokens.weight"])
    head.weight_loader(head.weight, tensors["lm_head.weight"])
    model.attach_shared_modules(embed_tokens=embed, lm_head=head)


def forward(directory: Path, inputs_path: Path, outputs_path: Path) -> None:
    import numpy as np
    import torch

    inputs = dict(np.load(inputs_path))
    ids, hidden, anchors = inputs["input_ids"], inputs["hidden"], inputs["anchors"]
    hf, parsed, runtime = read_config(directory)
    init_process_group()
    model, tensors = build_and_load(hf, directory)
    attach_target(model, tensors)
    target_hidden, layer_ids = captured_states(hf, parsed, hidden)
    if not model.sample_from_anchor:
        fail("sample_from_anchor is false: the block would start one row earlier than DSpark's")
    if model.confidence_head is None:
        fail("SGLang built no confidence head")

    from sglang.kernels.ops.speculative.dspark.markov_sample import MarkovSampleStep
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    b, t = ids.shape
    n = anchors.shape[1]
    gamma, mask = runtime.gamma, runtime.mask_token_id
    rows = b * n
    attn = model.layers[0].self_attn
    dtype = model.fc.weight.dtype
    # KV pool: slot 0 is SGLang's padding slot; sequence s's position j at 1 + s * T + j, then the blocks.
    kv = MHATokenToKVPool(
        size=b * t + rows * gamma + 1,
        page_size=1,
        dtype=dtype,
        head_num=attn.num_kv_heads,
        head_dim=attn.head_dim,
        layer_num=len(model.layers),
        device="cpu",
        enable_memory_saver=False,
        enable_alt_stream=False,
    )
    req = ReqToTokenPool(size=rows + 1, max_context_len=t + gamma, device="cpu", enable_memory_saver=False)
    backend = TorchNativeAttnBackend(
        types.SimpleNamespace(device="cpu", req_to_token_pool=req, token_to_kv_pool=kv)
    )
    context_loc = 1 + torch.arange(b * t)

    block_ids, positions, out_loc, prefix, predecessors = [], [], [], [], []
    for s in range(b):
        for k in range(n):
            a, r = int(anchors[s, k]), s * n + k
            if a + gamma > t:
                fail(f"anchor {a} leaves no room for a block of {gamma} in {t} tokens")
            loc = 1 + b * t + r * gamma + torch.arange(gamma)
            req.req_to_token[r + 1, : a + gamma] = torch.cat([context_loc[s * t : s * t + a], loc]).to(
                req.req_to_token.dtype
            )
            block_ids.append(torch.tensor([int(ids[s, a])] + [mask] * (gamma - 1)))
            positions.append(a + torch.arange(gamma))
            out_loc.append(loc)
            prefix.append(a)
            predecessors.append(torch.from_numpy(ids[s, a : a + gamma].astype(np.int64)))  # teacher forced
    block_ids, positions = torch.cat(block_ids).long(), torch.cat(positions).long()
    predecessors = torch.stack(predecessors)  # [rows, gamma]
    seq_lens = torch.tensor(prefix) + gamma

    with torch.inference_mode():
        if target_hidden is None:
            fail(f"target_layer_ids {layer_ids}: SGLang's target captures none of them")
        model.write_target_hidden_kv(
            target_hidden=target_hidden.reshape(b * t, -1).to(dtype),
            pool=kv,
            positions=torch.arange(t).repeat(b),
            cache_loc=context_loc,
        )
        batch = ForwardBatch(
            forward_mode=ForwardMode.EXTEND,
            batch_size=rows,
            input_ids=block_ids,
            req_pool_indices=torch.arange(1, rows + 1),
            seq_lens=seq_lens,
            out_cache_loc=torch.cat(out_loc),
            seq_lens_sum=int(seq_lens.sum()),
            seq_lens_cpu=seq_lens,
            positions=positions,
            extend_prefix_lens=torch.tensor(prefix),
            extend_seq_lens=torch.full((rows,), gamma),
            extend_prefix_lens_cpu=prefix,
            extend_seq_lens_cpu=[gamma] * rows,
        )
        backend.init_forward_metadata(batch)
        with forward_context(ForwardContext(attn_backend=backend)):
            out = model.forward(block_ids, positions, batch, input_embeds=model.forward_embed(block_ids))
        base, features = model.compute_base_logits(out.hidden_states)
        base = base.view(rows, gamma, -1)
        draft_hidden = out.hidden_states.view(rows, gamma, -1)
        # The draft step of speculative/dspark_components/dspark_draft.py `_draft_step` (kept step logits, one
        # TP rank): the Markov head's bias for the step's predecessor, then `MarkovSampleStep` adds it to the
        # base logits in the step dtype and keeps them. (`_draft_step` itself is not imported: its module
        # pulls in the scheduler and its process-title package.)
        head = model.markov_head
        markov = torch.empty(base.shape, dtype=head.step_logits_dtype(base.dtype))
        greedy, offset = torch.zeros(rows, dtype=torch.float32), torch.zeros(1, dtype=torch.int64)
        state = head.init_state(draft_hidden)
        for step in range(gamma):
            bias, state = head.step_bias(
                predecessors[:, step], hidden_states=draft_hidden[:, step], state=state
            )
            MarkovSampleStep.execute(
                base_logits=base[:, step],
                bias=bias,
                temperatures=greedy,
                key=0,
                offset=offset,
                step=step,
                step_dtype=head.step_logits_dtype(base.dtype),
                logits_out=markov[:, step],
            )
        # predict() reads the drafted tokens' first gamma - 1 as predecessors 1 .. gamma - 1.
        drafted = torch.cat([predecessors[:, 1:], predecessors[:, -1:]], dim=1)
        _, confidence = model.compute_confidence(
            anchor_tokens=predecessors[:, 0], draft_tokens=drafted, confidence_features=features
        )
    shape = (b, n, gamma)
    np.savez(
        outputs_path,
        base=base.float().numpy().reshape(*shape, -1),
        markov=markov.float().numpy().reshape(*shape, -1),
        confidence=confidence.float().numpy().reshape(shape),
        predecessors=predecessors.numpy().reshape(shape),
    )


def parse(directory: Path, output: Path) -> None:
    """SGLang's parse of the directory's config and of its STS calibration and SPS table (where present), as
    JSON; no model is built."""
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config
    from sglang.srt.speculative.dspark_components.dspark_sps import (
        is_uninitialized_sps_table,
        load_sps_table_from_path,
    )
    from sglang.srt.speculative.dspark_components.dspark_sts import load_sts_calibration_from_path

    hf, parsed, runtime = read_config(directory)
    report = {
        "gamma": runtime.gamma,
        "mask_token_id": runtime.mask_token_id,
        "markov_rank": parsed.markov_rank,
        "markov_head_type": parsed.markov_head_type,
        "target_layer_ids": parsed.target_layer_ids,
        "num_target_layers": parsed.num_target_layers,
    }
    if parsed.num_target_layers:  # the runtime's range check, against the target the draft was trained on
        dflash = parse_dflash_draft_config(draft_hf_config=hf)
        report["resolved_target_layer_ids"] = dflash.resolve_target_layer_ids(
            target_num_layers=parsed.num_target_layers, draft_num_layers=dflash.require_num_layers()
        )
    sts_path, sps_path = directory / "sts_calibration.json", directory / "sps_table.json"
    if sts_path.is_file():
        sts = load_sts_calibration_from_path(str(sts_path))
        # DSparkVerifyPlanner.__init__'s check (the planner needs a model runner to build, so it is repeated).
        if len(sts.temperatures) != runtime.gamma:
            fail(
                f"DSpark STS calibration was fit for gamma={len(sts.temperatures)} but the runtime gamma is "
                f"{runtime.gamma}"
            )
        report["sts"] = {
            "temperatures": sts.temperatures,
            "num_samples": sts.num_samples,
            "dataset": sts.dataset,
        }
    if sps_path.is_file():
        sps = load_sps_table_from_path(str(sps_path))
        report["sps"] = {
            "type": type(sps).__name__,
            "uninitialized": is_uninitialized_sps_table(sps),
            "sample_batch_tokens": list(sps.sample_batch_tokens),
            "max_batch_tokens": sps.max_batch_tokens,
        }
    output.write_text(json.dumps(report))


if __name__ == "__main__":
    _stand_ins()
    if sys.argv[1] == "--parse":
        parse(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        forward(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
