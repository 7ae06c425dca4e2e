"""An Engram run's table from its config: where it lives, the leakage guard, load or fit.

Config keys (the `engram` section, configs/engram_*.py):
  engram.table_path        a fitted table (safetensors); '' = <cache root>/<target>/engram-<key>.safetensors
                           keyed on every setting below; a missing table is fitted first.
  engram.max_order         the largest n-gram order N (orders 2..N).
  engram.heads             hash heads per order.
  engram.head_dim          row width of one head (features: (N-1) x heads x head_dim).
  engram.seed, engram.layer_id   the multipliers' seed `seed + 10007 * layer_id` (DeepSeek's convention).
  engram.table_multiplier  rows per order = multiplier x the target vocabulary (split over the heads, primes).
  engram.fit_source        conversations to fit on ('sharegpt' or a file); '' = none (a table must exist).
  engram.fit_offset        first conversation of the fit (after the ones training uses).
  engram.fit_limit         conversations fitted on.
  engram.fit_max_length    tokens per fitted conversation (longer ones are cut).
  engram.projection_seed   seed of the fixed per-head projections of `S[t]`.

The fit must not see the draft's training or validation text, or the features carry the target
state the draft is asked to predict: `check_config` refuses overlapping index ranges of one source
before anything runs, and `fit_conversations` drops any fit conversation whose user turns occur among
the training or validation prompts.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from dspark_jax.cache.build import cache_root, join_path
from dspark_jax.data.conversations import GSM8K_VAL256, SHAREGPT, load_conversations, user_turns
from dspark_jax.errors import UsageError
from dspark_jax.groups.engram.fit import fit_rows
from dspark_jax.groups.engram.hashing import HashSpec, compression_map
from dspark_jax.groups.engram.table import HostTable, check_table, device_table, load_table, save_table
from dspark_jax.target.chat import tokenize_conversation

log = logging.getLogger(__name__)


def uses_engram(config) -> bool:
    return "engram" in config


def _same_source(a: str, b: str) -> bool:
    resolve = lambda s: s if s == SHAREGPT else str(Path(s).resolve())
    return resolve(a) == resolve(b)


def check_config(config) -> None:
    """Fails naming the key on Engram settings that cannot work: shapes, the draft's view of them, and a
    fit range that overlaps the training or validation conversations."""
    e = config.engram
    for key in ("max_order", "heads", "head_dim", "table_multiplier"):
        if e[key] < (2 if key == "max_order" else 1):
            raise UsageError(f"engram.{key}={e[key]} is too small")
    dim = (e.max_order - 1) * e.heads * e.head_dim
    if config.draft.engram_dim != dim or config.draft.engram_order != e.max_order:
        raise UsageError(
            f"draft.engram_dim={config.draft.engram_dim} / draft.engram_order={config.draft.engram_order} "
            f"disagree with the engram section ((max_order-1) x heads x head_dim = {dim}, N = {e.max_order})"
        )
    if not e.fit_source:
        return
    if e.fit_limit < 1 or e.fit_offset < 0:
        raise UsageError(
            f"engram.fit_limit={e.fit_limit} must be >= 1 and engram.fit_offset={e.fit_offset} >= 0"
        )
    d = config.data
    if _same_source(e.fit_source, d.train_source) and (d.train_limit == 0 or e.fit_offset < d.train_limit):
        trained = "all of it" if d.train_limit == 0 else f"conversations [0, {d.train_limit})"
        raise UsageError(
            f"engram.fit_offset={e.fit_offset} overlaps the training text ({trained} of "
            f"data.train_source={d.train_source!r}): the fit would leak the target states the draft learns "
            f"to predict; set engram.fit_offset >= {d.train_limit} or another engram.fit_source"
            if d.train_limit
            else f"engram.fit_source={e.fit_source!r} is the training source, which training uses whole "
            "(data.train_limit=0): the fit would leak the target states the draft learns to predict; fit on "
            "other conversations"
        )
    val_source = d.val_source or str(GSM8K_VAL256)
    if _same_source(e.fit_source, val_source):
        raise UsageError(
            f"engram.fit_source={e.fit_source!r} is the validation source: the fit would leak the "
            "validation text; fit on other conversations"
        )


def fit_settings(config, target_fingerprint: str, tokenizer_fingerprint: str) -> dict:
    """Everything a fitted table depends on."""
    e = config.engram
    return {
        "target": target_fingerprint,
        "tokenizer": tokenizer_fingerprint,
        **{k: e[k] for k in ("max_order", "heads", "head_dim", "seed", "layer_id", "table_multiplier")},
        **{k: e[k] for k in ("fit_source", "fit_offset", "fit_limit", "fit_max_length", "projection_seed")},
    }


def _key(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:10]


def table_path(config, target_fingerprint: str, tokenizer_fingerprint: str) -> str:
    """The config's table: `engram.table_path`, else the default keyed on the fit settings."""
    if config.engram.table_path:
        return config.engram.table_path
    key = _key(fit_settings(config, target_fingerprint, tokenizer_fingerprint))
    return join_path(
        cache_root(config.data.cache_dir, config.preset), target_fingerprint[:12], f"engram-{key}.safetensors"
    )


