"""Building a cache from conversations with a real (tiny random) target, read back through the reader."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from configs import base
from dspark_jax.cache import CacheDataSource, verify
from dspark_jax.cache.build import build_cache, cache_spec, tokenize_all
from dspark_jax.target import target_from_config
from dspark_jax.target.chat import tokenize_conversation

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! How can I help?"}],
    [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3*3?"},
        {"role": "assistant", "content": "It is 9, of course."},
    ],
    [{"role": "user", "content": "no reply here"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a colour " * 20},
        {"role": "assistant", "content": "Blue, green and a very long list of other colours " * 8},
    ],
]


@pytest.fixture(scope="module")
def target(mesh1):
    return target_from_config(base.get_config("smoke").target, seed=0, mesh=mesh1)


def test_build_then_read_equals_direct_forward(target, tmp_path, mesh1):
    samples = tokenize_all(target, CONVERSATIONS, max_length=96)
    assert (samples.skipped, samples.truncated, len(samples.input_ids)) == (1, 1, 3)
    spec = cache_spec(target, (-1, 1, 3), num_shards=2)
    manifest = build_cache(
        str(tmp_path / "c"), target, samples, spec, samples_per_commit=2, mesh=mesh1, progress=False
    )
    assert manifest["num_samples"] == 3 and manifest["num_tokens"] == samples.num_tokens
    verify(str(tmp_path / "c"))
    source = CacheDataSource(str(tmp_path / "c"), expect={"aux_layer_ids": (-1, 1, 3), "hidden_size": 64})
    kept = [c for c in CONVERSATIONS if any(m["role"] == "assistant" for m in c)]
    for index, messages in enumerate(kept):
        record = source[index]
        ids, mask = tokenize_conversation(target.tokenizer, target.chat_template, messages)
        np.testing.assert_array_equal(record["input_ids"], ids[:96])
        np.testing.assert_array_equal(record["loss_mask"], mask[:96])
        out = target.model(jnp.asarray(record["input_ids"][None]), aux_layer_ids=(-1, 1, 3))
        for got, want in (
            (record["aux_hidden"], out.aux_BxTxAxH[0]),
            (record["last_hidden"], out.hidden_BxTxH[0]),
        ):
            assert got.dtype == ml_dtypes.bfloat16
            np.testing.assert_allclose(got.astype(np.float32), np.asarray(want), rtol=2**-7, atol=1e-6)
