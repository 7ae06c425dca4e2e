"""DeepSpec v2 cache: reading caches laid out as DeepSpec's writer lays them out, the project's
writer producing that exact layout, validation errors, detection and verification."""

from __future__ import annotations

import json
import logging
import pickle
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_cache import assert_same_sample, make_samples

from dspark_jax import cache
from dspark_jax.interop import deepspec_cache as deepspec
from dspark_jax.run.sources import open_cache

H = 16
LAYERS = [-1, 4, 9]  # make_samples has 3 aux layers; -1 (embedding output) sorts first
TARGET = "Qwen/Qwen3-8B"
MANIFEST_KEYS = [
    "hidden_dtype",
    "hidden_size",
    "index_record_size",
    "mask_dtype",
    "num_samples",
    "num_shards",
    "shards",
    "target_layer_ids",
    "target_model_name_or_path",
    "token_dtype",
    "version",
]


def write_reference_cache(path: Path, samples, shard_sizes, layers=LAYERS, extra=None) -> dict:
    """A cache in the layout DeepSpec's writer produces, written by hand (independent of
    ``write_deepspec_cache``): ``shard_sizes[s]`` samples go to ``shard-%05d.bin`` s. Returns the
    manifest dict."""
    assert sum(shard_sizes) == len(samples)
    path.mkdir(parents=True, exist_ok=True)
    records, i = [], 0
    for shard, count in enumerate(shard_sizes):
        blob = b""
        for _ in range(count):
            s = samples[i]
            t = len(s["input_ids"])
            offsets = []
            for data in (
                s["input_ids"].astype("<i4").tobytes(),
                b"\x01" * t,
                s["loss_mask"].astype("u1").tobytes(),
                s["aux_hidden"].view("<u2").reshape(t, -1).tobytes(),
                s["last_hidden"].view("<u2").tobytes(),
            ):
                offsets.append(len(blob))
                blob += data
            records.append(struct.pack("<QIIQQQQQ", i, shard, t, *offsets))
            i += 1
        (path / f"shard-{shard:05d}.bin").write_bytes(blob)
    (path / "samples.idx").write_bytes(b"".join(records))
    manifest = {
        "version": 2,
        "num_samples": len(samples),
        "num_shards": len(shard_sizes),
        "target_layer_ids": list(layers),
        "hidden_dtype": "bfloat16",
        "token_dtype": "int32",
        "mask_dtype": "uint8",
        "index_record_size": 56,
        "hidden_size": int(samples[0]["last_hidden"].shape[-1]),
        "shards": [{"shard_id": s, "file_name": f"shard-{s:05d}.bin"} for s in range(len(shard_sizes))],
        "target_model_name_or_path": TARGET,
        # provenance keys DeepSpec's prepare script adds; readers must ignore them
        "source_jsonl_paths": ["/data/train.jsonl"],
        "chat_template": "qwen3",
        "max_length": 2048,
        "min_loss_tokens": 14,
        "project_name": None,
        "exp_name": "prep",
        "git_sha": "0123abcd",
        **(extra or {}),
    }
    write_manifest(path, manifest)
    return manifest


