"""The caches of a run as grain sources: either format, validated against the config and the target."""

from __future__ import annotations

from typing import Any

from dspark_jax.cache import CacheDataSource
from dspark_jax.cache.format import open_kvstore, read_json
from dspark_jax.data.pipeline import PipelineConfig
from dspark_jax.interop.deepspec_cache import DeepSpecDataSource, is_deepspec
from dspark_jax.run import target_side


def open_cache(
    path: str, *, expect: dict[str, Any] | None = None, allow_incomplete: bool = False
) -> CacheDataSource | DeepSpecDataSource:
    """Open a cache of either format (detected from its manifest) as a grain data source."""
    manifest = read_json(open_kvstore(path), "manifest.json")
    if manifest is not None and is_deepspec(manifest):
        return DeepSpecDataSource(path, expect=expect)
    return CacheDataSource(path, expect=expect, allow_incomplete=allow_incomplete)


def open_source(path: str, config, side: target_side.TargetSide) -> CacheDataSource | DeepSpecDataSource:
    """A cache (either format) as a grain source, validated against the config and the target."""
    expect = {
        "aux_layer_ids": tuple(config.data.aux_layer_ids),
        "hidden_size": side.config.hidden_size,
        "tokenizer_fingerprint": side.tokenizer_fingerprint,
        "target_fingerprint": side.fingerprint,
    }
    return open_cache(path, expect=expect)


def pipeline_config(
    config, side: target_side.TargetSide, *, batch_size: int, seed: int, num_epochs: int | None
) -> PipelineConfig:
    return PipelineConfig(
        max_length=config.data.max_length,
        num_anchors=config.train.num_anchors,
        batch_size=batch_size,
        seed=seed,
        pad_id=side.pad_id,
        num_epochs=num_epochs,
        worker_count=config.data.worker_count,
        pack=config.data.get("pack", False),  # absent from configs stored before it
    )
