"""Building a cache from conversations: tokenise with the chat template, run the target, write shards.

Every conversation becomes one sample: `input_ids` and the response-only `loss_mask` from
`tokenize_conversation`, truncated to `max_length` (counted), then the target's aux layer
outputs and post-norm final state. Conversations that cannot be tokenised (no assistant
reply) are counted skips. A process builds the shards `process_index, process_index +
process_count, ...`; a killed build resumes from each shard's last commit.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from jax.sharding import Mesh
from tqdm import tqdm

from dspark_jax.cache.features import FeatureExtractor
from dspark_jax.cache.format import CacheSpec, estimate_bytes
from dspark_jax.cache.writer import ShardWriter, create_or_open, finalize, read_progress
from dspark_jax.data.conversations import GSM8K_VAL256, Message, load_conversations
from dspark_jax.data.regenerate import regenerate
from dspark_jax.target import Target
from dspark_jax.target.chat import tokenize_conversation

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TokenizedSamples:
    """Token ids and loss masks of the samples a cache will hold, plus what was dropped or cut."""

    input_ids: list[np.ndarray]
    loss_masks: list[np.ndarray]
    skipped: int
    truncated: int

    @property
    def num_tokens(self) -> int:
        return sum(len(ids) for ids in self.input_ids)


def tokenize_all(
    target: Target, conversations: Sequence[Sequence[Message]], max_length: int
) -> TokenizedSamples:
    """Tokenises conversations for the cache; unusable ones are logged, counted skips."""
    ids_list, masks, skipped, truncated = [], [], 0, 0
    for index, messages in enumerate(conversations):
        try:
            ids, mask = tokenize_conversation(target.tokenizer, target.chat_template, messages)
        except ValueError as e:
            logger.warning("conversation %d skipped: %s", index, e)
            skipped += 1
            continue
        if len(ids) > max_length:
            truncated += 1
            ids, mask = ids[:max_length], mask[:max_length]
        if mask.sum() < 2:
            logger.warning("conversation %d skipped: fewer than 2 response tokens within max_length", index)
            skipped += 1
            continue
        ids_list.append(ids)
        masks.append(mask)
    if truncated:
        logger.info("%d of %d samples truncated to max_length=%d", truncated, len(ids_list), max_length)
    return TokenizedSamples(ids_list, masks, skipped, truncated)


def cache_spec(target: Target, aux_layer_ids: Sequence[int], num_shards: int) -> CacheSpec:
    """The cache identity for a target: its fingerprint and tokenizer, the aux layers and width."""
    return CacheSpec(
        aux_layer_ids=tuple(aux_layer_ids),
        hidden_size=target.config.hidden_size,
        num_shards=num_shards,
        target={"source": target.source, "fingerprint": target.fingerprint, "family": target.config.family},
        tokenizer_fingerprint=target.tokenizer.fingerprint(),
    )


def projected_bytes(samples: TokenizedSamples, spec: CacheSpec) -> int:
    return estimate_bytes(samples.num_tokens, spec, num_samples=len(samples.input_ids))


def build_cache(
    path: str,
    target: Target,
    samples: TokenizedSamples,
    spec: CacheSpec,
    *,
    process_index: int = 0,
    process_count: int = 1,
    samples_per_commit: int = 64,
    tokens_per_batch: int = 8192,
    mesh: Mesh | None = None,
    progress: bool = True,
) -> dict | None:
    """Writes this process's shards of the cache at `path`; finalises it when every shard is done.

    `mesh` must be the mesh the target was placed on. Returns the final manifest when this
    call completed the cache, else None (other processes still have shards to write).
    """
    if not samples.input_ids:
        raise ValueError(f"no usable samples for cache {path} ({samples.skipped} skipped)")
    layout = create_or_open(path, spec, len(samples.input_ids))
    extractor = FeatureExtractor(
        target.model, spec.aux_layer_ids, tokens_per_batch=tokens_per_batch, mesh=mesh
    )
    my_shards = range(process_index, spec.num_shards, process_count)
    total = sum(len(layout.shard_sample_range(s)) for s in my_shards)
    bar = tqdm(total=total, desc=f"cache {path}", unit="sample", disable=not progress)
    begin, tokens = time.perf_counter(), 0
    for shard in my_shards:
        record = read_progress(path, shard)
        if record is not None and record.get("complete"):
            bar.update(len(layout.shard_sample_range(shard)))
            continue
        writer = ShardWriter(path, shard)
        todo = range(writer.start_sample, layout.shard_sample_range(shard).stop)
        bar.update(writer.start_sample - layout.shard_sample_range(shard).start)
        for start in range(todo.start, todo.stop, samples_per_commit):
            indices = range(start, min(start + samples_per_commit, todo.stop))
            features = extractor([samples.input_ids[i] for i in indices])
            writer.append(
                [
                    {
                        "input_ids": samples.input_ids[i],
                        "loss_mask": samples.loss_masks[i],
                        "aux_hidden": aux,
                        "last_hidden": last,
                    }
                    for i, (aux, last) in zip(indices, features)
                ]
            )
            tokens += sum(len(samples.input_ids[i]) for i in indices)
            bar.update(len(indices))
            bar.set_postfix(tok_per_s=f"{tokens / (time.perf_counter() - begin):.0f}")
        writer.finalize_shard()
    bar.close()
    complete = all((read_progress(path, s) or {}).get("complete") for s in range(spec.num_shards))
    return finalize(path) if complete else None


def cache_root(config) -> Path:
    """Where a config's regenerated replies and caches live (see `data.cache_dir` in configs/base.py)."""
    if config.data.cache_dir:
        return Path(config.data.cache_dir)
    base = os.environ.get("DSPARK_JAX_CACHE") or Path.home() / ".cache" / "dspark_jax"
    return Path(base) / config.preset


