"""Sparse and hybrid targets (Qwen3-MoE, Qwen3-Next, Qwen 3.5, Qwen 3.5-MoE) against `transformers` on tiny
random checkpoints: logits, every aux layer, greedy generation, and the decoding cache's three ways through
a sequence (whole, token by token, speculative blocks rolled back to a prefix) equal to each other."""

import functools
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.target.checkpoint import load_checkpoint
from dspark_jax.target.generate import Generator
from dspark_jax.target.load import model_from_checkpoint
from dspark_jax.target.model import DecodeCache, keep_prefix
from tests.marks import tiered
from tests.target import hf_hybrid
from tests.target.hf_hybrid import FAMILIES, LINEAR_FAMILIES, torch

VOCAB = 101


@functools.cache
def _pair(family):
    """A random transformers model and our model loaded from its saved checkpoint."""
    directory = tempfile.mkdtemp(prefix=f"hybrid-{family}-")
    hf = hf_hybrid.save_random(family, directory, VOCAB)
    return hf, model_from_checkpoint(load_checkpoint(directory))


def _batch(t=40, pads=(0, 7)):
    ids = np.random.RandomState(1).randint(3, VOCAB, (len(pads), t))
    mask = np.ones_like(ids)
    for row, pad in enumerate(pads):
        mask[row, :pad] = 0
        ids[row, :pad] = 0
    return ids, mask


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_and_every_layer_match_transformers_with_left_padding(family):
    hf, model = _pair(family)
    assert model.cfg.family == family
    ids, mask = _batch()
    ref_logits, ref_layers, _ = hf_hybrid.forward(hf, ids, mask)
    out = model(jnp.asarray(ids), valid_BxT=jnp.asarray(mask), aux_layer_ids=(-1, 0, 1, 2, 3))
    real = mask.astype(bool)
    logits = np.asarray(model.logits(out.hidden_BxTxH))
    np.testing.assert_allclose(
        logits[real], ref_logits[real], rtol=1e-4, atol=1e-4 * np.abs(ref_logits).max()
    )
    aux = np.asarray(out.aux_BxTxAxH)
    for k, layer in enumerate(ref_layers):
        np.testing.assert_allclose(
            aux[:, :, k + 1][real], layer[real], rtol=1e-4, atol=1e-5, err_msg=f"layer {k}"
        )


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_generation_matches_transformers(family):
    hf, model = _pair(family)
    prompts = [[5, 9, 11, 40, 7], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30]]
    ours = Generator(model, eos_ids=[VOCAB + 1], pad_id=0, batch_size=2).generate(prompts, max_new_tokens=32)
    for prompt, got in zip(prompts, ours):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0
            )
        assert got == ref[0, len(prompt) :].tolist()


@functools.cache
def _decode_fns(family):
    _, model = _pair(family)
    step = jax.jit(lambda tokens, cache: model(tokens, cache=cache))
    verify = jax.jit(lambda tokens, cache: model(tokens, cache=cache, keep_steps=True))
    return model, step, verify


