"""vLLM 0.34.0 (the PyPI wheel) runs an export's main directory: `python consumer_vllm.py DIR IN OUT`.

vLLM's own config path resolves DIR as `--speculative-config '{"method": "dspark", "model": DIR}'` would:
`ModelConfig` of a target (a config-only Qwen3 directory written here: the layer count and width of IN's
`hidden`, DIR's vocabulary), `SpeculativeConfig(method="dspark", model=DIR)` (method check against the class
the draft declares, `num_speculative_tokens` from `block_size`), `VllmConfig`, and the registry's class for
the draft's architectures, which must be `Qwen3DSparkForCausalLM` (else the script stops, naming the class
vLLM resolved). That class is built on this CPU, `load_weights` reads DIR's model.safetensors, and what it
filled is held strictly to the file (every parameter set, each to the file's value, each file tensor used;
the one exception is `t2d`, which vLLM skips by name as training-only). The target's states are picked by
vLLM's own capture rule: `get_eagle3_aux_layers_from_config` ids (DIR's `target_layer_ids` + 1), taken as
the target's `EagleModelMixin` does (`_set_aux_hidden_state_layers`: sorted, unique;
`_maybe_add_hidden_state`: id j is the residual stream entering layer j, transformers' `hidden[j]`). An id
equal to the layer count is captured after the last layer, raw, before the final norm, which `hidden` does
not hold: the script stops.

The forward is vLLM's own: `combine_hidden_states` (fc), `precompute_and_store_context_kv` (hidden_norm,
k/v projection, k_norm, RoPE of the context j < anchor), `DFlashQwen3Model.forward` on the block
[anchor token, MASK x (S - 1)] at positions a .. a + S - 1, `compute_draft_logits`, and the speculator's
Markov chain `DSparkSpeculator._sample_markov_chain` (Markov embedding of the predecessor, bias, confidence
head), teacher forced: its sampler returns the input's next token, so slot i's predecessor is x_{a+i}.
Every CustomOp runs its PyTorch-native forward (`custom_ops=["none"]`, a vLLM option). What is replaced
(a platform check, the vllm._C kernels and paged attention, the sampler) is numbered 1 to 3 in `configs`,
`replace_kernels` and `TeacherForcedChain`.

OUT: base, markov [B, N, S, K], confidence (the confidence head's logit), predecessors [B, N, S]; beside
them `layer_ids` (the vLLM capture ids used), `d2t` / `proposal_ids` (vLLM's `draft_id_to_target_id` as
loaded and `map_draft_to_target(arange(K))`) with a draft vocabulary, and `parsed`, the JSON of what vLLM's
config path resolved.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import types
import warnings
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # no accelerator: vLLM's CPU platform
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
warnings.filterwarnings("ignore")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import vllm.triton_utils  # noqa: E402
from safetensors import safe_open  # noqa: E402
from torch import nn  # noqa: E402
from vllm.config import (  # noqa: E402
    CompilationConfig,
    CompilationMode,
    ModelConfig,
    ParallelConfig,
    SpeculativeConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed import init_distributed_environment, initialize_model_parallel  # noqa: E402
from vllm.ir import ops as ir_ops  # noqa: E402
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding  # noqa: E402
from vllm.model_executor.model_loader.utils import (  # noqa: E402
    get_model_architecture,
    process_weights_after_loading,
)
from vllm.model_executor.models import qwen3_dflash  # noqa: E402
from vllm.model_executor.models.interfaces import EagleModelMixin  # noqa: E402
from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM  # noqa: E402
from vllm.v1.worker.gpu.spec_decode.dspark.speculator import DSparkSpeculator  # noqa: E402
from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config  # noqa: E402


def target_directory(draft: dict, num_layers: int, hidden_size: int, root: Path) -> Path:
    """A config-only Qwen3 target: IN's layer count and width, the draft's vocabulary (vLLM compares them)."""
    keys = ("vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
            "rms_norm_eps", "max_position_embeddings", "rope_parameters", "eos_token_id")  # fmt: skip
    config = {k: draft[k] for k in keys if k in draft} | {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "torch_dtype": "float32",
    }
    path = root / "target"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


def configs(directory: Path, num_layers: int, hidden_size: int, root: Path):
    """vLLM's config path on DIR: the draft's SpeculativeConfig inside a VllmConfig."""
    draft = json.loads((directory / "config.json").read_text())
    target = ModelConfig(
        model=str(target_directory(draft, num_layers, hidden_size, root)),
        skip_tokenizer_init=True,
        dtype="float32",
    )
    spec = SpeculativeConfig(
        model=str(directory),
        method="dspark",
        target_model_config=target,
        target_parallel_config=ParallelConfig(),
    )
    # custom_ops=["none"]: every vLLM CustomOp runs its forward_native (vLLM's own PyTorch implementation)
    # instead of forward_cpu, which calls vllm._C kernels that a CPU build of this wheel does not have.
    compilation = CompilationConfig(mode=CompilationMode.NONE, custom_ops=["none"])
    # Replacement 1, a platform check: CpuPlatform.check_and_update_config (inside VllmConfig) refuses an x86
    # CPU without triton-cpu. No Triton kernel runs here (every module is imported already, with vLLM's
    # Triton placeholders), so the check alone is told Triton is there.
    vllm.triton_utils.HAS_TRITON = True
    return spec, VllmConfig(model_config=target, speculative_config=spec, compilation_config=compilation)


def replace_kernels(model: Qwen3DSparkForCausalLM) -> None:
    """Replacement 2, the vllm._C kernels of the draft's context path and its paged attention.

    a. `precompute_and_store_context_kv` calls `ops.rms_norm` and `ops.rotary_embedding` (vllm._C, absent
       from a build without CUDA): the same arithmetic from vLLM's native code, `vllm.ir.ops.rms_norm` (a
       [G, D] weight normalises x[g] with row g: the grouped K-norm) and `RotaryEmbedding.forward_static`,
       written back in place as the kernels write.
    b. vLLM's `Attention` (a paged KV cache and a backend kernel): the context K/V that
       `precompute_and_store_context_kv` inserts (`attn.impl.do_kv_cache_update`) are kept, and each query
       of the block attends to all of them and all of the block's own K/V (this draft's layers are
       full-attention, non-causal: anything else is refused), softmax(q k^T * scale) v per head, GQA by
       repeating the K/V heads."""

    def rms_norm(out, x, weight, epsilon):
        if weight is not None and weight.dim() == 2:
            weight = weight.view(weight.shape[0], *[1] * (x.dim() - 2), weight.shape[1])
        out.copy_(ir_ops.rms_norm(x, weight, epsilon))

    def rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox):
        rotary_dim = cos_sin_cache.shape[-1]
        q, k = RotaryEmbedding.forward_static(
            positions, query, key, head_size, rotary_dim, cos_sin_cache, is_neox
        )
        query.copy_(q)
        if key is not None:
            key.copy_(k)

    qwen3_dflash.ops = types.SimpleNamespace(rms_norm=rms_norm, rotary_embedding=rotary_embedding)
    for layer in model.model.layers:
        layer.self_attn.attn = ExplicitAttention(layer.self_attn)
    model.model._attn_layers = [layer.self_attn.attn for layer in model.model.layers]


class ExplicitAttention(nn.Module):
    """Stands in for vLLM's paged `Attention` of one draft layer (see `replace_kernels`, b)."""

    def __init__(self, self_attn: nn.Module):
        super().__init__()
        if self_attn.causal or self_attn.sliding_window is not None:
            sys.exit("the explicit attention stand-in runs full non-causal layers only")
        self.heads, self.kv_heads, self.dim = self_attn.num_heads, self_attn.num_kv_heads, self_attn.head_dim
        self.scale = self_attn.scaling
        self.impl, self.kv_cache, self.context = self, None, None

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        self.context = key, value  # [num_ctx, kv_heads, dim] each, K normed and rotated

    def forward(self, query, key, value):
        k, v = key.view(-1, self.kv_heads, self.dim), value.view(-1, self.kv_heads, self.dim)
        if self.context is not None:  # None: a block at position 0, no context
            k, v = torch.cat([self.context[0], k]), torch.cat([self.context[1], v])
        q = query.view(-1, self.heads, self.dim).transpose(0, 1)  # [heads, S, dim]
        k = k.transpose(0, 1).repeat_interleave(self.heads // self.kv_heads, 0)
        v = v.transpose(0, 1).repeat_interleave(self.heads // self.kv_heads, 0)
        out = torch.softmax((q @ k.transpose(1, 2)) * self.scale, dim=-1) @ v
        return out.transpose(0, 1).reshape(-1, self.heads * self.dim)


class TeacherForcedChain:
    """What `DSparkSpeculator._sample_markov_chain` reads of its speculator, for one block.

    Replacement 3: its sampler (`_sample_logits`: greedy or Gumbel over the draft logits, then
    `map_draft_to_target`) returns the input's next token instead, a target id as vLLM's sampler returns,
    and records the logits it was given (base + Markov bias). The confidence head is on
    (`enable_adaptive_verification` with a confidence head), its bias not fused into a sampling kernel."""

    def __init__(self, model: Qwen3DSparkForCausalLM, steps: int, next_tokens: torch.Tensor):
        self.model, self.num_speculative_steps = model, steps
        self.use_confidence_head = model.model.confidence_head is not None
        self._fuse_markov_bias = False
        self.next_tokens, self.logits = next_tokens, []

    def _markov_step(self, prev, draft_hidden, state):
        return DSparkSpeculator._markov_step(self, prev, draft_hidden, state)

    def _sample_logits(self, logits, idx_map, sample_pos, step, bias=None):
        assert bias is None
        self.logits.append(logits)
        return self.next_tokens[:, step]


def capture(hidden: torch.Tensor, layer_ids: tuple[int, ...]) -> torch.Tensor:
    """fc's input [T, A * H]: the target's states at vLLM's capture ids, by the target's own capture code."""
    num_layers = hidden.shape[0] - 1
    target = type("Target", (EagleModelMixin,), {"start_layer": 0})()  # the mixin the target model carries
    target._set_aux_hidden_state_layers(layer_ids)
    states: list[torch.Tensor] = []
    for j in range(num_layers):  # id j: the residual stream entering layer j (Qwen2Model.forward)
        target._maybe_add_hidden_state(states, j, hidden[j], None)
    return torch.cat(states, dim=-1)


def load(model: Qwen3DSparkForCausalLM, directory: Path) -> dict[str, list[str]]:
    """`load_weights` on DIR's tensors, what it filled held strictly to the file: the findings (empty lists
    when strict). A parameter the file does not fill is given back the value vLLM builds it with."""
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        file = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    params = dict(model.named_parameters())
    built = {name: p.detach().clone() for name, p in params.items()}
    with torch.no_grad():  # a sentinel in every parameter: what load_weights leaves unset shows
        for p in params.values():
            p.fill_(float("nan") if p.is_floating_point() else -1)
    model.load_weights(iter(file.items()))

    # q / k / v into qkv_proj, gate / up into gate_up_proj (DFlashQwen3Model.hf_to_vllm_mapper), in that order
    stacked = {".q_proj": (".qkv_proj", 0), ".k_proj": (".qkv_proj", 1), ".v_proj": (".qkv_proj", 2),
               ".gate_proj": (".gate_up_proj", 0), ".up_proj": (".gate_up_proj", 1)}  # fmt: skip
    want: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in file.items():  # each tensor where Qwen3DSparkForCausalLM.load_weights puts it
        if name == "t2d":
            continue  # skipped by name in load_weights: training only
        dest = (
            "draft_id_to_target_id"
            if name == "d2t"
            else name
            if name.startswith("lm_head")
            else "model." + name
        )
        shard = 0
        for old, (new, index) in stacked.items():
            if old in dest:
                dest, shard = dest.replace(old, new), index
        want.setdefault(dest, {})[shard] = tensor
    # vLLM's own placeholder for a `mask_embedding.pt` override; unused without one (none in an export).
    placeholder = {"model.mask_embedding"} if not model.model.has_separate_mask_embedding else set()
    unexpected = sorted(set(want) - set(params))
    missing = sorted(set(params) - set(want) - placeholder)
    different = []
    for dest in sorted(set(want) & set(params)):
        got = params[dest].detach()
        expect = torch.cat([want[dest][k].to(got.dtype) for k in sorted(want[dest])])
        rows = expect.shape[0]  # vocabulary heads are padded to a multiple of 64 rows, the padding zeros
        if (
            got.shape[1:] != expect.shape[1:]
            or not torch.equal(got[:rows], expect)
            or torch.any(got[rows:] != 0)
        ):
            different.append(dest)
    with torch.no_grad():
        for name in missing + sorted(placeholder):
            params[name].copy_(built[name])
    return {"unexpected": unexpected, "missing": missing, "different": different}


def main(directory: str, inputs: str, outputs: str) -> None:
    torch.manual_seed(0)
    directory = Path(directory).resolve()
    z = np.load(inputs)
    ids = torch.from_numpy(z["input_ids"]).long()  # [B, T]
    hidden = torch.from_numpy(z["hidden"]).float()  # [B, L + 1, T, H]
    anchors = torch.from_numpy(z["anchors"]).long()  # [B, N]
    (b, _), n, h = ids.shape, anchors.shape[1], hidden.shape[-1]
    root = Path(tempfile.mkdtemp(prefix="vllm_consumer_"))

    spec, vllm_config = configs(directory, hidden.shape[1] - 1, h, root)
    draft_config = spec.draft_model_config
    model_class, _ = get_model_architecture(draft_config)
    layer_ids = get_eagle3_aux_layers_from_config(spec)
    parsed = {
        "method": spec.method,
        "num_speculative_tokens": spec.num_speculative_tokens,
        "num_lookahead_tokens": spec.speculator_config.num_lookahead_tokens,
        "speculator_config": type(spec.speculator_config).__name__,
        "uses_aux_hidden_states": spec.uses_aux_hidden_states,
        "architectures": draft_config.architectures,
        "model_type": draft_config.hf_config.model_type,
        "model_class": model_class.__name__,
        "aux_layer_ids": list(layer_ids or ()),
    }
    if model_class is not Qwen3DSparkForCausalLM:
        sys.exit(f"vLLM resolves the draft to {model_class.__name__}, not Qwen3DSparkForCausalLM: {parsed}")
    num_layers = hidden.shape[1] - 1
    if not layer_ids or max(layer_ids) >= num_layers:
        sys.exit(
            f"vLLM capture ids {list(layer_ids or ())} on a {num_layers}-layer target: id {num_layers} is "
            "captured after the target's last layer (its raw output, before the final norm), which "
            "transformers' hidden states do not hold, and none is past it"
        )

    init_distributed_environment(
        world_size=1, rank=0, local_rank=0, backend="gloo", distributed_init_method=f"file://{root}/dist"
    )
    with set_current_vllm_config(vllm_config), torch.no_grad():
        initialize_model_parallel(1, 1)
        model = model_class(vllm_config=vllm_config, prefix="").float().eval()
        found = load(model, directory)
        process_weights_after_loading(model, draft_config, torch.device("cpu"))
        replace_kernels(model)
        cfg, inner = model.config, model.model
        s, mask = spec.num_speculative_tokens, inner.mask_token_id
        parsed |= {
            "mask_token_id": mask,
            "block_size": cfg.block_size,
            "markov_rank": cfg.markov_rank,
            "vocab_size": cfg.vocab_size,
            "draft_vocab_size": cfg.draft_vocab_size,
            "confidence_head": inner.confidence_head is not None
            and {
                "with_markov": inner.confidence_head.with_markov,
                "inputs": inner.confidence_head.proj.input_size,
            },
            "fc_input_size": inner.fc.input_size,
            "sample_from_anchor": getattr(cfg, "sample_from_anchor", True),
            "has_own_embed_tokens": getattr(model, "has_own_embed_tokens", None),
            "has_own_lm_head": getattr(model, "has_own_lm_head", None),
        }

        out = {k: [] for k in ("base", "markov", "confidence", "predecessors")}
        conf_logits: list[torch.Tensor] = []
        if inner.confidence_head is not None:  # its logit, before compute_confidence's sigmoid
            inner.confidence_head.register_forward_hook(lambda m, i, o: conf_logits.append(o))
        prev_ids: list[torch.Tensor] = []
        markov_w1 = inner.markov_head.markov_w1  # its input: the predecessors
        markov_w1.register_forward_hook(lambda m, i, o: prev_ids.append(i[0]))
        for row in range(b):
            context = model.combine_hidden_states(capture(hidden[row], layer_ids))  # [T, H]
            for a in anchors[row].tolist():
                for attn in inner._attn_layers:
                    attn.context = None
                # vLLM drafts after a prompt, never from no context: its precompute cannot take 0 states
                if a:
                    model.precompute_and_store_context_kv(context[:a], torch.arange(a), torch.arange(a))
                block = torch.full((s,), mask, dtype=torch.long)
                block[0] = ids[row, a]
                head_hidden = model(block, torch.arange(a, a + s))  # [S, H]
                base = model.compute_draft_logits(head_hidden)
                following = torch.cat([ids[row, a + 1 : a + 1 + s], torch.zeros(s, dtype=torch.long)])[:s]
                chain = TeacherForcedChain(model, s, following[None])  # the last one is never read
                conf_logits.clear(), prev_ids.clear()
                DSparkSpeculator._sample_markov_chain(
                    chain, base[None], head_hidden, ids[row, a][None], torch.zeros(1, s, dtype=torch.long),
                    torch.arange(s)[None] + a + 1,
                    torch.empty(1, s, dtype=torch.long),
                )  # fmt: skip
                out["base"].append(base)
                out["markov"].append(torch.cat(chain.logits))
                out["confidence"].append(conf_logits[0] if conf_logits else torch.full((s,), float("nan")))
                out["predecessors"].append(torch.cat(prev_ids))
        arrays = {k: torch.stack(v).reshape(b, n, s, *v[0].shape[1:]).numpy() for k, v in out.items()}
        arrays["layer_ids"] = np.asarray(layer_ids)
        if model.draft_id_to_target_id is not None:
            arrays["d2t"] = model.draft_id_to_target_id.numpy()
            arrays["proposal_ids"] = model.map_draft_to_target(torch.arange(cfg.draft_vocab_size)).numpy()
    np.savez(outputs, **arrays, parsed=np.asarray(json.dumps(parsed, default=str)))
    if any(found.values()):  # OUT holds what vLLM computes with what it loaded; the run still fails
        sys.exit(
            f"not a strict load of {directory}: file tensors with no parameter {found['unexpected']}, "
            f"parameters the file does not fill {found['missing']} (left as vLLM builds them), parameters "
            f"not holding the file's values {found['different']}"
        )


if __name__ == "__main__":
    main(*sys.argv[1:4])
