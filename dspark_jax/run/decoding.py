"""The speculative decoder of a run: a loaded target, a restored draft and the group's proposer and side
inputs, from the run's config."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
from jax.sharding import Mesh

from dspark_jax import groups
from dspark_jax.cache.build import cache_path
from dspark_jax.cache.reader import CacheDataSource
from dspark_jax.inference import vocabulary
from dspark_jax.inference.decoder import SpeculativeDecoder
from dspark_jax.run import target_side
from dspark_jax.target import Target

log = logging.getLogger(__name__)


def speculative_decoder(
    config,
    target: Target,
    draft,
    *,
    batch_size: int,
    mesh: Mesh,
    select_top_k: int | None = None,
    schedule: str = "fixed",
    temperatures: dict[str, tuple[float, ...]] | None = None,
    draft_len: int | None = None,
    draft_vocab: int | None = None,
) -> SpeculativeDecoder:
    """The experiment's speculative decoder for a loaded target and a draft `(graphdef, params, rest)`;
    `select_top_k`, `draft_len` and `draft_vocab` default to the config's `generate` section; `schedule`
    and `temperatures` as in `SpeculativeDecoder`. `draft_vocab = N` restricts the proposals to the `N`
    tokens the run's training text uses most (`training_vocabulary`; 0 = the whole vocabulary)."""
    if select_top_k is None:  # `get`: absent from configs stored before it
        select_top_k = config.generate.get("select_top_k", 0)
    if draft_len is None:
        draft_len = config.generate.get("draft_len", 0)
    if draft_vocab is None:
        draft_vocab = config.generate.get("draft_vocab", 0)
    side = target_side.side_from_target(target, mesh)
    ids = None
    if draft_vocab:
        ids = training_vocabulary(
            config, side.fingerprint, target.config.vocab_size, draft_vocab, target.eos_ids
        )
    side = target_side.with_side_inputs(config, side)
    return SpeculativeDecoder(
        target.model,
        *draft,
        side.frozen,
        proposer=groups.get(config.experiment).proposer,
        aux_layer_ids=config.data.aux_layer_ids,
        eos_ids=target.eos_ids,
        pad_id=target.tokenizer.pad_id,
        batch_size=batch_size,
        mesh=mesh,
        select_top_k=select_top_k,
        schedule=schedule,
        temperatures=temperatures,
        draft_len=draft_len,
        draft_vocab=ids,
    )


def training_vocabulary(
    config, fingerprint: str, vocab_size: int, size: int, always: Sequence[int] = ()
) -> np.ndarray:
    """The `size` tokens of the run's training cache's responses used most (ties to the lower id), plus
    `always` (the target's EOS ids): a decoding-time draft vocabulary (`inference.vocabulary`) for the
    target of `fingerprint`. Only the training split is counted, so no evaluation prompt's reply shapes it."""
    path = config.data.train_cache or cache_path(config, fingerprint, "train")
    try:
        source = CacheDataSource(path, read_states=False)
    except FileNotFoundError:
        raise ValueError(
            f"a draft vocabulary ranks the training cache's tokens, and {path} is not there: build it "
            f"(python -m dspark_jax.build_cache with the run's config) or set generate.draft_vocab=0"
        ) from None
    counts_V = source.token_counts(vocab_size)
    ids_N = vocabulary.most_frequent(counts_V, size, always=always)
    log.info(
        "draft vocabulary: %d tokens covering %.2f%% of the training responses' tokens (%s)",
        len(ids_N),
        100 * vocabulary.coverage(counts_V, ids_N),
        path,
    )
    return ids_N
