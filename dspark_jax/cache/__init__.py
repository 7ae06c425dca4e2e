"""Offline store of target hidden states the draft trains on (see DESIGN.md, "Cache").

Native format (tensorstore zarr3 + manifest, resumable multi-process writer) in
``format``/``writer``/``reader``; the public DeepSpec v2 format in ``deepspec``.
"""

from __future__ import annotations

from typing import Any

from dspark_jax.cache.deepspec import DeepSpecDataSource, is_deepspec, write_deepspec_cache
from dspark_jax.cache.format import CacheSpec, estimate_bytes, open_kvstore, read_json, read_manifest
from dspark_jax.cache.reader import CacheCorruptError, CacheDataSource, verify
from dspark_jax.cache.writer import CacheLayout, ShardWriter, create_or_open, finalize, read_progress


def open_cache(
    path: str, *, expect: dict[str, Any] | None = None, allow_incomplete: bool = False
) -> CacheDataSource | DeepSpecDataSource:
    """Open a cache of either format (detected from its manifest) as a grain data source."""
    manifest = read_json(open_kvstore(path), "manifest.json")
    if manifest is not None and is_deepspec(manifest):
        return DeepSpecDataSource(path, expect=expect)
    return CacheDataSource(path, expect=expect, allow_incomplete=allow_incomplete)


__all__ = [
    "CacheCorruptError",
    "CacheDataSource",
    "CacheLayout",
    "CacheSpec",
    "DeepSpecDataSource",
    "ShardWriter",
    "create_or_open",
    "estimate_bytes",
    "finalize",
    "open_cache",
    "read_manifest",
    "read_progress",
    "verify",
    "write_deepspec_cache",
]
