"""A run's caches: what determines each split's content, resolved from the run config into the cache
builder's `SplitSpec`, and where its replies and cache live (`SplitFiles`).

Every setting that determines a split's content is hashed into its paths' keys, so a changed setting builds
a new cache instead of reusing a stale one: `{split}_replies-{key}.jsonl` (the regeneration's settings),
`{split}_cache-{key}` (states) or `{split}_tokens-{key}` (token rows, `data.features = "online"`), under
`cache_root / <target fingerprint[:12]>`.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from jax.sharding import Mesh

from dspark_jax.cache.build import (
    SplitFiles,
    SplitSpec,
    cache_root,
    join_path,
    local_cache_root,
    prepare_split,
)
from dspark_jax.data.conversations import GSM8K_VAL256
from dspark_jax.run import config_lib
from dspark_jax.run.config_lib import reads_states
from dspark_jax.target import Target

# Regeneration's chunk size before `data.regen_chunk_size` existed: what stored configs without the key ran
# with, and the size that keeps the replies' and caches' names as they were.
LEGACY_REGEN_CHUNK_SIZE = 64


def regen_chunk_size(data) -> int:
    """A config `data` section's regeneration chunk size (`LEGACY_REGEN_CHUNK_SIZE` for one without it)."""
    return data.get("regen_chunk_size", LEGACY_REGEN_CHUNK_SIZE)


def split_spec(config, split: str) -> SplitSpec:
    """What determines split `split`'s ('train' or 'val') cache in a run of `config`."""
    d = config.data
    return SplitSpec(
        split=split,
        source=d.train_source if split == "train" else (d.val_source or str(GSM8K_VAL256)),
        limit=(d.train_limit if split == "train" else d.val_limit) or None,
        max_turns=d.regen_max_turns,
        regenerate=d.regenerate,
        max_new_tokens=d.regen_max_new_tokens,
        max_prompt_tokens=d.regen_max_prompt_tokens,
        batch_size=d.regen_batch_size,
        chunk_size=regen_chunk_size(d),
        seed=config.seed,
        max_length=d.max_length,
        aux_layer_ids=tuple(d.aux_layer_ids),
        num_shards=d.num_shards,
        states=reads_states(config),
    )


def root(config) -> str:
    """Where a run's regenerated replies and caches live (`data.cache_dir`, or this host's default)."""
    return cache_root(config.data.cache_dir, config.preset)


def regen_settings(config, split: str) -> dict[str, Any]:
    """Every setting that determines a split's regenerated replies (besides the target)."""
    d = config.data
    return (
        {
            "split": split,
            "source": d.train_source if split == "train" else (d.val_source or str(GSM8K_VAL256.name)),
            "limit": d.train_limit if split == "train" else d.val_limit,
            "max_new_tokens": d.regen_max_new_tokens,
            "max_prompt_tokens": d.regen_max_prompt_tokens,
            "max_turns": d.regen_max_turns,
            "batch_size": d.regen_batch_size,
            "seed": config.seed,
            "target_dtypes": [config.target.param_dtype, config.target.dtype],
        }
        | ({} if d.regenerate else {"regenerate": False})
        | ({} if regen_chunk_size(d) == LEGACY_REGEN_CHUNK_SIZE else {"chunk_size": regen_chunk_size(d)})
    )


def cache_settings(config, split: str) -> dict[str, Any]:
    """Every setting that determines a split's cache content (besides the target).

    A token-row cache (`data.features = "online"`) does not depend on the aux layers and says
    `"states": False`; a cache of states has the keys it always had, so its key is unchanged.
    """
    d = config.data
    layers = {"aux_layer_ids": list(d.aux_layer_ids)} if reads_states(config) else {"states": False}
    return {**regen_settings(config, split), "max_length": d.max_length, **layers, "num_shards": d.num_shards}


def settings_key(settings: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:10]


def cache_path(config, target_fingerprint: str, split: str) -> str:
    """The cache of one split ('train' or 'val') for a config and target."""
    key = settings_key(cache_settings(config, split))
    kind = "cache" if reads_states(config) else "tokens"
    return join_path(root(config), target_fingerprint[:12], f"{split}_{kind}-{key}")


def replies_path(config, target_fingerprint: str, split: str) -> str:
    """The regenerated replies (JSONL) of one split for a config and target, keyed like `cache_path`."""
    key = settings_key(regen_settings(config, split))
    return join_path(root(config), target_fingerprint[:12], f"{split}_replies-{key}.jsonl")


def split_files(config, target_fingerprint: str, split: str) -> SplitFiles:
    """Where a split's replies and cache live, for a run of `config` on the target of that fingerprint."""
    return SplitFiles(
        cache=cache_path(config, target_fingerprint, split),
        replies=replies_path(config, target_fingerprint, split),
        local_root=local_cache_root(config.preset),
    )


def prepare(config, split: str, target: Target, mesh: Mesh, **options) -> dict:
    """`cache.build.prepare_split` for split `split` of a run of `config` (replies, then the cache), with
    the target placed on `mesh` by the run's sharding rules; `options` are prepare_split's keywords."""
    spec, files = split_spec(config, split), split_files(config, target.fingerprint, split)
    return prepare_split(spec, files, target, mesh, config_lib.sharding_rules(config), **options)
