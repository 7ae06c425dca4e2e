"""Building a cache from conversations: tokenise with the chat template, run the target, write shards.

Every conversation becomes one sample: `input_ids` and the response-only `loss_mask` from
`tokenize_conversation`, truncated to `max_length` (counted), then the target's aux layer
outputs and post-norm final state. A token-row cache (`data.features = "online"`: the training step
runs the target itself) stops before the target forward and holds the ids and masks only, under
`{split}_tokens-{key}` instead of `{split}_cache-{key}`. A conversation that does not become a
sample is counted under its reason (`DROP_REASONS`): regeneration skipped it (its first prompt is
longer than `data.regen_max_prompt_tokens`), or it cannot be tokenised (no assistant reply), or too
few response tokens are left within `max_length`. A process builds the shards `process_index,
process_index + process_count, ...`; a killed build resumes from each shard's last commit.

Cache and replies paths may be URLs (`gs://bucket/prefix`): they are joined with '/' and never
pass through `pathlib`, which would turn `gs://b` into `gs:/b`.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from jax.sharding import Mesh
from tqdm import tqdm

from dspark_jax import sharding
from dspark_jax.cache.features import FeatureExtractor
from dspark_jax.cache.format import CacheSpec, estimate_bytes
from dspark_jax.cache.lock import exclusive, lock_file
from dspark_jax.cache.writer import ShardWriter, create_or_open, finalize, read_progress
from dspark_jax.data.conversations import Conversation, Message, first_turns, load_conversations
from dspark_jax.data.regenerate import (
    NO_USER_TURN,
    PROMPT_TOO_LONG,
    is_url,
    read_output,
    regenerate,
    skip_reason,
)
from dspark_jax.target import Target
from dspark_jax.target.chat import ChatTemplate, prompt_ids, tokenize_conversation
from dspark_jax.target.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Why a conversation did not become a sample: regeneration skipped it (see
# `dspark_jax.data.regenerate.skip_reason`), or `tokenize_all` dropped it.
NO_ASSISTANT_REPLY = "no_assistant_reply"
NOT_TOKENIZABLE = "not_tokenizable"
FEWER_THAN_2_RESPONSE_TOKENS = "fewer_than_2_response_tokens"
DROP_REASONS = (
    PROMPT_TOO_LONG,
    NO_USER_TURN,
    NO_ASSISTANT_REPLY,
    NOT_TOKENIZABLE,
    FEWER_THAN_2_RESPONSE_TOKENS,
)


@dataclasses.dataclass(frozen=True)
class SplitSpec:
    """What determines one split's cache: its conversations, their regeneration and the samples' layout
    (`run.caches.split_spec` resolves it from a run config)."""

    split: str  # 'train' or 'val'
    source: str  # a source name, a conversation file or a blend (`data.conversations.load_conversations`)
    limit: int | None  # the first N usable conversations (None: all)
    max_turns: int  # user turns kept per conversation
    regenerate: bool  # the target rewrites every reply; else the source's replies are the text
    max_new_tokens: int  # regeneration: reply length cap per turn
    max_prompt_tokens: int  # regeneration: a conversation whose first prompt is longer is dropped
    batch_size: int  # regeneration: rows per compiled program
    chunk_size: int  # regeneration: conversations per durable write
    seed: int
    max_length: int  # tokens per sample; longer ones are cut (counted)
    aux_layer_ids: tuple[int, ...]
    num_shards: int
    states: bool  # the target's states (offline training), or the token rows alone (online)


@dataclasses.dataclass(frozen=True)
class SplitFiles:
    """Where one split's replies and cache live (local paths or URLs), and this host's directory for
    locks and regeneration's staging."""

    cache: str
    replies: str
    local_root: str


@dataclasses.dataclass(frozen=True)
class TokenizedSamples:
    """Token ids and loss masks of the samples a cache will hold, plus what was dropped or cut.

    skipped: conversations dropped, `dropped` by reason. truncated: samples cut to max_length.
    """

    input_ids: list[np.ndarray]
    loss_masks: list[np.ndarray]
    skipped: int
    truncated: int
    dropped: Mapping[str, int] = dataclasses.field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(len(ids) for ids in self.input_ids)