def write_manifest(path: Path, manifest: dict) -> None:
    with open(path / "manifest.json", "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2, sort_keys=True)


@pytest.fixture
def ref(tmp_path):
    samples = make_samples(5, seed=11)
    manifest = write_reference_cache(tmp_path, samples, [2, 1, 2])
    return tmp_path, samples, manifest


def test_reads_reference_layout(ref):
    path, samples, _ = ref
    ds = open_cache(str(path), expect={"aux_layer_ids": tuple(LAYERS), "hidden_size": H})
    assert isinstance(ds, deepspec.DeepSpecDataSource) and len(ds) == 5
    assert ds.aux_layer_ids == LAYERS and ds.num_aux == 3 and ds.hidden_size == H
    ds = pickle.loads(pickle.dumps(ds))
    for i, s in enumerate(samples):
        assert_same_sample(ds[i], s)
    assert deepspec.verify_deepspec(str(path)) == 5
    with pytest.raises(IndexError, match="out of range"):
        ds[5]


def test_writer_emits_deepspec_layout(tmp_path):
    samples = make_samples(5, seed=11)
    ours, ref = tmp_path / "ours", tmp_path / "ref"
    deepspec.write_deepspec_cache(
        str(ours), samples, H, LAYERS, samples_per_shard=2, target_model_name_or_path=TARGET
    )
    expected = {
        "version": 2,
        "num_samples": 5,
        "num_shards": 3,
        "target_layer_ids": [-1, 4, 9],
        "hidden_dtype": "bfloat16",
        "token_dtype": "int32",
        "mask_dtype": "uint8",
        "index_record_size": 56,
        "hidden_size": 16,
        "shards": [
            {"shard_id": 0, "file_name": "shard-00000.bin"},
            {"shard_id": 1, "file_name": "shard-00001.bin"},
            {"shard_id": 2, "file_name": "shard-00002.bin"},
        ],
        "target_model_name_or_path": "Qwen/Qwen3-8B",
    }
    # DeepSpec's atomic_json_dump: json.dump(indent=2, sort_keys=True), no trailing newline
    assert (ours / "manifest.json").read_text() == json.dumps(expected, indent=2, sort_keys=True)
    assert sorted(json.loads((ours / "manifest.json").read_text())) == MANIFEST_KEYS
    names = ["manifest.json", "samples.idx", "shard-00000.bin", "shard-00001.bin", "shard-00002.bin"]
    assert sorted(p.name for p in ours.iterdir()) == names
    # every data file byte-identical to the hand-written DeepSpec layout
    write_reference_cache(ref, samples, [2, 2, 1])
    for name in names[1:]:
        assert (ours / name).read_bytes() == (ref / name).read_bytes(), name


def test_round_trip(tmp_path):
    samples = make_samples(7, seed=3)
    deepspec.write_deepspec_cache(
        str(tmp_path), samples, hidden_size=16, aux_layer_ids=(2, 5, 7), samples_per_shard=3
    )
    assert (tmp_path / "samples.idx").stat().st_size == 7 * 56
    assert json.loads((tmp_path / "manifest.json").read_text())["target_model_name_or_path"] == ""
    ds = open_cache(str(tmp_path), expect={"aux_layer_ids": [2, 5, 7], "hidden_size": 16})
    assert isinstance(ds, deepspec.DeepSpecDataSource) and len(ds) == 7
    ds = pickle.loads(pickle.dumps(ds))
    for i, s in enumerate(samples):
        assert_same_sample(ds[i], s)
    assert deepspec.verify_deepspec(str(tmp_path)) == 7


def test_record_layout(tmp_path):
    samples = make_samples(2, seed=4)
    deepspec.write_deepspec_cache(
        str(tmp_path), samples, hidden_size=16, aux_layer_ids=(2, 5, 7), samples_per_shard=1
    )
    raw = (tmp_path / "samples.idx").read_bytes()
    sid, shard, t, o_ids, o_att, o_loss, o_hid, o_last = struct.unpack("<QIIQQQQQ", raw[56:112])
    assert o_ids == 0 and o_att == 4 * t and o_loss == o_att + t and o_hid == o_loss + t
    assert (sid, shard, t) == (1, 1, len(samples[1]["input_ids"]))
    blob = (tmp_path / "shard-00001.bin").read_bytes()
    np.testing.assert_array_equal(np.frombuffer(blob[o_ids : o_ids + 4 * t], "<i4"), samples[1]["input_ids"])
    assert blob[o_att : o_att + t] == b"\x01" * t
    assert o_last - o_hid == t * 3 * 16 * 2 and len(blob) == o_last + t * 16 * 2
    # target_hidden_states [T, n_aux*H]: the layers' states concatenated per token, in layer order
    hid = np.frombuffer(blob[o_hid:o_last], "<u2").reshape(t, 3 * 16)
    np.testing.assert_array_equal(hid[:, 16:32], samples[1]["aux_hidden"][:, 1].view("<u2"))


def test_writer_rejects_unsorted_layers(tmp_path):
    with pytest.raises(ValueError, match="ascending"):
        deepspec.write_deepspec_cache(str(tmp_path), make_samples(1), 16, (5, 2, 7), samples_per_shard=1)


def test_expect(ref, caplog):
    path = str(ref[0])
    with pytest.raises(ValueError, match="mismatch on hidden_size: expected 32, found 16"):
        deepspec.DeepSpecDataSource(path, expect={"hidden_size": 32})
    with pytest.raises(
        ValueError, match=r"mismatch on aux_layer_ids: expected \(2, 5, 7\), found \[-1, 4, 9\]"
    ):
        open_cache(path, expect={"aux_layer_ids": (2, 5, 7)})
    with pytest.raises(ValueError, match="unknown expect key 'bogus'"):
        deepspec.DeepSpecDataSource(path, expect={"bogus": 1})
    with caplog.at_level(logging.WARNING):
        deepspec.DeepSpecDataSource(
            path, expect={"tokenizer_fingerprint": "tok0", "target_fingerprint": "t0"}
        )
    warned = [r.getMessage() for r in caplog.records if "does not record" in r.getMessage()]
    assert len(warned) == 2 and "tokenizer_fingerprint" in warned[0] and "target_fingerprint" in warned[1]


def test_detection(ref, tmp_path):
    _, _, manifest = ref
    assert deepspec.is_deepspec(manifest)
    assert not deepspec.is_deepspec({"format": "dspark_jax", "format_version": 1})
    assert not deepspec.is_deepspec({"version": 2, "format": "dspark_jax", "index_record_size": 56})
    native = tmp_path / "native"
    from test_cache import SPEC, build

    build(str(native), make_samples(2), SPEC)
    cache.finalize(str(native))
    assert isinstance(open_cache(str(native)), cache.CacheDataSource)


def _drop(key):
    return lambda m: m.pop(key)


def _set(key, value):
    return lambda m: m.update({key: value})


BAD_MANIFESTS = {
    **{f"missing-{k}": (_drop(k), rf"lacks key\(s\) '{k}'") for k in MANIFEST_KEYS},
    "version": (_set("version", 3), r"key 'version' is 3, DeepSpec v2 requires 2"),
    "hidden_dtype": (_set("hidden_dtype", "float16"), r"key 'hidden_dtype' is 'float16'.*'bfloat16'"),
    "token_dtype": (_set("token_dtype", "int64"), r"key 'token_dtype' is 'int64'.*'int32'"),
    "mask_dtype": (_set("mask_dtype", "bool"), r"key 'mask_dtype' is 'bool'.*'uint8'"),
    "record_size": (_set("index_record_size", 48), r"key 'index_record_size' is 48, DeepSpec v2 requires 56"),
    "hidden_size": (_set("hidden_size", 0), r"key 'hidden_size' is 0"),
    "unsorted_layers": (
        _set("target_layer_ids", [4, -1, 9]),
        r"key 'target_layer_ids' is \[4, -1, 9\].*ascending",
    ),
    "empty_layers": (_set("target_layer_ids", []), r"key 'target_layer_ids' is \[\].*non-empty"),
    "target": (_set("target_model_name_or_path", 7), r"key 'target_model_name_or_path' is 7"),
    "shard_count": (_set("num_shards", 2), r"key 'num_shards' is 2 but key 'shards' lists 3"),
    "shard_ids": (
        lambda m: m["shards"][1].update(shard_id=2),
        r"key 'shards'\[1\] has shard_id 2.*contiguous.*expected 1",
    ),
    "num_samples": (_set("num_samples", 6), r"samples.idx holds 5 records.*key 'num_samples' is 6"),
}


@pytest.mark.parametrize("case", list(BAD_MANIFESTS))
def test_bad_manifest(ref, case):
    path, _, manifest = ref
    mutate, match = BAD_MANIFESTS[case]
    mutate(manifest)
    write_manifest(path, manifest)
    with pytest.raises(ValueError, match=rf"^cache '{path}': .*{match}"):
        deepspec.DeepSpecDataSource(str(path))


def _rewrite_record(path: Path, i: int, **fields) -> None:
    raw = bytearray((path / "samples.idx").read_bytes())
    rec = dict(zip(deepspec.RECORD.names, struct.unpack_from("<QIIQQQQQ", raw, 56 * i), strict=True))
    rec.update(fields)
    struct.pack_into("<QIIQQQQQ", raw, 56 * i, *rec.values())
    (path / "samples.idx").write_bytes(bytes(raw))


BAD_FILES = {
    "missing_shard": (
        lambda p: (p / "shard-00001.bin").unlink(),
        FileNotFoundError,
        r"shard file\(s\) 'shard-00001.bin' named in manifest.json key 'shards' are missing",
    ),
    "missing_index": (lambda p: (p / "samples.idx").unlink(), FileNotFoundError, "samples.idx is missing"),
    "index_size": (
        lambda p: (p / "samples.idx").write_bytes((p / "samples.idx").read_bytes()[:-10]),
        ValueError,
        r"samples.idx holds 270 bytes, not a multiple of manifest.json key 'index_record_size' \(56\)",
    ),
    "index_short": (
        lambda p: (p / "samples.idx").write_bytes((p / "samples.idx").read_bytes()[:-56]),
        ValueError,
        r"samples.idx holds 4 records \(224 bytes\), manifest.json key 'num_samples' is 5",
    ),
    "sample_id": (
        lambda p: _rewrite_record(p, 3, sample_id=4),
        ValueError,
        r"samples.idx record 3 has sample_id 4, DeepSpec v2 requires sample_id == record index",
    ),
    "shard_id": (
        lambda p: _rewrite_record(p, 2, shard_id=3),
        ValueError,
        r"samples.idx record 2 has shard_id 3, but manifest.json key 'num_shards' is 3",
    ),
    "seq_len": (lambda p: _rewrite_record(p, 0, seq_len=0), ValueError, r"record 0 has seq_len 0"),
    "not_json": (
        lambda p: (p / "manifest.json").write_text("{"),
        ValueError,
        r"manifest.json is not valid JSON",
    ),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_bad_files(ref, case):
    path, _, _ = ref
    mutate, error, match = BAD_FILES[case]
    mutate(path)
    with pytest.raises(error, match=rf"^cache '{path}': .*{match}"):
        deepspec.DeepSpecDataSource(str(path))


def test_truncated_shard(ref):
    path, _, _ = ref
    f = path / "shard-00002.bin"
    f.write_bytes(f.read_bytes()[:-5])
    ds = deepspec.DeepSpecDataSource(str(path))  # opening does not read the data
    ds[3]
    with pytest.raises(
        ValueError,
        match=r"sample 4: target_last_hidden_states bytes \[\d+, \d+\) not readable from shard file "
        r"'shard-00002.bin' \(OUT_OF_RANGE",
    ):
        ds[4]


def test_verify_reports_every_bad_sample(ref):
    path, samples, _ = ref
    for name in ("shard-00000.bin", "shard-00002.bin"):  # shards 0 and 2 hold samples 0-1 and 3-4
        f = path / name
        t = len(samples[1 if name.endswith("0.bin") else 4]["input_ids"])
        f.write_bytes(f.read_bytes()[: -(t * H * 2 * 4 + 1)])  # cut into both samples' hidden states
    n, problems = deepspec.scan_deepspec(str(path))
    assert n == 5 and [p.split(":")[0] for p in problems] == ["sample 1", "sample 4"]
    assert "'shard-00000.bin'" in problems[0] and "'shard-00002.bin'" in problems[1]
    assert "target_hidden_states" in problems[0] and "target_last_hidden_states" in problems[0]
    with pytest.raises(ValueError, match=r"2 of 5 samples are corrupt: sample 1: .*; sample 4: "):
        deepspec.verify_deepspec(str(path))
