"""Native cache: round trip, crash/resume, multi-process builds and bad input."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from dspark_jax import cache
from dspark_jax.cache import format as fmt

A, H = 3, 16
SPEC = cache.CacheSpec(
    aux_layer_ids=(2, 5, 7),
    hidden_size=H,
    num_shards=1,
    target={"fingerprint": "t0"},
    tokenizer_fingerprint="tok0",
    chunk_tokens=32,
)


def make_samples(n: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Random samples of varied length; hidden states include -0.0, +-inf and subnormals."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        t = int(rng.integers(1, 50))
        aux = rng.standard_normal((t, A, H)).astype(ml_dtypes.bfloat16)
        specials = np.array([-0.0, np.inf, -np.inf, 1e-40], ml_dtypes.bfloat16)
        aux.flat[: min(4, aux.size)] = specials[: aux.size]
        out.append(
            {
                "input_ids": rng.integers(0, 50_000, t).astype(np.int32),
                "loss_mask": rng.integers(0, 2, t).astype(np.uint8),
                "aux_hidden": aux,
                "last_hidden": rng.standard_normal((t, H)).astype(ml_dtypes.bfloat16),
            }
        )
    return out


def build(path: str, samples, spec: cache.CacheSpec, shards=None, batch: int = 2, sleep: float = 0.0) -> int:
    """Writes `shards` (all by default) the way the cache builder does, each from where its writer says
    it stopped; returns the number of samples this call appended."""
    layout = cache.create_or_open(path, spec, len(samples))
    appended = 0
    for s in range(spec.num_shards) if shards is None else shards:
        w = cache.ShardWriter(path, s)
        idx = list(layout.shard_sample_range(s))[w.samples_done :]
        for i in range(0, len(idx), batch):
            w.append([samples[j] for j in idx[i : i + batch]])
            appended += len(idx[i : i + batch])
            print("committed", w.samples_done, flush=True)
            time.sleep(sleep)
        w.finalize_shard()
    return appended


def assert_same_sample(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        bits = np.uint16 if want[k].dtype == fmt.BF16 else want[k].dtype
        np.testing.assert_array_equal(got[k].view(bits), want[k].view(bits), err_msg=k)


def tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("num_shards", [1, 3, 8])
def test_round_trip_bit_exact(tmp_path, num_shards):
    samples = make_samples(7)
    spec = cache.CacheSpec(**{**SPEC.to_json(), "num_shards": num_shards})
    build(str(tmp_path), samples, spec, batch=3)
    m = cache.finalize(str(tmp_path))
    assert m["complete"] and m["num_samples"] == 7
    assert m["num_tokens"] == sum(len(s["input_ids"]) for s in samples)
    ds = cache.CacheDataSource(str(tmp_path), expect={"aux_layer_ids": (2, 5, 7), "hidden_size": H})
    assert len(ds) == 7
    ds = pickle.loads(pickle.dumps(ds))
    for i, s in enumerate(samples):
        assert_same_sample(ds[i], s)
    assert cache.verify(str(tmp_path)) == 7


def test_estimate_counts_every_token_array():
    assert cache.estimate_bytes(10, SPEC) == 10 * (4 + 1 + 2 * A * H + 2 * H) + 8 * SPEC.num_shards


def test_a_cache_of_the_first_layout_opens_and_a_filled_optional_array_is_refused(tmp_path):
    """Manifests written before 2026-12 record the width of an optional per-token array that no writer ever
    filled (null): such a cache still opens, resumes and verifies; a non-null width is refused by name."""
    samples = make_samples(3)
    build(str(tmp_path), samples, SPEC)
    cache.finalize(str(tmp_path))
    kv = fmt.open_kvstore(str(tmp_path))
    manifest = fmt.read_json(kv, fmt.MANIFEST)
    fmt.write_json(kv, fmt.MANIFEST, {**manifest, "spec": {**manifest["spec"], "engram_dim": None}})
    ds = cache.CacheDataSource(str(tmp_path), expect={"hidden_size": H})
    for i, s in enumerate(samples):
        assert_same_sample(ds[i], s)
    assert cache.verify(str(tmp_path)) == 3
    cache.create_or_open(str(tmp_path), SPEC, 3)  # the same cache for a builder of this layout
    fmt.write_json(kv, fmt.MANIFEST, {**manifest, "spec": {**manifest["spec"], "engram_dim": 4}})
    with pytest.raises(ValueError, match=r"records \{'engram_dim': 4\}.*rebuild it"):
        cache.CacheDataSource(str(tmp_path))


def test_shard_ranges_cover_in_order():
    got = [i for s in range(4) for i in cache.format.shard_sample_range(s, 10, 4)]
    assert got == list(range(10))


WRITER = """
import sys
sys.path.insert(0, {testdir!r})
from test_cache import SPEC, build, make_samples, cache
spec = cache.CacheSpec(**{{**SPEC.to_json(), "num_shards": {num_shards}}})
build({path!r}, make_samples({n}), spec, shards={shards}, batch=2, sleep={sleep})
"""


def spawn(path, n, num_shards, shards, sleep):
    code = WRITER.format(
        testdir=str(Path(__file__).parent), path=path, n=n, num_shards=num_shards, shards=shards, sleep=sleep
    )
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def test_sigkill_resume_equals_uninterrupted(tmp_path):
    n = 12
    ref, crashed = tmp_path / "ref", tmp_path / "crashed"
    samples = make_samples(n)
    spec = cache.CacheSpec(**{**SPEC.to_json(), "num_shards": 2})
    build(str(ref), samples, spec, batch=2)
    cache.finalize(str(ref))

    proc = spawn(str(crashed), n, 2, [0, 1], sleep=0.3)
    commits = 0
    while commits < 2:
        assert proc.stdout.readline().startswith("committed")
        commits += 1
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    # The uncommitted state is invisible; the committed prefix is readable.
    with pytest.raises(ValueError, match="incomplete"):
        cache.CacheDataSource(str(crashed))
    part = cache.CacheDataSource(str(crashed), allow_incomplete=True)
    assert 4 <= len(part) < n
    for i in range(len(part)):
        assert_same_sample(part[i], samples[i])
    # Resume with a different batching: checksums do not depend on it. Only the samples after the
    # committed prefix are written again (a writer that restarted from 0 ends with the same bytes).
    assert build(str(crashed), samples, spec, batch=3) == n - len(part)
    cache.finalize(str(crashed))
    assert tree(crashed) == tree(ref)


def test_two_processes_disjoint_shards_equal_one(tmp_path):
    n = 10
    one, two = tmp_path / "one", tmp_path / "two"
    samples = make_samples(n)
    spec = cache.CacheSpec(**{**SPEC.to_json(), "num_shards": 4})
    build(str(one), samples, spec)
    cache.finalize(str(one))
    procs = [spawn(str(two), n, 4, shards, sleep=0.0) for shards in ([0, 2], [1, 3])]
    for p in procs:
        p.communicate()
        assert p.returncode == 0
    cache.finalize(str(two))
    assert tree(two) == tree(one)


def test_missing_manifest(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"manifest\.json"):
        cache.CacheDataSource(str(tmp_path))


def finalized(tmp_path, n=6, num_shards=2):
    samples = make_samples(n)
    build(str(tmp_path), samples, cache.CacheSpec(**{**SPEC.to_json(), "num_shards": num_shards}))
    cache.finalize(str(tmp_path))
    return samples


def chunk_files(tmp_path, shard, name):
    return sorted(p for p in (tmp_path / "shards" / f"{shard:05d}" / name / "c").rglob("*") if p.is_file())


def test_flipped_byte_detected(tmp_path):
    finalized(tmp_path)
    f = chunk_files(tmp_path, 1, "aux_hidden")[0]
    data = bytearray(f.read_bytes())
    data[100] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(cache.CacheCorruptError, match=r"shard 1: .*aux_hidden.*samples 0\.\."):
        cache.verify(str(tmp_path))


def test_truncated_and_deleted_chunks_detected(tmp_path):
    finalized(tmp_path)
    f = chunk_files(tmp_path, 0, "last_hidden")[-1]
    f.write_bytes(f.read_bytes()[:10])
    with pytest.raises(cache.CacheCorruptError, match="shard 0: cannot read last_hidden"):
        cache.verify(str(tmp_path))
    f.unlink()  # a missing chunk is a read error, never a block of zeros
    with pytest.raises(cache.CacheCorruptError, match=r"shard 0: cannot read last_hidden .* is missing"):
        cache.verify(str(tmp_path))
    with pytest.raises(cache.CacheCorruptError, match=r"shard 0: sample \d+ .* last_hidden .* is missing"):
        source = cache.CacheDataSource(str(tmp_path))
        [source[i] for i in range(len(source))]


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("aux_layer_ids", (1, 2, 3)),
        ("hidden_size", 32),
        ("tokenizer_fingerprint", "other"),
        ("target_fingerprint", "t1"),
    ],
)
def test_expect_mismatch(tmp_path, key, value):
    finalized(tmp_path)
    with pytest.raises(ValueError, match=f"mismatch on {key}: expected .*, found"):
        cache.CacheDataSource(str(tmp_path), expect={key: value})


def test_spec_mismatch_on_reopen(tmp_path):
    cache.create_or_open(str(tmp_path), SPEC, 5)
    with pytest.raises(ValueError, match="different hidden_size: found 16, requested 8"):
        cache.create_or_open(str(tmp_path), cache.CacheSpec(**{**SPEC.to_json(), "hidden_size": 8}), 5)
    with pytest.raises(ValueError, match="different num_samples"):
        cache.create_or_open(str(tmp_path), SPEC, 6)


def test_empty_cache(tmp_path):
    cache.create_or_open(str(tmp_path), SPEC, 0)
    cache.ShardWriter(str(tmp_path), 0).finalize_shard()
    cache.finalize(str(tmp_path))
    with pytest.raises(ValueError, match="0 samples"):
        cache.CacheDataSource(str(tmp_path))


def test_incomplete_finalize_rejected(tmp_path):
    cache.create_or_open(str(tmp_path), SPEC, 4)
    w = cache.ShardWriter(str(tmp_path), 0)
    w.append(make_samples(2))
    with pytest.raises(ValueError, match=r"2 of 4 samples"):
        w.finalize_shard()
    with pytest.raises(ValueError, match=r"shards \[0\] are not complete"):
        cache.finalize(str(tmp_path))


@pytest.mark.parametrize(
    ("field", "bad", "match"),
    [
        ("aux_hidden", lambda s: s["aux_hidden"][:, :2], "'aux_hidden' has shape"),
        ("last_hidden", lambda s: s["last_hidden"][:-1], "'last_hidden' has shape"),
        ("loss_mask", lambda s: s["loss_mask"][None], "'loss_mask' has shape"),
        ("input_ids", lambda s: s["input_ids"].astype(np.float32), "'input_ids' must be integer"),
        ("last_hidden", None, r"missing field\(s\) \['last_hidden'\]"),
    ],
)
def test_inconsistent_sample_rejected(tmp_path, field, bad, match):
    cache.create_or_open(str(tmp_path), SPEC, 2)
    w = cache.ShardWriter(str(tmp_path), 0)
    s = make_samples(2)
    if bad is None:
        del s[1][field]
    else:
        s[1][field] = bad(s[1])
    with pytest.raises(ValueError, match=f"sample 1: .*{match}"):
        w.append(s)
    assert w.samples_done == 0


def test_token_counts_count_the_response_tokens_of_every_shard(tmp_path):
    """`token_counts` against numpy over the samples as written (two shards, only `loss_mask` 1 counted)."""
    samples = finalized(tmp_path, n=7, num_shards=2)
    want = np.zeros(50_000, np.int64)
    for s in samples:
        np.add.at(want, s["input_ids"][s["loss_mask"] != 0], 1)
    got = cache.CacheDataSource(str(tmp_path), read_states=False).token_counts(50_000)
    np.testing.assert_array_equal(got, want)
    with pytest.raises(cache.CacheCorruptError, match=r"token ids outside 0\.\.999: the cache is of another"):
        cache.CacheDataSource(str(tmp_path)).token_counts(1_000)
