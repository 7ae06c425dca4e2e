"""Experiment groups (the seed's seven), each registered once in `registry`; see `registry.Experiment`."""

from dspark_jax.experiments import baseline, engram, memory, reranker
from dspark_jax.experiments.registry import Experiment, get, names, register

__all__ = ["Experiment", "baseline", "engram", "get", "memory", "names", "register", "reranker"]
