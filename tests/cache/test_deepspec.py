"""DeepSpec v2 cache: round trip through write_deepspec_cache / DeepSpecDataSource, detection."""

from __future__ import annotations

import pickle
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_cache import assert_same_sample, make_samples

from dspark_jax import cache
from dspark_jax.cache import deepspec


def test_round_trip(tmp_path):
    samples = make_samples(7, seed=3)
    cache.write_deepspec_cache(
        str(tmp_path), samples, hidden_size=16, aux_layer_ids=(2, 5, 7), samples_per_shard=3
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "manifest.json",
        "samples.idx",
        "shard_00000.bin",
        "shard_00001.bin",
        "shard_00002.bin",
    ]
    assert (tmp_path / "samples.idx").stat().st_size == 7 * 56
    ds = cache.open_cache(str(tmp_path), expect={"aux_layer_ids": [2, 5, 7], "hidden_size": 16})
    assert isinstance(ds, cache.DeepSpecDataSource) and len(ds) == 7
    ds = pickle.loads(pickle.dumps(ds))
    for i, s in enumerate(samples):
        assert_same_sample(ds[i], s)
    assert deepspec.verify_deepspec(str(tmp_path)) == 7


def test_record_layout(tmp_path):
    samples = make_samples(2, seed=4)
    cache.write_deepspec_cache(
        str(tmp_path), samples, hidden_size=16, aux_layer_ids=(2, 5, 7), samples_per_shard=1
    )
    raw = (tmp_path / "samples.idx").read_bytes()
    sid, shard, t, o_ids, o_att, o_loss, o_hid, o_last = struct.unpack("<QIIQQQQQ", raw[56:112])
    assert o_loss == o_att + t
    assert (sid, shard, t) == (1, 1, len(samples[1]["input_ids"]))
    blob = (tmp_path / "shard_00001.bin").read_bytes()
    np.testing.assert_array_equal(np.frombuffer(blob[o_ids : o_ids + 4 * t], "<i4"), samples[1]["input_ids"])
    assert blob[o_att : o_att + t] == b"\x01" * t
    assert o_last - o_hid == t * 3 * 16 * 2 and len(blob) == o_last + t * 16 * 2


def test_mismatch_and_truncation(tmp_path):
    cache.write_deepspec_cache(
        str(tmp_path), make_samples(3), hidden_size=16, aux_layer_ids=(2, 5, 7), samples_per_shard=2
    )
    with pytest.raises(ValueError, match="mismatch on hidden_size: expected 32, found 16"):
        cache.DeepSpecDataSource(str(tmp_path), expect={"hidden_size": 32})
    f = tmp_path / "shard_00001.bin"
    f.write_bytes(f.read_bytes()[:-5])
    with pytest.raises(ValueError, match=r"sample 2 .*corrupt"):
        deepspec.verify_deepspec(str(tmp_path))
