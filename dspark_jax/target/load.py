"""Loading a target checkpoint into the NNX model, placed with its shardings on a mesh.

The checkpoint readers (`dspark_jax.target.checkpoint`) yield tensors under Hugging Face
names and layouts; this module maps them onto the model's variables one tensor at a time,
so a large target never sits whole in host memory.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from dspark_jax import sharding
from dspark_jax.nn import Dtype
from dspark_jax.target.checkpoint import TargetCheckpoint, linear_projection_rows, linear_projections
from dspark_jax.target.config import TargetConfig
from dspark_jax.target.families import LINEAR_PARTS
from dspark_jax.target.model import Transformer

# Our variable path (below 'layers.{i}') -> (HF name below 'model.layers.{i}', layout change).
_LAYER_TENSORS: dict[tuple[str, ...], tuple[str, str]] = {
    ("input_norm", "scale"): ("input_layernorm.weight", "vector"),
    ("post_attn_norm", "scale"): ("post_attention_layernorm.weight", "vector"),
    ("attn", "q", "kernel"): ("self_attn.q_proj.weight", "in_heads"),
    ("attn", "k", "kernel"): ("self_attn.k_proj.weight", "in_heads"),
    ("attn", "v", "kernel"): ("self_attn.v_proj.weight", "in_heads"),
    ("attn", "q", "bias"): ("self_attn.q_proj.bias", "heads"),
    ("attn", "k", "bias"): ("self_attn.k_proj.bias", "heads"),
    ("attn", "v", "bias"): ("self_attn.v_proj.bias", "heads"),
    ("attn", "o", "kernel"): ("self_attn.o_proj.weight", "heads_out"),
    ("attn", "q_norm", "scale"): ("self_attn.q_norm.weight", "vector"),
    ("attn", "k_norm", "scale"): ("self_attn.k_norm.weight", "vector"),
    ("mlp", "gate", "kernel"): ("mlp.gate_proj.weight", "transpose"),
    ("mlp", "up", "kernel"): ("mlp.up_proj.weight", "transpose"),
    ("mlp", "down", "kernel"): ("mlp.down_proj.weight", "transpose"),
    ("linear_attn", "dt_bias"): ("linear_attn.dt_bias", "vector"),
    ("linear_attn", "a_log"): ("linear_attn.A_log", "vector"),
    ("linear_attn", "norm_scale"): ("linear_attn.norm.weight", "vector"),
    ("linear_attn", "out", "kernel"): ("linear_attn.out_proj.weight", "heads_out"),
    ("mlp", "router", "kernel"): ("mlp.gate.weight", "transpose"),
    ("mlp", "shared", "gate", "kernel"): ("mlp.shared_expert.gate_proj.weight", "transpose"),
    ("mlp", "shared", "up", "kernel"): ("mlp.shared_expert.up_proj.weight", "transpose"),
    ("mlp", "shared", "down", "kernel"): ("mlp.shared_expert.down_proj.weight", "transpose"),
    ("mlp", "shared_gate", "kernel"): ("mlp.shared_expert_gate.weight", "transpose"),
}
_TOP_TENSORS: dict[tuple[str, ...], tuple[str, str]] = {
    ("embedding",): ("model.embed_tokens.weight", "vector"),
    ("final_norm", "scale"): ("model.norm.weight", "vector"),
    ("lm_head",): ("lm_head.weight", "transpose"),
}
# Experts stored one SwiGLU per expert: our stacked variable -> the per-expert HF name below `mlp.`.
_EXPERT_TENSORS = {"gate_XxHxI": "gate_proj", "up_XxHxI": "up_proj", "down_XxIxH": "down_proj"}


def hf_source(path: tuple) -> tuple[str, str]:
    """Hugging Face tensor name and layout change for one model variable path read from one tensor."""
    if path[0] == "layers":
        name, layout = _LAYER_TENSORS[tuple(path[2:])]
        return f"model.layers.{path[1]}.{name}", layout
    return _TOP_TENSORS[tuple(path)]


def to_model_layout(hf_value: np.ndarray, layout: str, shape: tuple[int, ...]) -> np.ndarray:
    """Rearranges a torch-layout (`[out, in]`) tensor into the model variable's `shape`."""
    if layout == "vector":
        out = hf_value
    elif layout == "transpose" or layout == "in_heads":
        out = hf_value.T
    elif layout == "heads":  # [QD] -> [Q, D] (or G heads in place of Q)
        out = hf_value
    elif layout == "heads_out":  # [H, QD] -> [Q, D, H]
        out = hf_value.T
    else:
        raise ValueError(f"unknown layout {layout!r}")
    return np.ascontiguousarray(out).reshape(shape)


