"""Target model configuration, read from a Hugging Face `config.json` or GGUF metadata.

One dataclass describes every supported decoder-only family; the differences between families are
flags and shapes, and which flags a checkpoint's family sets is its record in `families` (looked up by
`config.json`'s `model_type` or GGUF's `general.architecture`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dspark_jax.target import families

FULL_ATTENTION, LINEAR_ATTENTION = "full_attention", "linear_attention"
# Fields added with the sparse and hybrid families (written only when set, see `TargetConfig.to_json`).
_LATER_FIELDS = (
    "layer_types",
    "attn_output_gate",
    "partial_rotary_factor",
    "norm_unit_offset",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
)
LAYER_TYPES = (FULL_ATTENTION, LINEAR_ATTENTION)


class UnsupportedModelError(ValueError):
    """The checkpoint describes an architecture or feature this package does not run."""


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    """Shape and numerics of a frozen target LLM.

    Attributes:
      family: the name of a registered family (`families.FAMILIES`, e.g. 'llama', 'qwen3').
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
      layer_types: per layer "full_attention" or "linear_attention" (empty: all full attention).
      attn_output_gate: full attention's query projection also yields a per-channel gate
        `sigmoid(g)` on the attention output (Qwen3-Next, Qwen 3.5).
      partial_rotary_factor: fraction of each head's dims that RoPE rotates (the first ones).
      norm_unit_offset: every RMSNorm scales by `1 + weight` (weights stored centred on zero).
      linear_num_key_heads / linear_num_value_heads / linear_key_head_dim / linear_value_head_dim /
        linear_conv_kernel_dim: the Gated DeltaNet layers' shapes (`G`, `J`, `D`, `Y`, conv taps).
      num_experts / num_experts_per_tok / moe_intermediate_size: the sparse MLP (0 experts: dense).
      shared_expert_intermediate_size: the gated shared expert's width (0: none).
      norm_topk_prob: the top-k routing weights are renormalised to sum to one.
      decoder_sparse_step / mlp_only_layers: which layers are sparse (every step-th, but these).
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
    layer_types: tuple[str, ...] = ()
    attn_output_gate: bool = False
    partial_rotary_factor: float = 1.0
    norm_unit_offset: bool = False
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self):
        if self.family not in families.FAMILIES:
            raise UnsupportedModelError(
                f"unknown target family {self.family!r}; supported: {families.names()}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"TargetConfig.{name} must be positive, got {getattr(self, name)}")
        dense_layers = [i for i in range(self.num_layers) if not self.is_sparse(i)]
        if dense_layers and self.intermediate_size <= 0:
            raise ValueError(
                f"TargetConfig.intermediate_size must be positive for the dense MLP of layers "
                f"{dense_layers[:8]}, got {self.intermediate_size}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads=} must be a multiple of {self.num_kv_heads=}")
        if self.head_dim % 2:
            raise ValueError(f"{self.head_dim=} must be even for RoPE")
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.rotary_dim // 2:
            raise ValueError(
                f"rope_freq_factors has {len(self.rope_freq_factors)} values, expected rotary_dim // 2 = "
                f"{self.rotary_dim // 2}"
            )
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2:
            raise ValueError(
                f"partial_rotary_factor={self.partial_rotary_factor} must be in (0, 1] and rotate an even "
                f"number of the head's {self.head_dim} dims"
            )
        if self.layer_types:
            unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if unknown:
                raise UnsupportedModelError(
                    f"layer_types {unknown} are not supported; supported: {list(LAYER_TYPES)}"
                )
            if len(self.layer_types) != self.num_layers:
                raise ValueError(
                    f"layer_types names {len(self.layer_types)} layers, num_layers is {self.num_layers}"
                )
        if LINEAR_ATTENTION in self.layer_types:
            for name in (
                "linear_num_key_heads",
                "linear_num_value_heads",
                "linear_key_head_dim",
                "linear_value_head_dim",
                "linear_conv_kernel_dim",
            ):
                if getattr(self, name) <= 0:
                    raise ValueError(f"TargetConfig.{name} must be positive for linear-attention layers")
            if self.linear_num_value_heads % self.linear_num_key_heads:
                raise ValueError(
                    f"linear_num_value_heads={self.linear_num_value_heads} must be a multiple of "
                    f"linear_num_key_heads={self.linear_num_key_heads}"
                )
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts or self.moe_intermediate_size <= 0:
                raise ValueError(
                    f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..num_experts="
                    f"{self.num_experts} and moe_intermediate_size={self.moe_intermediate_size} positive"
                )
            if self.decoder_sparse_step < 1:
                raise ValueError(f"decoder_sparse_step={self.decoder_sparse_step} must be >= 1")

    @property
    def rotary_dim(self) -> int:
        """Dims of each attention head that RoPE rotates (the first `rotary_dim`)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_type(self, index: int) -> str:
        """ "full_attention" or "linear_attention" for decoder layer `index`."""
        return self.layer_types[index] if self.layer_types else FULL_ATTENTION

    def is_sparse(self, index: int) -> bool:
        """Whether decoder layer `index` routes its MLP through the experts."""
        return (
            self.num_experts > 0
            and index not in self.mlp_only_layers
            and (index + 1) % self.decoder_sparse_step == 0
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
        """Inverse RoPE frequencies, float64 `[rotary_dim // 2]`."""
        dim = self.rotary_dim
        inv_freq = 1.0 / self.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
        if self.rope_freq_factors is not None:
            inv_freq = inv_freq / np.asarray(self.rope_freq_factors, np.float64)
        return inv_freq

    def to_json(self) -> dict[str, Any]:
        """The fields, less those of the sparse and hybrid families left at their defaults: a dense
        target's JSON (and so the fingerprints of its stored caches) is what it was before they existed."""
        data = dataclasses.asdict(self)
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        return {k: v for k, v in data.items() if k not in _LATER_FIELDS or v != defaults[k]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TargetConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown TargetConfig keys {unknown}")
        data = dict(data)
        for key in ("rope_freq_factors", "eos_token_ids", "layer_types", "mlp_only_layers"):
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
    """Builds a TargetConfig from a Hugging Face `config.json` dictionary (a multimodal Qwen 3.5
    checkpoint's text model from its `text_config`)."""
    model_type, readers = cfg.get("model_type"), families.by_model_type()
    if model_type not in readers:
        raise UnsupportedModelError(
            f"{source}: model_type {model_type!r} is not supported; supported: {sorted(readers)}"
        )
    family = readers[model_type]
    if isinstance(cfg.get("text_config"), Mapping):
        cfg = {**{k: v for k, v in cfg.items() if k != "text_config"}, **cfg["text_config"]}
    try:
        hidden = int(cfg["hidden_size"])
        num_heads = int(cfg["num_attention_heads"])
        num_layers = int(cfg["num_hidden_layers"])
        head_dim = int(cfg.get("head_dim") or hidden // num_heads)
        # transformers < 5 writes `rope_theta` + `rope_scaling`; >= 5 one `rope_parameters` dict.
        scaling = cfg.get("rope_parameters") or cfg.get("rope_scaling")
        theta = float(cfg.get("rope_theta", (scaling or {}).get("rope_theta", 10000.0)))
        partial = float(cfg.get("partial_rotary_factor", (scaling or {}).get("partial_rotary_factor", 1.0)))
        factors = None
        if scaling:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind == "llama3":
                factors = _llama3_freq_factors(scaling, int(head_dim * partial), theta)
            elif kind not in (None, "default"):
                raise UnsupportedModelError(f"{source}: rope_scaling type {kind!r} is not supported")
        layer_types: tuple[str, ...] = ()
        if family.linear_projections is not None:
            interval = int(cfg.get("full_attention_interval", 4))
            layer_types = tuple(
                cfg.get("layer_types")
                or [
                    FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers)
                ]
            )
        moe = {}
        if family.moe:
            moe = dict(
                num_experts=int(cfg["num_experts"] if "num_experts" in cfg else cfg["num_local_experts"]),
                num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size", 0))
                if family.shared_expert
                else 0,
                norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                decoder_sparse_step=int(cfg.get("decoder_sparse_step", 1)),
                mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
            )
        linear = {}
        if LINEAR_ATTENTION in layer_types:
            linear = {
                name: int(cfg[name])
                for name in (
                    "linear_num_key_heads",
                    "linear_num_value_heads",
                    "linear_key_head_dim",
                    "linear_value_head_dim",
                    "linear_conv_kernel_dim",
                )
            }
        return TargetConfig(
            family=family.name,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg.get("intermediate_size") or 0),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            rope_theta=theta,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", family.attention_bias)),
            qk_norm=family.qk_norm,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            rope_freq_factors=factors,
            bos_token_id=None if cfg.get("bos_token_id") is None else int(cfg["bos_token_id"]),
            eos_token_ids=_as_id_tuple(cfg.get("eos_token_id")),
            layer_types=layer_types,
            attn_output_gate=family.attn_output_gate,
            partial_rotary_factor=partial,
            norm_unit_offset=family.norm_unit_offset,
            **linear,
            **moe,
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
    arch, readers = metadata.get("general.architecture"), families.by_gguf_architecture()
    if arch not in readers:
        raise UnsupportedModelError(
            f"{source}: general.architecture {arch!r} is not supported; supported: {sorted(readers)}"
        )

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
        family=readers[arch].name,
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