def tokenize_all(
    target: Target,
    conversations: Sequence[Sequence[Message]],
    max_length: int,
    indices: Sequence[int] | None = None,
) -> TokenizedSamples:
    """Tokenises conversations for the cache; unusable ones are logged (info) and counted by reason.

    `indices` name the conversations in the log (default: their positions).
    """
    ids_list, masks, truncated = [], [], 0
    dropped: collections.Counter[str] = collections.Counter()

    def drop(k: int, reason: str, detail: object) -> None:
        dropped[reason] += 1
        logger.debug("conversation %d dropped (%s): %s", k if indices is None else indices[k], reason, detail)

    for k, messages in enumerate(conversations):
        if not any(isinstance(m, Mapping) and m.get("role") == "assistant" for m in messages):
            drop(k, NO_ASSISTANT_REPLY, "no assistant message")
            continue
        try:
            ids, mask = tokenize_conversation(target.tokenizer, target.chat_template, messages)
        except ValueError as e:
            drop(k, NOT_TOKENIZABLE, e)
            continue
        if len(ids) > max_length:
            truncated += 1
            ids, mask = ids[:max_length], mask[:max_length]
        if mask.sum() < 2:
            drop(k, FEWER_THAN_2_RESPONSE_TOKENS, f"{int(mask.sum())} within max_length={max_length}")
            continue
        ids_list.append(ids)
        masks.append(mask)
    if truncated:
        logger.info("%d of %d samples truncated to max_length=%d", truncated, len(ids_list), max_length)
    return TokenizedSamples(ids_list, masks, dropped.total(), truncated, dict(dropped))


def count_dropped(records: Iterable[Mapping[str, Any]], samples: TokenizedSamples) -> dict[str, int]:
    """Conversations that did not become samples, by reason: every `DROP_REASONS` key, 0 included.

    `records` are the regeneration output lines (a skipped one has no `messages`); `samples` is
    `tokenize_all` of the others.
    """
    dropped = collections.Counter(skip_reason(r) for r in records if "messages" not in r)
    dropped.update(samples.dropped)
    return {
        reason: dropped[reason] for reason in (*DROP_REASONS, *sorted(dropped.keys() - set(DROP_REASONS)))
    }


def check_max_turns(max_turns: object) -> int:
    """`data.regen_max_turns`, validated: user turns kept per conversation, at least 1."""
    if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
        raise ValueError(f"data.regen_max_turns must be an integer >= 1 (user turns kept), got {max_turns!r}")
    return max_turns


def cut_turns(conversations: Iterable[Conversation], max_turns: int) -> list[Conversation]:
    """Each conversation cut before its `max_turns + 1`-th user turn (`data.regen_max_turns`)."""
    max_turns = check_max_turns(max_turns)
    return [first_turns(conversation, max_turns) for conversation in conversations]


def cache_spec(
    target: Target, aux_layer_ids: Sequence[int], num_shards: int, states: bool = True
) -> CacheSpec:
    """The cache identity for a target: its fingerprint and tokenizer, the aux layers and width.

    `states=False`: a token-row cache, which names no aux layers (`aux_layer_ids` is not recorded).
    """
    return CacheSpec(
        aux_layer_ids=tuple(aux_layer_ids) if states else (),
        hidden_size=target.config.hidden_size,
        num_shards=num_shards,
        target={"source": target.source, "fingerprint": target.fingerprint, "family": target.config.family},
        tokenizer_fingerprint=target.tokenizer.fingerprint(),
        states=states,
    )


def projected_bytes(samples: TokenizedSamples, spec: CacheSpec) -> int:
    return estimate_bytes(samples.num_tokens, spec, num_samples=len(samples.input_ids))