def cache_path(config, target_fingerprint: str, split: str) -> str:
    """The cache of one split ('train' or 'val') for a config and target."""
    return str(cache_root(config) / target_fingerprint[:12] / f"{split}_cache")


def prepare_split(
    config,
    split: str,
    target: Target,
    mesh: Mesh,
    *,
    dry_run: bool = False,
    process_index: int = 0,
    process_count: int = 1,
) -> dict:
    """Regenerates a split's replies with the target and builds its cache; resumes whatever exists.

    Returns a report: cache path, counts, projected bytes, and the manifest when complete.
    """
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    data = config.data
    source = data.train_source if split == "train" else (data.val_source or str(GSM8K_VAL256))
    limit = (data.train_limit if split == "train" else data.val_limit) or None
    root = cache_root(config) / target.fingerprint[:12]
    loaded = load_conversations(source, limit=limit)
    replies = root / f"{split}_replies.jsonl"
    regenerate(
        target,
        loaded.conversations,
        replies,
        max_new_tokens=data.regen_max_new_tokens,
        seed=config.seed,
        batch_size=data.regen_batch_size,
        max_prompt_tokens=data.regen_max_prompt_tokens,
        mesh=mesh,
    )
    records = [json.loads(line) for line in replies.read_text(encoding="utf-8").splitlines()]
    conversations = [r["messages"] for r in records if "messages" in r]
    samples = tokenize_all(target, conversations, data.max_length)
    spec = cache_spec(target, data.aux_layer_ids, data.num_shards)
    path = cache_path(config, target.fingerprint, split)
    report = {
        "split": split,
        "cache": path,
        "conversations": len(loaded.conversations),
        "samples": len(samples.input_ids),
        "tokens": samples.num_tokens,
        "skipped": samples.skipped,
        "truncated": samples.truncated,
        "projected_bytes": projected_bytes(samples, spec),
    }
    if not dry_run:
        report["manifest_complete"] = (
            build_cache(
                path,
                target,
                samples,
                spec,
                process_index=process_index,
                process_count=process_count,
                mesh=mesh,
            )
            is not None
        )
    return report