def expectations(config, tokenizer_fingerprint: str, vocab_size: int) -> dict:
    e = config.engram
    return {
        "tokenizer_fingerprint": tokenizer_fingerprint,
        "vocab_size": vocab_size,
        "max_order": e.max_order,
        "heads": e.heads,
        "head_dim": e.head_dim,
        "dim": config.draft.engram_dim,
    }


def _prompt_keys(source: str, limit: int) -> set[str]:
    return {
        json.dumps(turn)
        for c in load_conversations(source, limit=limit or None).conversations
        for turn in user_turns(c)[:1]
    }


def fit_conversations(config) -> list:
    """The fit's conversations: `[fit_offset, fit_offset + fit_limit)` of `fit_source`, minus any whose user
    turns occur among the training or validation prompts (counted in the log)."""
    e, d = config.engram, config.data
    loaded = load_conversations(e.fit_source, limit=e.fit_offset + e.fit_limit).conversations[e.fit_offset :]
    if not loaded:
        raise UsageError(
            f"engram.fit_source={e.fit_source!r} has no conversations past engram.fit_offset={e.fit_offset}"
        )
    seen = _prompt_keys(d.train_source, d.train_limit) | _prompt_keys(
        d.val_source or str(GSM8K_VAL256), d.val_limit
    )
    kept = [c for c in loaded if not any(json.dumps(t) in seen for t in user_turns(c))]
    if len(kept) < len(loaded):
        log.warning(
            "Engram fit: %d of %d conversations share a prompt with training or validation: left out",
            len(loaded) - len(kept),
            len(loaded),
        )
    return kept


def fit_table(config, target, path: str) -> HostTable:
    """Fits and saves the config's table with `target` (a loaded `dspark_jax.target.Target`)."""
    e = config.engram
    tokenizer = target.tokenizer
    compress_V = compression_map(tokenizer)
    pad = tokenizer.pad_id if tokenizer.pad_id is not None else 0
    spec = hash_spec(config, tokenizer.vocab_size, int(compress_V.max()) + 1, int(compress_V[pad]))
    sequences = []
    for conversation in fit_conversations(config):
        try:
            ids, _ = tokenize_conversation(
                tokenizer, target.chat_template, conversation, require_response=False
            )
        except ValueError:
            continue
        sequences.append(np.asarray(ids[: e.fit_max_length], np.int32))
    settings = fit_settings(config, target.fingerprint, tokenizer.fingerprint())
    log.info("fitting Engram table %s on %d conversations", path, len(sequences))
    rows_xW, stats = fit_rows(
        target.model,
        spec,
        compress_V,
        sequences,
        table_path=path,
        fingerprint=_key(settings),
        projection_seed=e.projection_seed,
    )
    table = HostTable(spec, compress_V, rows_xW, tokenizer.fingerprint(), {**settings, **stats})
    save_table(path, table)
    Path(str(path) + ".partial.safetensors").unlink(missing_ok=True)
    return table


def prepare_table(
    config, target_fingerprint: str, tokenizer_fingerprint: str, vocab_size: int, load_target: Callable | None
) -> HostTable:
    """The config's table, checked against the run; fitted first (with `load_target()`) when missing."""
    path = table_path(config, target_fingerprint, tokenizer_fingerprint)
    expect = expectations(config, tokenizer_fingerprint, vocab_size)
    if Path(path).is_file():
        return load_table(path, expect)
    if not config.engram.fit_source or load_target is None:
        raise UsageError(
            f"Engram table {path} does not exist and cannot be fitted here (engram.fit_source="
            f"{config.engram.fit_source!r}): set engram.table_path to a fitted table, or engram.fit_source "
            "to conversations disjoint from training (python -m dspark_jax.fit_engram)"
        )
    table = fit_table(config, load_target(), path)
    check_table(table, expect, path)
    return table


def hash_spec(config, vocab_size: int, compressed_vocab: int, pad_id: int) -> HashSpec:
    """The config's hashing for a target vocabulary of `vocab_size` ids compressed to `compressed_vocab`."""
    e = config.engram
    return HashSpec.create(
        max_order=e.max_order,
        heads=e.heads,
        head_dim=e.head_dim,
        seed=e.seed,
        layer_id=e.layer_id,
        compressed_vocab=compressed_vocab,
        pad_id=pad_id,
        table_size=e.table_multiplier * vocab_size,
    )


def synthetic_spec(config, vocab_size: int) -> HashSpec:
    """The config's hashing over an identity compression of `vocab_size` ids (no tokenizer needed)."""
    return hash_spec(config, vocab_size, vocab_size, 0)


def synthetic_table(config, vocab_size: int):
    """A device table of the config's shape with random rows and identity compression, for timing and
    memory checks that have no fitted table."""
    spec = synthetic_spec(config, vocab_size)
    rows = jax.random.normal(jax.random.key(0), (spec.num_rows, spec.head_dim))
    return device_table(spec, np.arange(vocab_size), rows)
