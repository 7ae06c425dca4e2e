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
from dspark_jax.target.checkpoint import TargetCheckpoint
from dspark_jax.target.config import TargetConfig
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
}
_TOP_TENSORS: dict[tuple[str, ...], tuple[str, str]] = {
    ("embedding",): ("model.embed_tokens.weight", "vector"),
    ("final_norm", "scale"): ("model.norm.weight", "vector"),
    ("lm_head",): ("lm_head.weight", "transpose"),
}


def hf_source(path: tuple) -> tuple[str, str]:
    """Hugging Face tensor name and layout change for one model variable path."""
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


def abstract_model(
    cfg: TargetConfig, param_dtype: Dtype = jnp.float32, dtype: Dtype = jnp.float32
) -> Transformer:
    """The model with `ShapeDtypeStruct` leaves: shapes and metadata without memory."""
    return nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0), param_dtype=param_dtype, dtype=dtype))


def build_model(
    cfg: TargetConfig,
    read: Callable[[tuple, tuple[int, ...]], np.ndarray],
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

    def read(path, shape):
        name, layout = hf_source(path)
        return to_model_layout(ckpt.read(name), layout, shape)

    return build_model(ckpt.config, read, **kwargs)
