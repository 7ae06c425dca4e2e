"""Building a cache from conversations with a real (tiny random) target, read back through the reader."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from configs import base
from dspark_jax.cache import CacheDataSource, verify
from dspark_jax.cache.build import build_cache, cache_spec, tokenize_all
from dspark_jax.target import target_from_config
from dspark_jax.target.chat import tokenize_conversation
from dspark_jax.target.generate import prompt_bucket

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


def _direct_forward(model, ids):
    """The target alone on one sample, right-padded to its length bucket (padding masked), in bf16."""
    length = prompt_bucket(len(ids))
    tokens = np.zeros((1, length), np.int32)
    tokens[0, : len(ids)] = ids
    out = jax.jit(lambda t, v: model(t, valid_BxT=v, aux_layer_ids=(-1, 1, 3)))(
        jnp.asarray(tokens), (jnp.arange(length) < len(ids))[None]
    )
    bf16 = lambda x: np.asarray(x[0, : len(ids)].astype(jnp.bfloat16))
    return bf16(out.aux_BxTxAxH), bf16(out.hidden_BxTxH)


def test_build_then_read_equals_direct_forward(target, tmp_path, mesh1):
    """Bit-exact in bf16 with one sample per forward (`tokens_per_batch=1`): batching several samples
    into one forward may move a rare element by one bf16 step (fp32 accumulation order follows the
    batch shape on XLA CPU), which `tests/cache/test_features.py` bounds."""
    samples = tokenize_all(target, CONVERSATIONS, max_length=96)
    assert (samples.skipped, samples.truncated, len(samples.input_ids)) == (1, 1, 3)
    spec = cache_spec(target, (-1, 1, 3), num_shards=2)
    manifest = build_cache(
        str(tmp_path / "c"),
        target,
        samples,
        spec,
        samples_per_commit=2,
        tokens_per_batch=1,
        mesh=mesh1,
        progress=False,
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
        aux, last = _direct_forward(target.model, record["input_ids"])
        for got, want in ((record["aux_hidden"], aux), (record["last_hidden"], last)):
            assert got.dtype == ml_dtypes.bfloat16
            np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
