"""Target families: the registry (`registry.Family` records in `FAMILIES`) and one module per family, or per
set of sibling families that share everything else.

Importing this package registers every family below; the config readers, the checkpoint readers and the
loader look families up here and never name one. A new family is one module that calls `register`,
imported below.
"""

# Registering: each family module calls `register` at import.
from dspark_jax.target.families import llama, qwen, qwen3_5, qwen3_next
from dspark_jax.target.families.registry import (
    FAMILIES,
    LINEAR_PARTS,
    Family,
    LinearProjections,
    by_gguf_architecture,
    by_model_type,
    names,
    register,
)

__all__ = [
    "FAMILIES",
    "LINEAR_PARTS",
    "Family",
    "LinearProjections",
    "by_gguf_architecture",
    "by_model_type",
    "llama",
    "names",
    "qwen",
    "qwen3_5",
    "qwen3_next",
    "register",
]