def projected_size(spec: SplitSpec, tokenizer: Tokenizer, template: ChatTemplate, hidden_size: int) -> dict:
    """What a split's cache will take, from its prompts alone (no target decoding, nothing written).

    An upper bound: each conversation kept (cut to `data.regen_max_turns` user turns; dropped when
    its first prompt is longer than `data.regen_max_prompt_tokens`, as regeneration drops it) counts
    its rendering with empty replies plus `data.regen_max_new_tokens` per reply, capped at
    `data.max_length`. A token-row spec (`states` False) counts the bytes of the token rows alone.
    """
    conversations = cut_turns(load_conversations(spec.source, limit=spec.limit).conversations, spec.max_turns)
    tokens = samples = too_long = 0
    for conversation in conversations:
        messages: list[Message] = [m for m in conversation if m["role"] == "system"]
        turns = [m for m in conversation if m["role"] == "user"]
        for turn in turns:
            messages += [turn, {"role": "assistant", "content": ""}]
        first = prompt_ids(tokenizer, template, [*messages[: len(messages) - 2 * len(turns)], turns[0]])
        if len(first) > spec.max_prompt_tokens:
            too_long += 1
            continue
        rendered, _ = tokenize_conversation(tokenizer, template, messages, require_response=False)
        tokens += min(len(rendered) + len(turns) * spec.max_new_tokens, spec.max_length)
        samples += 1
    layout = CacheSpec(
        spec.aux_layer_ids if spec.states else (), hidden_size, spec.num_shards, {}, "", states=spec.states
    )
    return {
        "split": spec.split,
        "states": spec.states,
        "conversations": len(conversations),
        "dropped": {PROMPT_TOO_LONG: too_long},
        "samples_at_most": samples,
        "tokens_at_most": tokens,
        "bytes_at_most": estimate_bytes(tokens, layout, num_samples=samples),
    }


def build_cache(
    path: str,
    target: Target | None,
    samples: TokenizedSamples,
    spec: CacheSpec,
    *,
    process_index: int = 0,
    process_count: int = 1,
    samples_per_commit: int = 64,
    tokens_per_batch: int = 8192,
    mesh: Mesh | None = None,
    rules: sharding.Rules = sharding.DEFAULT_RULES,
    progress: bool = True,
) -> dict | None:
    """Writes this process's shards of the cache at `path`; finalises it when every shard is done.

    `mesh` must be the mesh the target was placed on. A token-row spec (`spec.states` False) writes the
    ids and masks alone: no target forward, `target`, `mesh` and `tokens_per_batch` unused. Returns the
    final manifest when this call completed the cache, else None (other processes still have shards to
    write).
    """
    if not samples.input_ids:
        raise ValueError(f"no usable samples for cache {path} ({samples.skipped} skipped)")
    layout = create_or_open(path, spec, len(samples.input_ids))
    extractor = None
    if spec.states:
        extractor = FeatureExtractor(
            target.model, spec.aux_layer_ids, tokens_per_batch=tokens_per_batch, mesh=mesh, rules=rules
        )
    my_shards = range(process_index, spec.num_shards, process_count)
    total = sum(len(layout.shard_sample_range(s)) for s in my_shards)
    bar = tqdm(total=total, desc=f"cache {path}", unit="sample", disable=not progress)
    begin, tokens = time.perf_counter(), 0

    def advance(count: int, batch_tokens: int) -> None:
        """Progress after each target forward (token rows: each commit): samples done, tokens/s."""
        nonlocal tokens
        tokens += batch_tokens
        bar.set_postfix(tok_per_s=f"{tokens / (time.perf_counter() - begin):.0f}", refresh=False)
        bar.update(count)

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
            rows = [{"input_ids": samples.input_ids[i], "loss_mask": samples.loss_masks[i]} for i in indices]
            if extractor is None:
                advance(len(rows), sum(len(row["input_ids"]) for row in rows))
            else:
                features = extractor([row["input_ids"] for row in rows], on_batch=advance)
                for row, (aux, last) in zip(rows, features):
                    row.update(aux_hidden=aux, last_hidden=last)
            writer.append(rows)
        writer.finalize_shard()
    bar.close()
    complete = all((read_progress(path, s) or {}).get("complete") for s in range(spec.num_shards))
    return finalize(path) if complete else None


def join_path(root: str, *parts: str) -> str:
    """`root` (a local path or a URL) joined with relative parts; a URL keeps its `scheme://`."""
    if not is_url(root):
        return str(Path(root, *parts))
    head = root if root.endswith("://") else root.rstrip("/") + "/"
    return head + "/".join(parts)


def local_cache_root(preset: str) -> str:
    """This host's root of a preset's caches: `$DSPARK_JAX_CACHE` or ~/.cache/dspark_jax, then the preset."""
    base = os.environ.get("DSPARK_JAX_CACHE") or Path.home() / ".cache" / "dspark_jax"
    return str(Path(base) / preset)


