"""Cache and replies paths: URLs (gs://, file://, memory://) stay intact; local paths are as before."""

from pathlib import Path

import pytest

from configs import base
from dspark_jax import cache
from dspark_jax.run.caches import cache_path, cache_settings, regen_settings, replies_path, root, settings_key
from tests.cache.test_cache import SPEC, assert_same_sample, build, make_samples

FINGERPRINT = "0123456789abcdef0123456789abcdef"


def config(cache_dir: str = ""):
    c = base.get_config("smoke")
    c.data.cache_dir = cache_dir
    return c


# Directory names of the smoke preset's caches and replies, keyed on their content settings.
TRAIN = f"train_cache-{settings_key(cache_settings(config(), 'train'))}"
VAL = f"val_cache-{settings_key(cache_settings(config(), 'val'))}"
REPLIES = f"train_replies-{settings_key(regen_settings(config(), 'train'))}.jsonl"


def test_a_regeneration_chunk_size_other_than_64_keys_new_replies_and_caches():
    """`data.regen_chunk_size` batches other prompts together (other replies, within float noise): another
    value is another replies file and cache; 64, the size before the key existed, keeps their names."""
    c = config()
    c.data.regen_chunk_size = 64
    assert replies_path(c, FINGERPRINT, "train").endswith(REPLIES) and "chunk_size" not in regen_settings(
        c, "train"
    )
    c.data.regen_chunk_size = 256
    assert regen_settings(c, "train")["chunk_size"] == 256
    assert not replies_path(c, FINGERPRINT, "train").endswith(REPLIES)
    assert not cache_path(c, FINGERPRINT, "train").endswith(TRAIN)


def test_gs_cache_dir_is_kept():
    got = cache_path(config("gs://bucket/dspark"), FINGERPRINT, "train")
    assert got == f"gs://bucket/dspark/0123456789ab/{TRAIN}"
    assert "gs://" in got and "gs:/b" not in got
    assert root(config("gs://bucket/dspark")) == "gs://bucket/dspark"
    assert (
        cache_path(config("gs://bucket/dspark/"), FINGERPRINT, "val")
        == f"gs://bucket/dspark/0123456789ab/{VAL}"
    )
    assert replies_path(config("gs://bucket/dspark"), FINGERPRINT, "train") == (
        f"gs://bucket/dspark/0123456789ab/{REPLIES}"
    )


@pytest.mark.parametrize("cache_dir", ["file:///tmp/dspark/caches", "memory://dspark", "memory://"])
def test_url_cache_dirs_round_trip(cache_dir):
    got = cache_path(config(cache_dir), FINGERPRINT, "train")
    assert got.startswith(cache_dir) and got.endswith(f"0123456789ab/{TRAIN}")
    assert got == (cache_dir if cache_dir.endswith("://") else cache_dir + "/") + f"0123456789ab/{TRAIN}"


def test_local_paths_unchanged(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_JAX_CACHE", str(tmp_path / "env"))
    assert cache_path(config(), FINGERPRINT, "val") == str(tmp_path / "env" / "smoke" / "0123456789ab" / VAL)
    monkeypatch.delenv("DSPARK_JAX_CACHE")
    assert cache_path(config(), FINGERPRINT, "val") == str(
        Path.home() / ".cache" / "dspark_jax" / "smoke" / "0123456789ab" / VAL
    )
    for cache_dir in ("relative/dir/", "./here", str(tmp_path) + "//x"):
        assert cache_path(config(cache_dir), FINGERPRINT, "train") == str(
            Path(cache_dir) / "0123456789ab" / TRAIN
        )
        assert replies_path(config(cache_dir), FINGERPRINT, "train") == str(
            Path(cache_dir) / "0123456789ab" / REPLIES
        )


def write_and_read_back(path: str) -> None:
    samples = make_samples(5)
    build(path, samples, SPEC)
    cache.finalize(path)
    source = cache.CacheDataSource(path)
    assert len(source) == 5
    for i, sample in enumerate(samples):
        assert_same_sample(source[i], sample)


def test_cache_written_to_local_cache_path_reads_back(tmp_path):
    path = cache_path(config(str(tmp_path / "caches")), FINGERPRINT, "train")
    write_and_read_back(path)
    assert (tmp_path / "caches" / "0123456789ab" / TRAIN / "manifest.json").is_file()


def test_cache_written_to_file_url_cache_path_reads_back(tmp_path, monkeypatch):
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    root = tmp_path / "caches"
    path = cache_path(config(root.as_uri()), FINGERPRINT, "train")
    assert path == root.as_uri() + f"/0123456789ab/{TRAIN}"
    write_and_read_back(path)
    assert not (tmp_path / "cwd" / "file:").exists(), "the cache went to ./file:, not to the URL's path"
    assert (root / "0123456789ab" / TRAIN / "manifest.json").is_file()


def test_cache_written_to_memory_url_cache_path_reads_back(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = cache_path(config("memory://dspark"), FINGERPRINT, "train")
    assert path == f"memory://dspark/0123456789ab/{TRAIN}"
    write_and_read_back(path)
    assert not (tmp_path / "memory:").exists(), "the cache went to ./memory:, not to memory"


def test_every_content_setting_keys_the_cache():
    """Another source, limit, length or layer set gives another cache, never a stale one."""
    base_path = cache_path(config(), FINGERPRINT, "train")
    for key, value in [
        ("train_limit", 50),
        ("train_source", "/data/other.jsonl"),
        ("max_length", 128),
        ("aux_layer_ids", (0, 1, 2)),
        ("regen_max_new_tokens", 9),
        ("regen_max_turns", 1),
    ]:
        changed = config()
        setattr(changed.data, key, value)
        assert cache_path(changed, FINGERPRINT, "train") != base_path, key
    changed = config()
    changed.train.peak_lr = 1.0  # not a data setting
    assert cache_path(changed, FINGERPRINT, "train") == base_path
    changed.data.max_length = 128  # the replies do not depend on the cache's max length
    assert replies_path(changed, FINGERPRINT, "train") == replies_path(config(), FINGERPRINT, "train")