def _linear_attention_rows(
    cfg: TargetConfig, read: Callable[[str], np.ndarray], p: str, part: str
) -> np.ndarray:
    """The projection rows `[out, H]` of one part of a Gated DeltaNet layer (`LINEAR_PARTS`), cut from the
    checkpoint tensor that stacks it with others, part by part or key head by key head
    (`checkpoint.linear_projections`)."""
    stored, rows = linear_projections(cfg), linear_projection_rows(cfg)
    name, parts = next((name, parts) for name, parts in stored.tensors if part in parts)
    heads = cfg.linear_num_key_heads if stored.per_key_head else 1
    sizes = [rows[x] // heads for x in parts]  # each part's rows per key head (or in all)
    i = parts.index(part)
    start = sum(sizes[:i])
    weight = read(f"{p}{name}.weight").reshape(heads, sum(sizes), -1)
    return weight[:, start : start + sizes[i]].reshape(rows[part], -1)


def _split_conv_taps(cfg: TargetConfig, weight_Cx1xK: np.ndarray) -> dict[str, np.ndarray]:
    """The depthwise conv weight `[C, 1, K]` (channels `[q; k; v]`) as our per-part taps `[K, C_part]`."""
    key_dim = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    taps_KxC = weight_Cx1xK[:, 0, :].T
    q, k, v = np.split(taps_KxC, [key_dim, 2 * key_dim], axis=1)
    return dict(q_taps=q, k_taps=k, v_taps=v)


# `read(path, shape)`: the value of the model variable at `path` (e.g. ('layers', 3, 'attn', 'q', 'kernel')).
TensorReader = Callable[[tuple, tuple[int, ...]], np.ndarray]


def tensor_reader(ckpt: TargetCheckpoint) -> TensorReader:
    """`read(path, shape)`: the value of model variable `path` from the checkpoint's tensors, whether it is
    one tensor (`hf_source`), a part of a fused one (gated queries, linear-attention projections, conv
    taps) or a stack of per-expert ones."""
    cfg = ckpt.config
    d = cfg.head_dim

    def read(path, shape):
        if path[0] == "layers" and len(path) >= 4:
            prefix, sub = f"model.layers.{path[1]}.", tuple(path[2:])
            if sub[0] == "linear_attn" and sub[1] in LINEAR_PARTS:
                rows = _linear_attention_rows(cfg, ckpt.read, prefix + "linear_attn.", sub[1])
                return to_model_layout(rows, "in_heads", shape)
            if sub[0] == "linear_attn" and sub[1].endswith("_taps"):
                taps = _split_conv_taps(cfg, ckpt.read(prefix + "linear_attn.conv1d.weight"))[sub[1]]
                return np.ascontiguousarray(taps).reshape(shape)
            if sub[0] == "mlp" and sub[1] in _EXPERT_TENSORS:
                part = _EXPERT_TENSORS[sub[1]]
                return np.stack(
                    [ckpt.read(f"{prefix}mlp.experts.{x}.{part}.weight").T for x in range(cfg.num_experts)]
                ).reshape(shape)
            if cfg.attn_output_gate and sub in (("attn", "q", "kernel"), ("attn_gate", "kernel")):
                rows = ckpt.read(prefix + "self_attn.q_proj.weight").reshape(cfg.num_heads, 2 * d, -1)
                half = rows[:, :d] if sub[0] == "attn" else rows[:, d:]
                return to_model_layout(half.reshape(cfg.num_heads * d, -1), "in_heads", shape)
        name, layout = hf_source(path)
        return to_model_layout(ckpt.read(name), layout, shape)

    return read


def abstract_model(
    cfg: TargetConfig, param_dtype: Dtype = jnp.float32, dtype: Dtype = jnp.float32
) -> Transformer:
    """The model with `ShapeDtypeStruct` leaves: shapes and metadata without memory."""
    return nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0), param_dtype=param_dtype, dtype=dtype))


def build_model(
    cfg: TargetConfig,
    read: TensorReader,
    *,
    mesh: Mesh | None = None,
    rules: sharding.Rules = sharding.DEFAULT_RULES,
    param_dtype: Dtype = jnp.float32,
    dtype: Dtype = jnp.float32,
) -> Transformer:
    """Materialises a model whose every parameter comes from `read(path, shape)`, placed on `mesh`."""
    mesh = mesh or sharding.make_mesh()
    graphdef, state = nnx.split(abstract_model(cfg, param_dtype, dtype))
    shardings = sharding.state_shardings(state, mesh, rules)
    inv_freq = jnp.asarray(cfg.rope_inv_freq(), jnp.float32)

    def place(path, variable, named_sharding):
        struct = variable.get_value()
        value = inv_freq if path == ("inv_freq",) else read(path, tuple(struct.shape))
        if tuple(value.shape) != tuple(struct.shape):
            raise ValueError(
                f"variable {'.'.join(map(str, path))}: shape {value.shape}, expected {struct.shape}"
            )
        return variable.replace(jax.device_put(np.asarray(value).astype(struct.dtype), named_sharding))

    flat = nnx.to_flat_state(state)
    flat_shardings = dict(nnx.to_flat_state(shardings))
    placed = [(path, place(path, var, flat_shardings[path])) for path, var in flat]
    return nnx.merge(graphdef, nnx.from_flat_state(placed))


def model_from_checkpoint(ckpt: TargetCheckpoint, **kwargs) -> Transformer:
    """Loads every parameter of `ckpt` into a (sharded) model; see `build_model` for kwargs."""
    return build_model(ckpt.config, tensor_reader(ckpt), **kwargs)