def cache_root(cache_dir: str, preset: str) -> str:
    """Where a preset's regenerated replies and caches live: `cache_dir` (a local path or a URL such as
    `gs://bucket/prefix`, kept as given), or `local_cache_root` when it is empty."""
    if not cache_dir:
        return local_cache_root(preset)
    return cache_dir if is_url(cache_dir) else str(Path(cache_dir))


def prepare_split(
    spec: SplitSpec,
    files: SplitFiles,
    target: Target,
    mesh: Mesh,
    rules: sharding.Rules = sharding.DEFAULT_RULES,
    *,
    build: bool = True,
    process_index: int = 0,
    process_count: int = 1,
) -> dict:
    """Regenerates a split's replies with the target and builds its cache; resumes whatever exists.

    The cache holds the target's states, or for a token-row spec (`states` False) the token rows alone
    (no target forward after regeneration; same replies file). Conversations are cut to their first
    `spec.max_turns` user turns before regeneration. `mesh` is the mesh the target was placed on, `rules`
    its logical-axis rules.
    Returns a report: cache path, counts, projected bytes, and the manifest when complete. With
    `build=False` it stops after regenerating and tokenising (no target forward, no cache written).
    `conversations` (read from the source; `source_skipped` are the records the source loader
    rejected, by reason) = `samples` + `dropped_total`, and `dropped` names every reason.
    """
    split, path, replies = spec.split, files.cache, files.replies
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    max_turns = check_max_turns(spec.max_turns)  # before the (possibly slow) source is read
    locks = Path(files.local_root, "locks")
    loaded = load_conversations(spec.source, limit=spec.limit)
    conversations = cut_turns(loaded.conversations, max_turns)
    # One regenerating process per replies file, one builder per set of shards.
    if spec.regenerate:
        with exclusive(lock_file(replies, "replies", locks), f"{split} replies {replies}"):
            regenerate(
                target,
                conversations,
                replies,
                max_new_tokens=spec.max_new_tokens,
                seed=spec.seed,
                batch_size=spec.batch_size,
                chunk_size=spec.chunk_size,
                max_prompt_tokens=spec.max_prompt_tokens,
                mesh=mesh,
                rules=rules,
                staging_dir=Path(files.local_root, "staging"),
            )
    builder = f"{split}-p{process_index}of{process_count}"
    with exclusive(lock_file(path, builder, locks), f"{split} cache {path} (builder {builder})"):
        # Without regeneration the source's own replies are the text; the teacher is still the target's
        # distribution at every position (its states over that text).
        records = (
            read_output(replies)
            if spec.regenerate
            else [{"index": i, "messages": c} for i, c in enumerate(conversations)]
        )
        if len(records) != len(conversations):
            raise ValueError(f"{replies}: {len(records)} lines for {len(conversations)} conversations")
        kept = [r for r in records if "messages" in r]
        samples = tokenize_all(
            target, [r["messages"] for r in kept], spec.max_length, [r["index"] for r in kept]
        )
        dropped = count_dropped(records, samples)
        if sum(dropped.values()):
            logger.info(
                "%s: %d of %d conversations dropped: %s",
                split,
                sum(dropped.values()),
                len(conversations),
                {reason: n for reason, n in dropped.items() if n},
            )
        layout = cache_spec(target, spec.aux_layer_ids, spec.num_shards, states=spec.states)
        report = {
            "split": split,
            "cache": path,
            "states": spec.states,
            "replies": replies if spec.regenerate else None,
            "conversations": len(conversations),
            "source_skipped": dict(loaded.skipped),
            "cut_to_max_turns": sum(len(a) != len(b) for a, b in zip(loaded.conversations, conversations)),
            "regen_truncated": sum("truncated" in r for r in records),
            "samples": len(samples.input_ids),
            "tokens": samples.num_tokens,
            "dropped": dropped,
            "dropped_total": sum(dropped.values()),
            "truncated": samples.truncated,
            "projected_bytes": projected_bytes(samples, layout),
        }
        if build:
            report["manifest_complete"] = (
                build_cache(
                    path,
                    target,
                    samples,
                    layout,
                    process_index=process_index,
                    process_count=process_count,
                    mesh=mesh,
                    rules=rules,
                )
                is not None
            )
        return report
