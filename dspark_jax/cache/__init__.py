"""Offline store of target hidden states the draft trains on (docs/design.md, "Cache"), or of the token
rows alone (`CacheSpec.states = False`) for online training, which computes the states in the step.

Native format (tensorstore zarr3 + manifest, resumable multi-process writer) in
``format``/``writer``/``reader``; the public DeepSpec v2 format is in ``dspark_jax.interop``, and
``dspark_jax.run.sources.open_cache`` opens either.
"""

from __future__ import annotations

from dspark_jax.cache.format import CacheSpec, estimate_bytes, read_manifest
from dspark_jax.cache.reader import CacheCorruptError, CacheDataSource, verify
from dspark_jax.cache.writer import CacheLayout, ShardWriter, create_or_open, finalize, read_progress

__all__ = [
    "CacheCorruptError",
    "CacheDataSource",
    "CacheLayout",
    "CacheSpec",
    "ShardWriter",
    "create_or_open",
    "estimate_bytes",
    "finalize",
    "read_manifest",
    "read_progress",
    "verify",
]