@pytest.mark.parametrize("family", tiered(LINEAR_FAMILIES, fast=["qwen3_5", "qwen3_next"]))  # MoE: no change
def test_token_by_token_decoding_equals_the_whole_sequence_past_one_chunk(family):
    """The recurrent form (one token at a time from the cache) equals the chunked whole-sequence form on
    a sequence longer than one chunk (64), with a left-padded row."""
    model, step, _ = _decode_fns(family)
    t, pads = 80, (0, 5)
    ids, mask = _batch(t, pads)
    whole = np.asarray(model(jnp.asarray(ids), valid_BxT=jnp.asarray(mask)).hidden_BxTxH)
    cache = DecodeCache.zeros(model.cfg, 2, t, jnp.float32)._replace(start_B=jnp.asarray(pads, jnp.int32))
    prefix = 70  # a chunked prefill, then the recurrent form
    out = model(jnp.asarray(ids[:, :prefix]), cache=cache, valid_BxT=jnp.asarray(mask[:, :prefix]))
    got, cache = [np.asarray(out.hidden_BxTxH)], out.cache
    for i in range(prefix, t):
        out = step(jnp.asarray(ids[:, i : i + 1]), cache)
        got.append(np.asarray(out.hidden_BxTxH))
        cache = out.cache
    got = np.concatenate(got, 1)
    real = mask.astype(bool)
    np.testing.assert_allclose(got[real], whole[real], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", tiered(LINEAR_FAMILIES, fast=["qwen3_next"]))  # one rollback code path
def test_blocks_rolled_back_to_each_rows_prefix_equal_appending_only_that_prefix(family):
    """Speculative verification: a block of 8 appended with `keep_steps`, then kept to a different prefix
    per row (every length 0..8: a rejection at every position of the block), leaves the cache of appending
    only those tokens; the next tokens then decode as from that cache."""
    model, step, verify = _decode_fns(family)
    keep = np.arange(9)
    pads = tuple(int(p) for p in keep % 4)
    ids, mask = _batch(30, pads)
    cache = DecodeCache.zeros(model.cfg, len(keep), 64, jnp.float32)
    cache = cache._replace(start_B=jnp.asarray(pads, jnp.int32))
    cache = model(jnp.asarray(ids[:, :20]), cache=cache, valid_BxT=jnp.asarray(mask[:, :20])).cache
    block = jnp.asarray(ids[:, 20:28])
    out = verify(block, cache)
    kept = keep_prefix(cache, out.cache, out.steps, cache.end_B + keep)
    nxt = jnp.asarray(ids[:, 28:30])
    got = np.asarray(step(nxt, kept).hidden_BxTxH)
    for row, n in enumerate(keep):
        single = jax.tree.map(lambda x, r=row: x[r : r + 1], cache)
        if n:
            single = step(block[row : row + 1, :n], single).cache
        want = np.asarray(step(nxt[row : row + 1], single).hidden_BxTxH)
        np.testing.assert_allclose(
            got[row : row + 1], want, rtol=1e-4, atol=1e-5, err_msg=f"row {row} kept {n}"
        )


@pytest.mark.parametrize("family", tiered(LINEAR_FAMILIES, fast=["qwen3_5", "qwen3_next"]))  # MoE: no change
def test_packed_rows_equal_each_sample_alone(family):
    """Two packed rows of 128 tokens (chunks of 64): samples that start inside a chunk and on a chunk's
    first slot (64), span a chunk boundary, or hold one token, then padding (position 0, each pad its own
    sample). Every sample's aux layers (linear and full attention) and final state equal its forward
    alone: the recurrence, the conv window and attention all restart where the positions do."""
    _, model = _pair(family)
    lengths = [(23, 70, 9), (64, 1, 50)]
    t = 128
    rng = np.random.RandomState(2)
    ids, positions, spans = np.zeros((2, t), np.int32), np.zeros((2, t), np.int32), []
    for row, row_lengths in enumerate(lengths):
        start = 0
        for n in row_lengths:
            ids[row, start : start + n] = rng.randint(3, VOCAB, n)
            positions[row, start : start + n] = np.arange(n)
            spans.append((row, start, start + n))
            start += n
    layers = (-1, 0, 1, 2, 3)
    packed = model(jnp.asarray(ids), positions_BxT=jnp.asarray(positions), aux_layer_ids=layers)
    # Each sample alone: one right-padded row per sample, in one forward.
    longest = max(end - start for _, start, end in spans)
    alone_ids, valid = np.zeros((len(spans), longest), np.int32), np.zeros((len(spans), longest), bool)
    for k, (row, start, end) in enumerate(spans):
        alone_ids[k, : end - start], valid[k, : end - start] = ids[row, start:end], True
    alone = model(jnp.asarray(alone_ids), valid_BxT=jnp.asarray(valid), aux_layer_ids=layers)
    for k, (row, start, end) in enumerate(spans):
        for name in ("aux_BxTxAxH", "hidden_BxTxH"):
            np.testing.assert_allclose(
                np.asarray(getattr(packed, name)[row, start:end]),
                np.asarray(getattr(alone, name)[k, : end - start]),
                rtol=1e-5,
                atol=1e-5,
                err_msg=f"{name} of the sample at {row}:{start}",
            )
