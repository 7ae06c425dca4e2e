"""Building a cache from conversations with a real (tiny random) target, read back through the reader."""

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from configs import base
from dspark_jax.cache import CacheDataSource, verify
from dspark_jax.cache.build import (
    DROP_REASONS,
    SplitFiles,
    TokenizedSamples,
    build_cache,
    cache_spec,
    count_dropped,
    cut_turns,
    prepare_split,
    tokenize_all,
)
from dspark_jax.data.regenerate import run_file
from dspark_jax.run.caches import cache_settings, prepare, regen_settings, settings_key, split_spec
from dspark_jax.target import target_from_config
from dspark_jax.target.chat import tokenize_conversation
from dspark_jax.target.generate import prompt_bucket
from tests.data.fake_gcs import fake_gcs

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
    assert samples.dropped == {"no_assistant_reply": 1}
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


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


THREE_TURNS = [user("Q1"), assistant("A1"), user("Q2"), assistant("A2"), user("Q3")]


def test_cut_turns_keeps_regen_max_turns_user_turns():
    (one,) = cut_turns([THREE_TURNS], 1)
    assert one == [user("Q1"), assistant("A1")]
    assert cut_turns([THREE_TURNS], 2) == [THREE_TURNS[:4]]
    assert cut_turns([THREE_TURNS], 64) == [THREE_TURNS]
    for bad in (0, -1, 1.5, None):
        with pytest.raises(ValueError, match=r"^data\.regen_max_turns must be an integer >= 1"):
            cut_turns([THREE_TURNS], bad)


def test_bad_regen_max_turns_fails_before_reading_the_source():
    config = base.get_config("smoke")
    config.data.regen_max_turns = 0
    config.data.train_source = "/nonexistent/conversations.jsonl"
    with pytest.raises(ValueError, match=r"data\.regen_max_turns"):
        prepare_split(split_spec(config, "train"), SplitFiles("", "", ""), target=None, mesh=None)


def test_count_dropped_names_every_reason():
    records = [
        {"index": 0, "messages": [user("a"), assistant("b")]},
        {"index": 1, "skipped": "turn 0: prompt of 300 tokens > max_prompt_tokens 128"},
        {"index": 2, "skipped": "no user turn"},
        {"index": 3, "messages": [user("c")]},
        {"index": 4, "messages": [user("d"), assistant("e")], "truncated": "turn 1: ..."},
        {"index": 5, "skipped": "turn 0: prompt of 999 tokens > max_prompt_tokens 128"},
    ]
    samples = TokenizedSamples(
        [np.zeros(3, np.int32)],
        [np.ones(3, np.uint8)],
        2,
        0,
        {
            "no_assistant_reply": 1,
            "fewer_than_2_response_tokens": 1,
        },
    )
    dropped = count_dropped(records, samples)
    assert list(dropped) == list(DROP_REASONS)
    assert dropped == {
        "prompt_too_long": 2,
        "no_user_turn": 1,
        "no_assistant_reply": 1,
        "not_tokenizable": 0,
        "fewer_than_2_response_tokens": 1,
    }
    assert len(records) == len(samples.input_ids) + sum(dropped.values())


