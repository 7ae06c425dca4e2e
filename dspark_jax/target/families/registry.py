"""The one table of target families, `FAMILIES`; each family module adds its records with `register`."""

from __future__ import annotations

import dataclasses

# A Gated DeltaNet layer's input projections: queries, keys, values, output gate, decay inputs b and a.
LINEAR_PARTS = ("q", "k", "v", "z", "b", "a")


@dataclasses.dataclass(frozen=True)
class LinearProjections:
    """How a checkpoint stores a Gated DeltaNet layer's input projections (`LINEAR_PARTS`).

    Attributes:
      tensors: `(name, parts)` for each tensor `linear_attn.<name>.weight`, whose rows are the parts' rows in
        this order.
      per_key_head: a tensor's rows run key head by key head (head 0's share of each of its parts, then head
        1's, ...) rather than part by part.
    """

    tensors: tuple[tuple[str, tuple[str, ...]], ...]
    per_key_head: bool = False

    def __post_init__(self):
        stored = [part for _, parts in self.tensors for part in parts]
        if sorted(stored) != sorted(LINEAR_PARTS):
            raise ValueError(
                f"LinearProjections.tensors hold parts {stored}; expected each of {LINEAR_PARTS} once"
            )


@dataclasses.dataclass(frozen=True)
class Family:
    """Everything that differs between target families: the config readers, the checkpoint readers and the
    loader ask this record and never a family's name.

    Attributes:
      name: `TargetConfig.family`.
      model_types: the Hugging Face `config.json` `model_type` values read as this family.
      gguf_architectures: the GGUF `general.architecture` values read as this family (none: not from GGUF).
      gguf_qk_permuted: llama.cpp's converter reorders the q/k projection rows for its interleaved RoPE.
      attention_bias: whether q/k/v projections carry a bias when `config.json` does not say.
      qk_norm: per-head RMSNorm on queries and keys.
      linear_projections: the layers are hybrid (`layer_types`, or every `full_attention_interval`-th layer
        full attention, the rest Gated DeltaNet stored this way); None: every layer is full attention.
      attn_output_gate / norm_unit_offset: the `TargetConfig` fields of those names.
      moe: `config.json` describes a sparse MLP (`num_experts`, `num_experts_per_tok`, ...).
      shared_expert: the sparse MLP has a gated shared expert (`shared_expert_intermediate_size`).
    """

    name: str
    model_types: tuple[str, ...]
    gguf_architectures: tuple[str, ...] = ()
    gguf_qk_permuted: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    linear_projections: LinearProjections | None = None
    attn_output_gate: bool = False
    norm_unit_offset: bool = False
    moe: bool = False
    shared_expert: bool = False


FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Adds a family; its name, model types and GGUF architectures must be new."""
    if family.name in FAMILIES:
        raise ValueError(f"target family {family.name!r} is already registered")
    taken = sorted(set(family.model_types) & set(by_model_type())) + sorted(
        set(family.gguf_architectures) & set(by_gguf_architecture())
    )
    if taken:
        raise ValueError(f"target family {family.name!r}: {taken} already name a registered family")
    FAMILIES[family.name] = family
    return family


def names() -> list[str]:
    return sorted(FAMILIES)


def by_model_type() -> dict[str, Family]:
    """`{config.json model_type: family}` over every registered family."""
    return {model_type: family for family in FAMILIES.values() for model_type in family.model_types}


def by_gguf_architecture() -> dict[str, Family]:
    """`{GGUF general.architecture: family}` over every registered family."""
    return {arch: family for family in FAMILIES.values() for arch in family.gguf_architectures}
