"""Target model configuration, read from a Hugging Face `config.json` or GGUF metadata.

One dataclass describes every supported decoder-only family (Llama 3, Qwen2/2.5, Qwen3
dense, SmolLM2); the differences between families are flags (`attention_bias`,
`qk_norm`, `tie_word_embeddings`) and the RoPE settings.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

# Hugging Face `model_type` / GGUF `general.architecture` -> our family name.
_HF_FAMILIES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_GGUF_FAMILIES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


class UnsupportedModelError(ValueError):
    """The checkpoint describes an architecture or feature this package does not run."""


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    """Shape and numerics of a frozen target LLM.

    Attributes:
      family: 'llama' (Llama 3, SmolLM2), 'qwen2' (Qwen2/2.5) or 'qwen3' (Qwen3 dense).
      vocab_size: rows of the embedding and LM head.
      hidden_size: width of the residual stream, `H`.
      intermediate_size: SwiGLU hidden width.
      num_layers: decoder layers, `L`.
      num_heads: query heads.
      num_kv_heads: key/value heads (GQA when smaller than `num_heads`).
      head_dim: per-head width.
      rope_theta: RoPE base.
      rms_norm_eps: epsilon of every RMSNorm.
      tie_word_embeddings: LM head shares the embedding matrix.
      attention_bias: q/k/v projections carry a bias (Qwen2).
      qk_norm: per-head RMSNorm on queries and keys (Qwen3).
      max_position_embeddings: longest supported sequence.
      rope_freq_factors: optional per-frequency divisors of the RoPE inverse
        frequencies (Llama 3.1 scaling), `head_dim // 2` values.
      bos_token_id / eos_token_ids: special ids from the checkpoint, if known.
    """

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 4096
    rope_freq_factors: tuple[float, ...] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.family not in _HF_FAMILIES.values():
            raise UnsupportedModelError(
                f"unknown target family {self.family!r}; supported: {sorted(set(_HF_FAMILIES.values()))}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"TargetConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads=} must be a multiple of {self.num_kv_heads=}")
        if self.head_dim % 2:
            raise ValueError(f"{self.head_dim=} must be even for RoPE")
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.head_dim // 2:
            raise ValueError(
                f"rope_freq_factors has {len(self.rope_freq_factors)} values, expected head_dim // 2 = "
                f"{self.head_dim // 2}"
            )

    def layer_index(self, layer_id: int) -> int:
        """Validates an aux layer id (-1 = embedding output, 0..L-1 = decoder layer output)."""
        if not -1 <= layer_id < self.num_layers:
            raise ValueError(
                f"layer id {layer_id} out of range: -1 (embedding) .. {self.num_layers - 1} "
                f"(last of {self.num_layers} decoder layers)"
            )
        return layer_id

    def rope_inv_freq(self) -> np.ndarray:
        """Inverse RoPE frequencies, float64 `[head_dim // 2]`."""
        inv_freq = 1.0 / self.rope_theta ** (np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim)
        if self.rope_freq_factors is not None:
            inv_freq = inv_freq / np.asarray(self.rope_freq_factors, np.float64)
        return inv_freq

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TargetConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown TargetConfig keys {unknown}")
        data = dict(data)
        for key in ("rope_freq_factors", "eos_token_ids"):
            if data.get(key) is not None:
                data[key] = tuple(data[key])
        return cls(**data)


def _llama3_freq_factors(scaling: Mapping[str, Any], head_dim: int, theta: float) -> tuple[float, ...]:
    """Per-frequency divisors equivalent to Hugging Face's 'llama3' rope scaling."""
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling["original_max_position_embeddings"])
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    medium = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    scaled = np.where(medium, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    return tuple(float(x) for x in inv_freq / scaled)


def _as_id_tuple(value: int | Sequence[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def from_hf_config(cfg: Mapping[str, Any], source: str = "config.json") -> TargetConfig:
    """Builds a TargetConfig from a Hugging Face `config.json` dictionary."""
    model_type = cfg.get("model_type")
    if model_type not in _HF_FAMILIES:
        raise UnsupportedModelError(
            f"{source}: model_type {model_type!r} is not supported; supported: {sorted(_HF_FAMILIES)}"
        )
    family = _HF_FAMILIES[model_type]
    try:
        hidden = int(cfg["hidden_size"])
        num_heads = int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or hidden // num_heads)
        # transformers < 5 writes `rope_theta` + `rope_scaling`; >= 5 one `rope_parameters` dict.
        scaling = cfg.get("rope_parameters") or cfg.get("rope_scaling")
        theta = float(cfg.get("rope_theta", (scaling or {}).get("rope_theta", 10000.0)))
        factors = None
        if scaling:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind == "llama3":
                factors = _llama3_freq_factors(scaling, head_dim, theta)
            elif kind not in (None, "default"):
                raise UnsupportedModelError(f"{source}: rope_scaling type {kind!r} is not supported")
        return TargetConfig(
            family=family,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            rope_theta=theta,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", family == "qwen2")),
            qk_norm=family == "qwen3",
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            rope_freq_factors=factors,
            bos_token_id=None if cfg.get("bos_token_id") is None else int(cfg["bos_token_id"]),
            eos_token_ids=_as_id_tuple(cfg.get("eos_token_id")),
        )
    except KeyError as e:
        raise ValueError(f"{source}: missing required key {e.args[0]!r}") from None


def from_gguf_metadata(
    metadata: Mapping[str, Any], tensor_names: Sequence[str], source: str = "gguf"
) -> TargetConfig:
    """Builds a TargetConfig from GGUF key/value metadata and the file's tensor names.

    `metadata` maps GGUF keys (e.g. 'llama.embedding_length') to Python values; tied
    embeddings are detected by the absence of an `output.weight` tensor.
    """
    arch = metadata.get("general.architecture")
    if arch not in _GGUF_FAMILIES:
        raise UnsupportedModelError(
            f"{source}: general.architecture {arch!r} is not supported; supported: {sorted(_GGUF_FAMILIES)}"
        )
    family = _GGUF_FAMILIES[arch]

    def get(key, default=None):
        full = f"{arch}.{key}"
        if full not in metadata:
            if default is None:
                raise ValueError(f"{source}: missing GGUF metadata key {full!r}")
            return default
        value = metadata[full]
        if isinstance(value, list):  # per-layer values: only uniform layers are supported
            if len(set(value)) != 1:
                raise UnsupportedModelError(f"{source}: {full} varies across layers ({value}); not supported")
            value = value[0]
        return value

    hidden = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    vocab = metadata.get(f"{arch}.vocab_size")
    if vocab is None:
        tokens = metadata.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise ValueError(f"{source}: neither {arch}.vocab_size nor tokenizer.ggml.tokens present")
        vocab = len(tokens)
    names = set(tensor_names)
    if "rope_freqs.weight" in names:
        raise UnsupportedModelError(
            f"{source}: tensor 'rope_freqs.weight' (Llama 3.1 RoPE scaling) is not supported from GGUF; "
            "load the Hugging Face checkpoint instead"
        )
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    eot = metadata.get("tokenizer.ggml.eot_token_id")
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    return TargetConfig(
        family=family,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(get("attention.head_count_kv", num_heads)),
        head_dim=int(get("attention.key_length", hidden // num_heads)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        max_position_embeddings=int(get("context_length", 4096)),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(sorted({int(t) for t in (eos, eot) if t is not None})),
    )
