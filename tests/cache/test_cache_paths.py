"""Cache and replies paths: URLs (gs://, file://, memory://) stay intact; local paths are as before."""

from pathlib import Path

import pytest

from configs import base
from dspark_jax import cache
from dspark_jax.cache.build import cache_path, cache_root, replies_path
from tests.cache.test_cache import SPEC, assert_same_sample, build, make_samples

FINGERPRINT = "0123456789abcdef0123456789abcdef"


def config(cache_dir: str = ""):
    c = base.get_config("smoke")
    c.data.cache_dir = cache_dir
    return c


def test_gs_cache_dir_is_kept():
    got = cache_path(config("gs://bucket/dspark"), FINGERPRINT, "train")
    assert got == "gs://bucket/dspark/0123456789ab/train_cache"
    assert "gs://" in got and "gs:/b" not in got
    assert cache_root(config("gs://bucket/dspark")) == "gs://bucket/dspark"
    assert (
        cache_path(config("gs://bucket/dspark/"), FINGERPRINT, "val")
        == "gs://bucket/dspark/0123456789ab/val_cache"
    )
    assert replies_path(config("gs://bucket/dspark"), FINGERPRINT, "train") == (
        "gs://bucket/dspark/0123456789ab/train_replies.jsonl"
    )


@pytest.mark.parametrize("cache_dir", ["file:///tmp/dspark/caches", "memory://dspark", "memory://"])
def test_url_cache_dirs_round_trip(cache_dir):
    got = cache_path(config(cache_dir), FINGERPRINT, "train")
    assert got.startswith(cache_dir) and got.endswith("0123456789ab/train_cache")
    assert got == (cache_dir if cache_dir.endswith("://") else cache_dir + "/") + "0123456789ab/train_cache"


def test_local_paths_unchanged(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_JAX_CACHE", str(tmp_path / "env"))
    assert cache_path(config(), FINGERPRINT, "val") == str(
        tmp_path / "env" / "smoke" / "0123456789ab" / "val_cache"
    )
    monkeypatch.delenv("DSPARK_JAX_CACHE")
    assert cache_path(config(), FINGERPRINT, "val") == str(
        Path.home() / ".cache" / "dspark_jax" / "smoke" / "0123456789ab" / "val_cache"
    )
    for cache_dir in ("relative/dir/", "./here", str(tmp_path) + "//x"):
        assert cache_path(config(cache_dir), FINGERPRINT, "train") == str(
            Path(cache_dir) / "0123456789ab" / "train_cache"
        )
        assert replies_path(config(cache_dir), FINGERPRINT, "train") == str(
            Path(cache_dir) / "0123456789ab" / "train_replies.jsonl"
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
    assert (tmp_path / "caches" / "0123456789ab" / "train_cache" / "manifest.json").is_file()


def test_cache_written_to_file_url_cache_path_reads_back(tmp_path, monkeypatch):
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    root = tmp_path / "caches"
    path = cache_path(config(root.as_uri()), FINGERPRINT, "train")
    assert path == root.as_uri() + "/0123456789ab/train_cache"
    write_and_read_back(path)
    assert not (tmp_path / "cwd" / "file:").exists(), "the cache went to ./file:, not to the URL's path"
    assert (root / "0123456789ab" / "train_cache" / "manifest.json").is_file()


def test_cache_written_to_memory_url_cache_path_reads_back(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = cache_path(config("memory://dspark"), FINGERPRINT, "train")
    assert path == "memory://dspark/0123456789ab/train_cache"
    write_and_read_back(path)
    assert not (tmp_path / "memory:").exists(), "the cache went to ./memory:, not to memory"
