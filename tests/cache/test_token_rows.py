"""Token-row caches (`data.features = "online"`): input_ids and loss_mask only, built without a target
forward, a small fraction of a cache of states, and the same batches (less the states) through the
pipeline; an offline run refuses one, an online run also reads a cache of states."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from configs import base
from dspark_jax import cache, inspect_cache
from dspark_jax.cache import build as build_lib
from dspark_jax.cache import format as fmt
from dspark_jax.cache.build import build_cache, cache_spec, projected_bytes, tokenize_all
from dspark_jax.data import batch as batch_lib
from dspark_jax.data import pipeline
from dspark_jax.interop.deepspec_cache import write_deepspec_cache
from dspark_jax.run import cache_info, config_lib, sources, target_side
from dspark_jax.run import caches as run_caches
from dspark_jax.target import target_from_config
from dspark_jax.target.chat import tokenize_conversation
from tests.cache.test_cache import make_samples

AUX = (-1, 1, 3)
MAX_LENGTH = 96
OLD_CACHE = Path(__file__).parents[1] / "data" / "layout_2026_12_01" / "val_cache"  # no `states` key


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


# 12 conversations of 8..~150 tokens (one longer than MAX_LENGTH, cut), and one without a reply (dropped).
CONVERSATIONS = [
    [user(f"Question {i}: " + "why " * (3 * i)), assistant(f"Answer {i}: " + "because " * (2 * i + 1))]
    for i in range(10)
] + [
    [user("2+2?"), assistant("4"), user("and 3*3?"), assistant("It is 9, of course.")],
    [user("Name a colour " * 10), assistant("Blue, green and a long list of other colours " * 6)],
    [user("no reply here")],
]


@pytest.fixture(scope="module")
def target(mesh1):
    return target_from_config(base.get_config("smoke").target, seed=0, mesh=mesh1)


def _no_forward(*args, **kwargs):
    raise AssertionError("a token-row cache ran the target")


@pytest.fixture(scope="module")
def caches(target, mesh1, tmp_path_factory):
    """The same samples as a cache of states and as a token-row cache (built with no target at all)."""
    root = tmp_path_factory.mktemp("token_rows")
    samples = tokenize_all(target, CONVERSATIONS, max_length=MAX_LENGTH)
    assert (len(samples.input_ids), samples.truncated) == (12, 1)
    offline, tokens = str(root / "offline"), str(root / "tokens")
    build_cache(
        offline, target, samples, cache_spec(target, AUX, 2), samples_per_commit=4, mesh=mesh1, progress=False
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(build_lib, "FeatureExtractor", _no_forward)
        spec = cache_spec(target, AUX, 2, states=False)
        build_cache(tokens, None, samples, spec, samples_per_commit=4, progress=False)
    return samples, offline, tokens


def _disk_bytes(path: str) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def _shard_arrays(path: str) -> set[str]:
    return {p.name for p in Path(path, "shards").glob("*/*") if p.is_dir()}


def test_a_token_cache_holds_the_tokenized_rows_and_no_states(caches, target):
    _, _, tokens = caches
    manifest = cache.read_manifest(tokens)
    assert manifest["complete"] and manifest["spec"]["states"] is False
    assert manifest["spec"]["aux_layer_ids"] == [] and set(manifest["dtypes"]) == {
        "input_ids",
        "loss_mask",
        "offsets",
    }
    assert _shard_arrays(tokens) == {"input_ids", "loss_mask", "offsets"}
    expect = {
        "states": False,
        "hidden_size": 64,
        "tokenizer_fingerprint": target.tokenizer.fingerprint(),
        "target_fingerprint": target.fingerprint,
    }
    source = cache.CacheDataSource(tokens, expect=expect)
    assert not source.has_states and len(source) == 12
    kept = [c for c in CONVERSATIONS if any(m["role"] == "assistant" for m in c)]
    for index, messages in enumerate(kept):
        ids, mask = tokenize_conversation(target.tokenizer, target.chat_template, messages)
        record = source[index]
        assert set(record) == {"input_ids", "loss_mask"}
        assert record["input_ids"].dtype == np.int32 and record["loss_mask"].dtype == np.uint8
        np.testing.assert_array_equal(record["input_ids"], ids[:MAX_LENGTH])
        np.testing.assert_array_equal(record["loss_mask"], mask[:MAX_LENGTH])
    with pytest.raises(ValueError, match=r"mismatch on states: expected True, found False \(a token-row"):
        cache.CacheDataSource(tokens, expect={"aux_layer_ids": AUX, "states": True})


def test_a_token_cache_is_a_small_fraction_of_the_states_cache(caches, target):
    """Same shards, same token arrays byte for byte; the states are what the offline cache adds."""
    samples, offline, tokens = caches
    for shard in Path(tokens, "shards").iterdir():
        for name in ("input_ids", "loss_mask", "offsets"):
            assert _tree(shard / name) == _tree(Path(offline, "shards", shard.name, name)), name
    token_bytes, offline_bytes = _disk_bytes(tokens), _disk_bytes(offline)
    print(
        f"bytes on disk: token rows {token_bytes}, states cache {offline_bytes} ({samples.num_tokens} tokens)"
    )
    assert token_bytes < 0.05 * offline_bytes
    spec = cache_spec(target, AUX, 2, states=False)
    assert projected_bytes(samples, spec) == 5 * samples.num_tokens + 8 * (12 + 2)


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_verify_and_inspect_read_a_token_cache(caches, tmp_path, capsys):
    _, _, tokens = caches
    assert cache.verify(tokens) == 12
    assert inspect_cache.inspect(tokens, verify=True, dump_sample=11, output=str(tmp_path / "s.npz")) == 0
    out = capsys.readouterr().out
    summary = json.loads(out[: out.rindex("}") + 1])
    assert summary["states"] is False and summary["aux_layer_ids"] == [] and "verify: OK (12 samples)" in out
    assert set(summary["dtypes"]) == {"input_ids", "loss_mask", "offsets"}
    with np.load(tmp_path / "s.npz") as dump:
        assert sorted(dump.files) == ["input_ids", "loss_mask"]
    damaged = tmp_path / "damaged"
    shutil.copytree(tokens, damaged)
    chunk = sorted(p for p in (damaged / "shards" / "00001" / "loss_mask" / "c").rglob("*") if p.is_file())[0]
    data = bytearray(chunk.read_bytes())
    data[3] ^= 1
    chunk.write_bytes(bytes(data))
    with pytest.raises(cache.CacheCorruptError, match=r"shard 1: .*loss_mask"):
        cache.verify(str(damaged))


def test_a_manifest_without_states_reads_as_a_cache_of_states_and_resumes(tmp_path):
    manifest = cache.read_manifest(str(OLD_CACHE))
    assert "states" not in manifest["spec"]
    source = cache.CacheDataSource(str(OLD_CACHE), expect={"states": True})
    assert source.has_states and set(source[0]) == {"input_ids", "loss_mask", "aux_hidden", "last_hidden"}
    assert cache_info.summarize(str(OLD_CACHE))["states"] is True
    copy = tmp_path / "old"
    shutil.copytree(OLD_CACHE, copy)
    spec = fmt.CacheSpec.from_json(manifest["spec"])
    assert spec.states and cache.create_or_open(str(copy), spec, manifest["num_samples"]).spec == spec
    with pytest.raises(ValueError, match="exists with a different aux_layer_ids"):
        cache.create_or_open(
            str(copy), fmt.CacheSpec(**{**spec.to_json(), "aux_layer_ids": (), "states": False}), 4
        )


def test_a_deepspec_cache_holds_states_and_gives_its_token_rows_alone(tmp_path):
    samples = make_samples(3)
    write_deepspec_cache(str(tmp_path / "d"), samples, 16, (2, 5, 7), samples_per_shard=2)
    source = sources.open_cache(str(tmp_path / "d"), expect={"states": True}, read_states=False)
    assert source.has_states and len(source) == 3
    for index, sample in enumerate(samples):
        assert set(source[index]) == {"input_ids", "loss_mask"}
        for key in ("input_ids", "loss_mask"):
            np.testing.assert_array_equal(source[index][key], sample[key])
    with pytest.raises(ValueError, match="mismatch on states: expected False, found True"):
        source.check_expect({"states": False})


def test_a_spec_of_states_needs_aux_layers_and_token_rows_have_none():
    with pytest.raises(ValueError, match="needs aux_layer_ids"):
        fmt.CacheSpec((), 8, 1, {}, "")
    with pytest.raises(ValueError, match="has no aux layers"):
        fmt.CacheSpec((1,), 8, 1, {}, "", states=False)
    spec = fmt.CacheSpec((), 8, 1, {}, "", states=False)
    assert spec.array_names == ("input_ids", "loss_mask")
    assert fmt.CacheSpec.from_json(spec.to_json()) == spec


def _batches(source, *, states: bool, pack: bool) -> list[dict[str, np.ndarray]]:
    config = pipeline.PipelineConfig(
        max_length=2 * MAX_LENGTH,
        num_anchors=6,
        batch_size=2,
        seed=5,
        pad_id=-3,
        num_epochs=2,
        pack=pack,
        states=states,
    )
    return list(pipeline.make_iterator(source, config, process_index=0, process_count=1))


@pytest.mark.parametrize("pack", [False, True])
def test_the_pipeline_over_token_rows_gives_the_offline_batches_less_the_states(caches, pack):
    _, offline, tokens = caches
    want = _batches(cache.CacheDataSource(offline), states=True, pack=pack)
    assert len(want) >= 3 and set(want[0]) == set(batch_lib.DEVICE_FIELDS) | {"seq_len", "num_samples"}
    if pack:
        assert max(int(b["num_samples"].max()) for b in want) > 1
    from_states_cache = cache.CacheDataSource(offline, read_states=False)  # an online run on a states cache
    assert set(from_states_cache[0]) == {"input_ids", "loss_mask"}
    for source in (cache.CacheDataSource(tokens), from_states_cache):
        got = _batches(source, states=False, pack=pack)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert list(g) == [k for k in w if k not in batch_lib.STATE_FIELDS]
            for key in g:
                assert g[key].dtype == w[key].dtype, key
                np.testing.assert_array_equal(g[key], w[key], err_msg=key)


def test_a_pipeline_with_states_refuses_token_rows(caches):
    _, _, tokens = caches
    with pytest.raises(ValueError, match=r"lacks fields \['aux_hidden', 'last_hidden'\]"):
        _batches(cache.CacheDataSource(tokens), states=True, pack=False)


def test_the_batch_spec_without_states():
    online = base.get_config("smoke")
    online.data.features = "online"
    dims = config_lib.batch_dims(online, 64)
    assert not dims.states and config_lib.batch_dims(base.get_config("smoke"), 64).states
    names = [n for n in batch_lib.DEVICE_FIELDS if n not in ("aux_hidden", "last_hidden")]
    assert list(batch_lib.device_field_names(False)) == names
    assert list(batch_lib.abstract_device_batch(2, dims)) == names
    assert set(batch_lib.shapes(2, dims)) == set(names) | {"seq_len", "num_samples"}
    with_states = batch_lib.synthetic(2, batch_lib.Dims(32, 3, 8, 4), 50, seed=1)
    without = batch_lib.synthetic(2, batch_lib.Dims(32, 3, 8, 4, states=False), 50, seed=1)
    assert list(without) == [k for k in with_states if k not in batch_lib.STATE_FIELDS]
    for key in without:
        np.testing.assert_array_equal(without[key], with_states[key], err_msg=key)
    assert list(batch_lib.device_fields(without)) == names
    assert list(batch_lib.device_fields(with_states)) == list(batch_lib.DEVICE_FIELDS)
    online.data.features = "both"
    with pytest.raises(
        ValueError, match=r"data\.features must be one of \('offline', 'online'\), got 'both'"
    ):
        config_lib.reads_states(online)


def _config(features: str):
    config = base.get_config("smoke")
    config.data.features = features
    return config


def test_an_offline_run_refuses_a_token_cache_and_an_online_run_reads_either(caches, target, mesh1):
    _, offline, tokens = caches
    side = target_side.side_from_target(target, mesh1)
    offline_config = _config("offline")
    offline_config.data.aux_layer_ids = AUX
    with pytest.raises(ValueError, match=r"holds token rows only .*data\.features=online") as refused:
        sources.open_source(tokens, offline_config, side)
    assert "\n" not in str(refused.value)
    assert sources.open_source(offline, offline_config, side).has_states
    for path in (tokens, offline):
        source = sources.open_source(path, _config("online"), side)
        assert set(source[0]) == {"input_ids", "loss_mask"}
    assert not sources.pipeline_config(_config("online"), side, batch_size=2, seed=0, num_epochs=1).states
    assert sources.pipeline_config(offline_config, side, batch_size=2, seed=0, num_epochs=1).states


def test_prepare_split_online_stops_at_token_rows(target, mesh1, tmp_path, monkeypatch):
    """Real regeneration (smoke target), then token rows only; `prepare_target_side` builds the val split."""
    rows = [{"messages": [user("Hi"), assistant("Hello")]}, {"messages": [user("What is 2+2?")]}]
    for split in ("train", "val"):
        lines = rows if split == "train" else rows[1:]
        (tmp_path / f"{split}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in lines), encoding="utf-8"
        )
    config = _config("online")
    config.data.update(
        cache_dir=str(tmp_path / "caches"),
        train_source=str(tmp_path / "train.jsonl"),
        val_source=str(tmp_path / "val.jsonl"),
        train_limit=0,
        val_limit=0,
    )
    monkeypatch.setenv("DSPARK_JAX_CACHE", str(tmp_path / "local"))
    monkeypatch.setattr(build_lib, "FeatureExtractor", _no_forward)
    report = run_caches.prepare(config, "train", target, mesh1)
    key = run_caches.settings_key(run_caches.cache_settings(config, "train"))
    assert report["cache"] == str(tmp_path / "caches" / target.fingerprint[:12] / f"train_tokens-{key}")
    assert report["states"] is False and report["manifest_complete"] and report["samples"] == 2
    assert report["projected_bytes"] == 5 * report["tokens"] + 8 * (2 + config.data.num_shards)
    assert _shard_arrays(report["cache"]) == {"input_ids", "loss_mask", "offsets"}
    monkeypatch.setattr(target_side, "target_from_config", lambda *a, **k: target)
    side, paths = target_side.prepare_target_side(config, mesh1)
    assert paths["train"] == report["cache"] and Path(paths["val"]).name.startswith("val_tokens-")
    for split in ("train", "val"):
        assert cache.read_manifest(paths[split])["spec"]["states"] is False
        assert len(sources.open_source(paths[split], config, side)) == (2 if split == "train" else 1)
    offline = _config("offline")
    offline.data.update(cache_dir=config.data.cache_dir, train_source=config.data.train_source, train_limit=0)
    assert run_caches.replies_path(offline, target.fingerprint, "train") == report["replies"]
    assert Path(run_caches.cache_path(offline, target.fingerprint, "train")).name.startswith("train_cache-")
    assert not list((tmp_path / "caches").rglob("aux_hidden"))


def test_a_token_cache_key_ignores_the_aux_layers():
    settings = run_caches.cache_settings(_config("online"), "train")
    assert settings["states"] is False and "aux_layer_ids" not in settings
    other = _config("online")
    other.data.aux_layer_ids = (0,)
    fingerprint = "0123456789abcdef"
    assert run_caches.cache_path(other, fingerprint, "train") == run_caches.cache_path(
        _config("online"), fingerprint, "train"
    )
    other.data.max_length = 128
    assert run_caches.cache_path(other, fingerprint, "train") != run_caches.cache_path(
        _config("online"), fingerprint, "train"
    )


def test_the_dry_run_counts_token_row_bytes(target, tmp_path):
    source = tmp_path / "train.jsonl"
    source.write_text(json.dumps({"messages": [user("Hi"), assistant("Hello")]}) + "\n", encoding="utf-8")
    sizes = {}
    for features in ("offline", "online"):
        config = _config(features)
        config.data.update(train_source=str(source), train_limit=0)
        spec = run_caches.split_spec(config, "train")
        sizes[features] = build_lib.projected_size(spec, target.tokenizer, target.chat_template, 64)
    tokens, shards = sizes["online"]["tokens_at_most"], config.data.num_shards
    assert sizes["online"]["states"] is False and tokens == sizes["offline"]["tokens_at_most"] > 0
    assert sizes["online"]["bytes_at_most"] == 5 * tokens + 8 * (1 + shards)
    assert sizes["offline"]["bytes_at_most"] == (5 + 2 * 64 * 4) * tokens + 8 * (1 + shards)