def test_prepare_split_cuts_turns_counts_drops_and_keeps_gs_paths(target, mesh1, tmp_path, monkeypatch):
    """Real regeneration (smoke target), no cache built (dry run); the cache dir is a fake gs:// bucket."""
    source = tmp_path / "conversations.jsonl"
    records = [
        {"messages": THREE_TURNS},
        {"messages": [user("word " * 200)]},  # longer than data.regen_max_prompt_tokens
        {"messages": []},  # rejected by the source loader
        {"messages": [user("Hi"), assistant("Hello")]},
    ]
    source.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    config = base.get_config("smoke")
    config.data.cache_dir = "gs://bucket/dspark"
    config.data.train_source = str(source)
    config.data.train_limit = 0
    config.data.regen_max_turns = 1
    config.data.regen_chunk_size = 2
    monkeypatch.setenv("DSPARK_JAX_CACHE", str(tmp_path / "local"))
    with fake_gcs(tmp_path / "gcs"):
        report = prepare(config, "train", target, mesh1, build=False)
    root = f"gs://bucket/dspark/{target.fingerprint[:12]}"
    cache_dir = f"train_cache-{settings_key(cache_settings(config, 'train'))}"
    replies_file = f"train_replies-{settings_key(regen_settings(config, 'train'))}.jsonl"
    assert (report["cache"], report["replies"]) == (f"{root}/{cache_dir}", f"{root}/{replies_file}")
    replies = tmp_path / "gcs" / "bucket" / "dspark" / target.fingerprint[:12] / replies_file
    lines = [json.loads(line) for line in replies.read_text(encoding="utf-8").splitlines()]
    assert (
        json.loads(run_file(replies).read_text(encoding="utf-8"))["chunk_size"] == 2
    )  # data.regen_chunk_size
    assert [m["role"] for m in lines[0]["messages"]] == ["user", "assistant"]  # cut to one user turn
    assert lines[0]["messages"][0] == user("Q1")
    assert "skipped" in lines[1]
    assert (report["conversations"], report["source_skipped"], report["cut_to_max_turns"]) == (
        3,
        {"no messages": 1},
        1,
    )
    assert list(report["dropped"]) == list(DROP_REASONS)
    assert report["dropped"]["prompt_too_long"] == 1
    assert report["dropped_total"] == sum(report["dropped"].values())
    assert report["conversations"] == report["samples"] + report["dropped_total"]
    assert not (tmp_path / "gs:").exists() and not any((tmp_path / "local").rglob("gs:"))


def test_without_regeneration_the_cache_holds_the_sources_replies_and_the_targets_distribution(
    target, mesh1, tmp_path
):
    """`data.regenerate=False`: no replies file, the samples are the source's own conversations token for
    token, and the teacher the objective reads (the target's LM head over the cached final states) is the
    target's distribution over that text, as a direct forward of the sample computes it."""
    source = tmp_path / "conversations.jsonl"
    source.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS), encoding="utf-8")
    config = base.get_config("smoke")
    config.data.cache_dir = str(tmp_path / "caches")
    config.data.train_source = str(source)
    config.data.train_limit = 0
    config.data.regen_max_turns = 2
    config.data.max_length = 96
    config.data.regenerate = False
    report = prepare(config, "train", target, mesh1)
    assert report["replies"] is None and not list((tmp_path / "caches").rglob("*replies*"))
    assert (report["samples"], report["dropped"]["no_assistant_reply"]) == (3, 1)
    assert "regenerate" in cache_settings(config, "train")
    config.data.regenerate = True
    assert "regenerate" not in cache_settings(config, "train")  # regenerated caches keep their keys
    reader = CacheDataSource(report["cache"], expect={"aux_layer_ids": tuple(config.data.aux_layer_ids)})
    kept = [c for c in CONVERSATIONS if any(m["role"] == "assistant" for m in c)]
    logits = jax.jit(lambda h: target.model.logits(h))
    for index, messages in enumerate(kept):
        record = reader[index]
        ids, mask = tokenize_conversation(target.tokenizer, target.chat_template, messages)
        np.testing.assert_array_equal(record["input_ids"], ids[:96])
        np.testing.assert_array_equal(record["loss_mask"], mask[:96])
        length = prompt_bucket(len(record["input_ids"]))
        tokens = np.zeros((1, length), np.int32)
        tokens[0, : len(record["input_ids"])] = record["input_ids"]
        direct = target.model(jnp.asarray(tokens), valid_BxT=(jnp.arange(length) < len(ids[:96]))[None])
        want = jax.nn.softmax(logits(direct.hidden_BxTxH[0, : len(record["input_ids"])]), -1)
        got = jax.nn.softmax(logits(jnp.asarray(record["last_hidden"], jnp.float32)), -1)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-3)
        assert np.asarray(jnp.sum(jnp.abs(got - want), -1)).max() < 0.05  # L1 over the vocabulary
