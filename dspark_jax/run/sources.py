"""The caches of a run as grain sources: either format, validated against the config and the target."""

from __future__ import annotations

from typing import Any

from dspark_jax.cache import CacheDataSource
from dspark_jax.cache.format import open_kvstore, read_json
from dspark_jax.data.pipeline import PipelineConfig
from dspark_jax.interop.deepspec_cache import DeepSpecDataSource, is_deepspec
from dspark_jax.run import config_lib, target_side


def open_cache(
    path: str,
    *,
    expect: dict[str, Any] | None = None,
    allow_incomplete: bool = False,
    read_states: bool = True,
) -> CacheDataSource | DeepSpecDataSource:
    """Open a cache of either format (detected from its manifest) as a grain data source.

    `read_states=False` reads the token rows only (input_ids, loss_mask), whatever the cache holds.
    """
    manifest = read_json(open_kvstore(path), "manifest.json")
    if manifest is not None and is_deepspec(manifest):
        return DeepSpecDataSource(path, expect=expect, read_states=read_states)
    return CacheDataSource(path, expect=expect, allow_incomplete=allow_incomplete, read_states=read_states)


def open_source(path: str, config, side: target_side.TargetSide) -> CacheDataSource | DeepSpecDataSource:
    """A cache (either format) as a grain source, validated against the config and the target.

    An offline run (`data.features = "offline"`) needs a cache of the target's states for its aux layers.
    An online run reads the token rows of any cache of this target: a token-row cache, or a cache of states
    whose states it leaves unread (the step computes them).
    """
    expect = {
        "hidden_size": side.config.hidden_size,
        "tokenizer_fingerprint": side.tokenizer_fingerprint,
        "target_fingerprint": side.fingerprint,
    }
    if not config_lib.reads_states(config):
        return open_cache(path, expect=expect, read_states=False)
    source = open_cache(path, expect=expect)
    if not source.has_states:
        raise ValueError(
            f"cache {path!r} holds token rows only (no target states), which an offline run cannot train "
            "on: train with --config.data.features=online, or build the states cache with "
            "data.features=offline"
        )
    source.check_expect({"aux_layer_ids": tuple(config.data.aux_layer_ids)})
    return source


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
        states=config_lib.reads_states(config),
    )
