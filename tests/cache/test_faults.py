"""Fault injection over a small native cache: every chunk file of every array deleted, truncated or
bit-flipped in turn. Each case ends in a clear error naming the shard and array, never a zero-filled or
wrong sample."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dspark_jax import cache
from tests.cache.test_cache import SPEC, assert_same_sample, build, make_samples

SAMPLES = make_samples(9, seed=5)


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("clean")
    spec = cache.CacheSpec(**{**SPEC.to_json(), "num_shards": 2, "chunk_tokens": 16})
    build(str(path), SAMPLES, spec, batch=4)
    cache.finalize(str(path))
    return path


def chunk_files(path: Path) -> list[Path]:
    """Every zarr chunk file of every shard array (metadata and progress records excluded)."""
    return sorted(p for p in path.glob("shards/*/*/c/**/*") if p.is_file())


def mutate(file: Path, how: str) -> None:
    data = file.read_bytes()
    if how == "delete":
        file.unlink()
    elif how == "truncate":
        file.write_bytes(data[: len(data) // 2])
    else:
        flipped = bytearray(data)
        flipped[len(data) // 3] ^= 0x10
        file.write_bytes(bytes(flipped))


def test_every_array_has_chunk_files(clean):
    arrays = {p.relative_to(clean).parts[2] for p in chunk_files(clean)}
    assert arrays == {"input_ids", "loss_mask", "aux_hidden", "last_hidden", "offsets"}


@pytest.mark.parametrize("how", ["delete", "truncate", "flip"])
def test_every_chunk_fault_is_caught(clean, tmp_path, how):
    files = chunk_files(clean)
    assert len(files) > 20
    for index, original in enumerate(files):
        broken = tmp_path / f"{how}{index}"
        shutil.copytree(clean, broken)
        target = broken / original.relative_to(clean)
        shard, array = target.relative_to(broken).parts[1:3]
        mutate(target, how)
        with pytest.raises(cache.CacheCorruptError, match=rf"shard {int(shard)}\b.*{array}"):
            cache.verify(str(broken))
        # Reading: every sample either fails naming shard and array, or equals the original.
        try:
            source = cache.CacheDataSource(str(broken))
        except cache.CacheCorruptError as e:
            assert array in str(e) and f"shard {int(shard)}" in str(e)
            continue
        failures = 0
        for i, want in enumerate(SAMPLES):
            try:
                got = source[i]
            except cache.CacheCorruptError as e:
                assert array in str(e) and f"shard {int(shard)}" in str(e) and f"sample {i}" in str(e), e
                failures += 1
                continue
            assert_same_sample(got, want)
        assert failures, f"{how} {target.relative_to(broken)}: every sample still read"
        shutil.rmtree(broken)
