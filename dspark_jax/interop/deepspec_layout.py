"""DeepSpec's checkpoint layout of a DSpark draft: tensor names and shapes, `config.json`, the directory.

The layout follows DeepSpec's `Qwen3DSparkModel` (github.com/deepseek-ai/DeepSpec,
`deepspec/modeling/dspark/qwen3/modeling.py`; its config from `build_draft_config` in
`deepspec/modeling/dspark/qwen3/config.py`; the Markov head `VanillaMarkov` in
`deepspec/modeling/dspark/markov_head.py`; the confidence head `AcceptRatePredictor` in
`deepspec/modeling/dspark/common.py`) as Hugging Face `save_pretrained` writes it
(`deepspec/trainer/ckpt_manager.py`): a directory with `config.json` and `model.safetensors` (or an
index and its shards). Torch `nn.Linear` weights are `[out, in]`; ours are `[in..., out...]`:

  DeepSpec name                                 shape        project parameter
  fc.weight                                     [H, A*H]     aux_proj.kernel [A*H, H]
  hidden_norm.weight                            [H]          aux_norm.scale
  layers.L.input_layernorm.weight               [H]          layers.L.input_norm.scale
  layers.L.self_attn.q_proj.weight              [Q*D, H]     layers.L.attn.q.kernel [H, Q, D]
  layers.L.self_attn.k_proj.weight / v_proj     [G*D, H]     layers.L.attn.k.kernel / v [H, G, D]
  layers.L.self_attn.o_proj.weight              [H, Q*D]     layers.L.attn.o.kernel [Q, D, H]
  layers.L.self_attn.q_norm.weight / k_norm     [D]          layers.L.attn.q_norm.scale / k_norm
  layers.L.post_attention_layernorm.weight      [H]          layers.L.post_attn_norm.scale
  layers.L.mlp.gate_proj.weight / up_proj       [I, H]       layers.L.mlp.gate.kernel / up [H, I]
  layers.L.mlp.down_proj.weight                 [H, I]       layers.L.mlp.down.kernel [I, H]
  norm.weight                                   [H]          final_norm.scale
  markov_head.markov_w1.weight                  [V, R]       markov.w1 [V, R] (an nn.Embedding)
  markov_head.markov_w2.weight                  [V, R]       markov.w2 [R, V]
  confidence_head.proj.weight                   [1, H+R]     confidence.kernel [H+R]
  confidence_head.proj.bias                     [1]          confidence.bias []
  embed_tokens.weight, lm_head.weight           [V, H]       the target's (frozen; not draft parameters)

DeepSpec's formulas are the project's (docs/design.md section 1): context `hidden_norm(fc(aux))` feeds
every layer's K/V without the input norm, q/k norms on queries and on context and block keys,
MASK = `embed_tokens[mask_token_id]`, the Markov bias `markov_w2(markov_w1[t])`, the confidence
logit `proj([h; markov_w1[t]])`. A draft with a learned MASK vector (`draft.mask_token_id = -1`) or
any parameter outside this table (the variant groups) has no DeepSpec form and is refused, naming
the parameters. The config keys DeepSpec adds to the target's are `_draft_keys`; the draft's layers
are Qwen3's (q/k norm, no biases), so `model_type` is "qwen3" whatever the target's family.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import ml_dtypes  # noqa: F401  (registers 'bfloat16' with numpy, which safetensors' numpy reader needs)
import numpy as np
from safetensors import safe_open

from dspark_jax.draft.model import DraftConfig
from dspark_jax.target.checkpoint import safetensors_header, save_hf_checkpoint
from dspark_jax.target.config import TargetConfig

ARCHITECTURE = "Qwen3DSparkModel"
MARKOV_HEAD_TYPE = "vanilla"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# The target's frozen matrices, carried by every DeepSpec draft checkpoint (`[V, H]` both).
TARGET_TENSORS = ("embed_tokens.weight", "lm_head.weight")

ParamPath = tuple[str | int, ...]


class Tensor(NamedTuple):
    """One DeepSpec tensor: the project parameter `path` of shape `shape`, and its DeepSpec shape.

    `n_in` is the number of input axes of a linear kernel (DeepSpec's weight is the kernel flattened to
    `[in, out]` and transposed); None for a tensor copied as it is (reshaped only).
    """

    path: ParamPath
    shape: tuple[int, ...]
    n_in: int | None
    deepspec_shape: tuple[int, ...]


def _linear(path: ParamPath, in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> Tensor:
    return Tensor(path, (*in_shape, *out_shape), len(in_shape), (math.prod(out_shape), math.prod(in_shape)))


def _copy(path: ParamPath, shape: tuple[int, ...], deepspec_shape: tuple[int, ...] | None = None) -> Tensor:
    return Tensor(path, shape, None, shape if deepspec_shape is None else deepspec_shape)


def tensor_layout(cfg: DraftConfig) -> dict[str, Tensor]:
    """Every draft tensor of the DeepSpec layout by DeepSpec name, for a baseline draft of shape `cfg`."""
    h, v, r = cfg.hidden_size, cfg.vocab_size, cfg.markov_rank
    q, g, d, i = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    out = {
        "fc.weight": _linear(("aux_proj", "kernel"), (cfg.num_aux * h,), (h,)),
        "hidden_norm.weight": _copy(("aux_norm", "scale"), (h,)),
    }
    for n in range(cfg.num_layers):
        p, name = ("layers", n), f"layers.{n}."
        out |= {
            name + "input_layernorm.weight": _copy((*p, "input_norm", "scale"), (h,)),
            name + "self_attn.q_proj.weight": _linear((*p, "attn", "q", "kernel"), (h,), (q, d)),
            name + "self_attn.k_proj.weight": _linear((*p, "attn", "k", "kernel"), (h,), (g, d)),
            name + "self_attn.v_proj.weight": _linear((*p, "attn", "v", "kernel"), (h,), (g, d)),
            name + "self_attn.o_proj.weight": _linear((*p, "attn", "o", "kernel"), (q, d), (h,)),
            name + "self_attn.q_norm.weight": _copy((*p, "attn", "q_norm", "scale"), (d,)),
            name + "self_attn.k_norm.weight": _copy((*p, "attn", "k_norm", "scale"), (d,)),
            name + "post_attention_layernorm.weight": _copy((*p, "post_attn_norm", "scale"), (h,)),
            name + "mlp.gate_proj.weight": _linear((*p, "mlp", "gate", "kernel"), (h,), (i,)),
            name + "mlp.up_proj.weight": _linear((*p, "mlp", "up", "kernel"), (h,), (i,)),
            name + "mlp.down_proj.weight": _linear((*p, "mlp", "down", "kernel"), (i,), (h,)),
        }
    return out | {
        "norm.weight": _copy(("final_norm", "scale"), (h,)),
        "markov_head.markov_w1.weight": _copy(("markov", "w1"), (v, r)),
        "markov_head.markov_w2.weight": _linear(("markov", "w2"), (r,), (v,)),
        "confidence_head.proj.weight": _linear(("confidence", "kernel"), (h + r,), ()),
        "confidence_head.proj.bias": _copy(("confidence", "bias"), (), (1,)),
    }


def dotted(path: ParamPath) -> str:
    return ".".join(map(str, path))


def check_exportable(shapes: Mapping[ParamPath, tuple[int, ...]], cfg: DraftConfig, group: str) -> None:
    """Refuses a draft (its parameters' `shapes` by path) that has a parameter without a DeepSpec name."""
    layout = tensor_layout(cfg)
    named = {t.path: t for t in layout.values()}
    unnamed = sorted(dotted(p) for p in shapes if p not in named)
    if unnamed:
        hint = (
            "a learned MASK vector: DeepSpec's MASK is embed_tokens[mask_token_id], so train with "
            "draft.mask_token_id set to a spare target row"
            if unnamed == ["mask_embedding"]
            else "DeepSpec's layout holds the baseline DSpark draft only"
        )
        raise ValueError(
            f"experiment group {group!r}: draft parameters {', '.join(unnamed)} have no name in DeepSpec's "
            f"{ARCHITECTURE} layout ({hint})"
        )
    missing = [f"no parameter {dotted(p)}" for p in named if p not in shapes]
    resized = [
        f"{dotted(p)} has shape {tuple(shapes[p])}, DeepSpec's tensor needs {t.shape}"
        for p, t in named.items()
        if p in shapes and tuple(shapes[p]) != t.shape
    ]
    if missing or resized:
        raise ValueError(
            f"experiment group {group!r}: the draft does not fit DeepSpec's {ARCHITECTURE} layout: "
            + "; ".join(missing + resized)
        )


def to_deepspec(
    params: Mapping[ParamPath, np.ndarray], cfg: DraftConfig, group: str
) -> dict[str, np.ndarray]:
    """The draft's parameters (arrays by path) as DeepSpec tensors by name, values unchanged."""
    check_exportable({p: np.shape(x) for p, x in params.items()}, cfg, group)
    out = {}
    for name, t in tensor_layout(cfg).items():
        x = np.asarray(params[t.path])
        linear = t.n_in is not None
        out[name] = x.reshape(math.prod(t.shape[: t.n_in]), -1).T if linear else x.reshape(t.deepspec_shape)
    return out


def check_tensors(shapes: Mapping[str, tuple[int, ...]], cfg: DraftConfig, source: str) -> None:
    """Refuses DeepSpec tensors (`shapes` by name) that are missing, mis-shaped or unknown to the draft
    of shape `cfg`. The target's matrices may be absent; present, they must be `[V, H]`."""
    layout = tensor_layout(cfg)
    expected = {name: t.deepspec_shape for name, t in layout.items()}
    expected |= dict.fromkeys(TARGET_TENSORS, (cfg.vocab_size, cfg.hidden_size))
    problems = [
        f"missing tensor {name} {list(t.deepspec_shape)}" for name, t in layout.items() if name not in shapes
    ]
    for name, shape in shapes.items():
        if name not in expected:
            problems.append(
                f"unexpected tensor {name} {list(shape)} (not part of a vanilla-Markov DSpark draft)"
            )
        elif tuple(shape) != expected[name]:
            problems.append(f"tensor {name} has shape {list(shape)}, expected {list(expected[name])}")
    if problems:
        shown = problems[:8] + ([f"... and {len(problems) - 8} more"] if len(problems) > 8 else [])
        raise ValueError(f"{source}: {'; '.join(shown)}")


def from_deepspec(
    tensors: Mapping[str, np.ndarray], cfg: DraftConfig, source: str
) -> dict[ParamPath, np.ndarray]:
    """DeepSpec tensors by name as the draft's parameters by path (checked first, values unchanged)."""
    check_tensors({name: np.shape(x) for name, x in tensors.items()}, cfg, source)
    out = {}
    for name, t in tensor_layout(cfg).items():
        w = np.asarray(tensors[name])
        out[t.path] = w.reshape(t.shape) if t.n_in is None else w.T.reshape(t.shape)
    return out


# ---- config.json -------------------------------------------------------------------------------

# The config.json keys an import must agree on, with the setting each one comes from here.
_CHECKED = {
    "architectures": "the project's draft",
    "hidden_size": "the target's hidden_size",
    "vocab_size": "the target's vocab_size",
    "num_target_layers": "the target's num_layers",
    "rms_norm_eps": "the target's rms_norm_eps",
    "rope_theta": "the target's rope_theta",
    "num_hidden_layers": "draft.num_layers",
    "num_attention_heads": "draft.num_heads",
    "num_key_value_heads": "draft.num_kv_heads",
    "head_dim": "draft.head_dim",
    "intermediate_size": "draft.intermediate_size",
    "block_size": "draft.block_size",
    "mask_token_id": "draft.mask_token_id",
    "markov_rank": "draft.markov_rank",
    "target_layer_ids": "data.aux_layer_ids",
    "markov_head_type": "the project's Markov head",
    "enable_confidence_head": "the project's draft",
    "confidence_head_with_markov": "the project's confidence head reads [h; m]",
    "attention_bias": "the project's draft layers",
    "hidden_act": "the project's draft layers",
    "rope_type": "the project's draft RoPE",
}


def _draft_keys(cfg: DraftConfig, num_target_layers: int, target_layer_ids: Sequence[int]) -> dict[str, Any]:
    """The config.json values that describe the draft of shape `cfg` reading `target_layer_ids`."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "num_target_layers": num_target_layers,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "block_size": cfg.block_size,
        "mask_token_id": -1 if cfg.mask_token_id is None else cfg.mask_token_id,
        "markov_rank": cfg.markov_rank,
        "target_layer_ids": [int(i) for i in target_layer_ids],
        "markov_head_type": MARKOV_HEAD_TYPE,
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        "attention_bias": False,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * cfg.num_layers,
        # Not DeepSpec's key: the engines' (vLLM, SGLang) for DeepSpec's block layout, their default too.
        "sample_from_anchor": True,
    }


def hf_target_config(target: TargetConfig) -> dict[str, Any]:
    """A Hugging Face `config.json` dict of a target that has none (a GGUF file or a random target)."""
    return {
        "model_type": target.family,
        "vocab_size": target.vocab_size,
        "hidden_size": target.hidden_size,
        "intermediate_size": target.intermediate_size,
        "num_hidden_layers": target.num_layers,
        "num_attention_heads": target.num_heads,
        "num_key_value_heads": target.num_kv_heads,
        "head_dim": target.head_dim,
        "hidden_act": "silu",
        "rope_theta": target.rope_theta,
        "rms_norm_eps": target.rms_norm_eps,
        "tie_word_embeddings": target.tie_word_embeddings,
        "attention_bias": target.attention_bias,
        "max_position_embeddings": target.max_position_embeddings,
        "bos_token_id": target.bos_token_id,
        "eos_token_id": list(target.eos_token_ids),
    }


def deepspec_config(
    target_config: Mapping[str, Any],
    cfg: DraftConfig,
    *,
    num_target_layers: int,
    target_layer_ids: Sequence[int],
    num_anchors: int,
    dtype: str,
) -> dict[str, Any]:
    """The draft's `config.json`: the target's `target_config` with DeepSpec's draft keys set.

    RoPE is written unscaled (the draft's), both as `rope_theta` and as transformers 5's `rope_parameters`.
    """
    ids = [int(i) for i in target_layer_ids]
    if any(b <= a for a, b in itertools.pairwise(ids)):
        raise ValueError(
            f"data.aux_layer_ids={tuple(ids)}: DeepSpec's target_layer_ids must strictly increase"
        )
    keys = _draft_keys(cfg, num_target_layers, ids)
    rope = {"rope_scaling": None, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta}}
    out = {k: v for k, v in target_config.items() if k not in ("dtype", "quantization_config")}
    return out | keys | rope | {"num_anchors": int(num_anchors), "torch_dtype": dtype}


def _effective(config_json: Mapping[str, Any]) -> dict[str, Any]:
    """`config_json` with Hugging Face's defaults filled in and the RoPE settings of either transformers
    generation (`rope_theta` + `rope_scaling`, or `rope_parameters`) as `rope_theta` and `rope_type`."""
    out = dict(config_json)
    rope = out.get("rope_parameters") or out.get("rope_scaling") or {}
    if "rope_theta" not in out and "rope_theta" in rope:
        out["rope_theta"] = rope["rope_theta"]
    out["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
    if "head_dim" not in out and "hidden_size" in out and out.get("num_attention_heads"):
        out["head_dim"] = out["hidden_size"] // out["num_attention_heads"]
    out.setdefault("attention_bias", False)
    out.setdefault("hidden_act", "silu")
    return out


def _same(got: Any, want: Any) -> bool:
    if isinstance(want, float) and isinstance(got, int | float) and not isinstance(got, bool):
        return math.isclose(got, want, rel_tol=1e-6)
    if isinstance(want, list) and isinstance(got, list | tuple):
        return list(got) == want
    return type(got) is type(want) and got == want


def check_config(
    config_json: Mapping[str, Any],
    cfg: DraftConfig,
    *,
    num_target_layers: int,
    target_layer_ids: Sequence[int],
    source: str,
) -> None:
    """Refuses a DeepSpec `config.json` that disagrees with the draft of shape `cfg`, naming every key."""
    want = _draft_keys(cfg, num_target_layers, target_layer_ids) | {"rope_type": "default"}
    got = _effective(config_json)
    problems = []
    for key, origin in _CHECKED.items():
        if key not in got:
            problems.append(f"{key} is missing (expected {want[key]!r}, {origin})")
        elif not _same(got[key], want[key]):
            settable = origin.startswith(("draft.", "data."))
            hint = f"; pass --config.{origin}={_flag_value(got[key])}" if settable else ""
            problems.append(f"{key}={got[key]!r}, expected {want[key]!r} ({origin}{hint})")
    if problems:
        raise ValueError(f"{source} does not match the config: {'; '.join(problems)}")


def _flag_value(value: Any) -> str:
    return f"'({', '.join(map(str, value))})'" if isinstance(value, list | tuple) else str(value)


# ---- The directory -------------------------------------------------------------------------------


def write_directory(directory: str | Path, config_json: Mapping[str, Any], tensors: Mapping[str, np.ndarray]):
    """Writes `config.json` and `model.safetensors` (torch-loadable metadata) into `directory`."""
    return save_hf_checkpoint(directory, config_json, tensors)


def read_config(directory: str | Path) -> dict[str, Any]:
    """The `config.json` of a DeepSpec draft directory."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"DeepSpec draft directory not found: {directory}")
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{directory}: no {CONFIG_FILE}")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def _tensor_files(directory: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (one file, or an index and its shards)."""
    if (directory / WEIGHTS_FILE).is_file():
        return dict.fromkeys(_header(directory / WEIGHTS_FILE), directory / WEIGHTS_FILE)
    index = directory / INDEX_FILE
    if not index.is_file():
        raise FileNotFoundError(f"{directory}: no {WEIGHTS_FILE} or {INDEX_FILE}")
    weight_map = json.loads(index.read_text()).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index}: no weight_map")
    return {name: directory / file for name, file in weight_map.items()}


def _header(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Tensor name -> (shape, safetensors dtype such as 'F32'); fails on a missing or truncated file."""
    if not path.is_file():
        raise FileNotFoundError(f"safetensors file not found: {path}")
    return safetensors_header(path)


def tensor_specs(directory: str | Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor's `(shape, dtype)`, from the safetensors headers only."""
    files = _tensor_files(Path(directory))
    headers = {path: _header(path) for path in set(files.values())}
    return {name: headers[path][name] for name, path in files.items() if name in headers[path]}


def tensor_shapes(directory: str | Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape, from the safetensors headers only."""
    return {name: shape for name, (shape, _) in tensor_specs(directory).items()}


def read_tensors(directory: str | Path, names: Iterable[str]) -> dict[str, np.ndarray]:
    """The tensors `names` as NumPy arrays in their stored dtypes."""
    names, files = list(names), _tensor_files(Path(directory))
    out = {}
    for path in sorted({files[name] for name in names}):
        with safe_open(path, framework="numpy") as f:
            out |= {name: f.get_tensor(name) for name in names if files[name] == path}
    return out
