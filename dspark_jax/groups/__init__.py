"""Experiment groups: the registry (`registry.Experiment`) and one module or package per group.

Importing this package registers every group; training, evaluation, decoding, the suite and the
benchmarks ask `get(config.experiment)` for a group's pieces and never name one.
"""

# Registering: each group module calls `register` once at import.
from dspark_jax.groups import baseline
from dspark_jax.groups.engram import group as engram_group
from dspark_jax.groups.memory import group as memory_group
from dspark_jax.groups.registry import (
    DecodeOption,
    Design,
    Experiment,
    Model,
    Report,
    Run,
    decode_options,
    find,
    get,
    names,
    register,
    registered,
)
from dspark_jax.groups.reranker import group as reranker_group

__all__ = [
    "DecodeOption",
    "Design",
    "Experiment",
    "Model",
    "Report",
    "Run",
    "baseline",
    "decode_options",
    "engram_group",
    "find",
    "get",
    "memory_group",
    "names",
    "register",
    "registered",
    "reranker_group",
]
