"""inspect_cache on both formats: summary JSON, --verify, --dump_sample (the command itself runs in
`tests/test_new_user.py`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_cache import SPEC, assert_same_sample, build, chunk_files, make_samples
from test_deepspec import LAYERS, TARGET, H, write_reference_cache

from dspark_jax import cache, inspect_cache
from dspark_jax.interop import deepspec_cache as deepspec
from dspark_jax.run.sources import open_cache


def run(capsys, path, **options) -> tuple[int, str, str]:
    rc = inspect_cache.inspect(str(path), **options)
    out = capsys.readouterr()
    return rc, out.out, out.err


def summary(out: str) -> dict:
    return json.loads(out[: out.rindex("}") + 1])


def check_dump(path: Path, sample: dict) -> None:
    with np.load(path) as z:
        assert sorted(z.files) == ["aux_hidden", "input_ids", "last_hidden", "loss_mask"]
        np.testing.assert_array_equal(z["input_ids"], sample["input_ids"])
        np.testing.assert_array_equal(z["loss_mask"], sample["loss_mask"])
        assert z["aux_hidden"].dtype == np.float32 and z["aux_hidden"].shape == sample["aux_hidden"].shape
        np.testing.assert_array_equal(z["aux_hidden"], sample["aux_hidden"].astype(np.float32))
        np.testing.assert_array_equal(z["last_hidden"], sample["last_hidden"].astype(np.float32))


def test_native(tmp_path, capsys):
    path = tmp_path / "c"
    samples = make_samples(5)
    build(str(path), samples, SPEC)
    capsys.readouterr()
    rc, out, _ = run(capsys, path)
    s = summary(out)
    assert rc == 0 and s["format"] == "dspark_jax" and s["complete"] is False and s["committed_samples"] == 5
    cache.finalize(str(path))
    rc, out, _ = run(capsys, path, verify=True, dump_sample=3, output=str(tmp_path / "s.npz"))
    s = summary(out)
    assert rc == 0 and "verify: OK (5 samples)" in out
    assert s["num_samples"] == 5 and s["aux_layer_ids"] == [2, 5, 7] and s["hidden_size"] == 16
    assert s["target"] == {"fingerprint": "t0"} and s["complete"] is True
    assert s["dtypes"]["aux_hidden"] == "bfloat16"
    check_dump(tmp_path / "s.npz", samples[3])
    f = chunk_files(path, 0, "input_ids")[0]
    data = bytearray(f.read_bytes())
    data[0] ^= 1
    f.write_bytes(bytes(data))
    with pytest.raises(cache.CacheCorruptError, match=r"shard 0.*input_ids"):
        run(capsys, path, verify=True)


def test_deepspec(tmp_path, capsys):
    samples = make_samples(4, seed=1)
    deepspec.write_deepspec_cache(
        str(tmp_path / "d"), samples, 16, (2, 5, 7), samples_per_shard=2, target_model_name_or_path="tgt"
    )
    rc, out, _ = run(capsys, tmp_path / "d", verify=True, dump_sample=2, output=str(tmp_path / "d.npz"))
    s = summary(out)
    assert rc == 0 and s["format"] == "deepspec" and s["num_samples"] == 4 and s["hidden_size"] == 16
    assert s["aux_layer_ids"] == [2, 5, 7] and s["target"] == "tgt" and s["num_shards"] == 2
    assert s["num_tokens"] == sum(len(x["input_ids"]) for x in samples) and "verify: OK (4 samples)" in out
    check_dump(tmp_path / "d.npz", samples[2])


def test_deepspec_reference_layout(tmp_path, capsys):
    """A cache laid out by hand exactly as DeepSpec's writer lays it out (with provenance keys)."""
    path = tmp_path / "ref"
    samples = make_samples(6, seed=5)
    write_reference_cache(path, samples, [1, 3, 2])
    rc, out, err = run(capsys, path, verify=True)
    s = summary(out)
    assert rc == 0 and err == "" and "verify: OK (6 samples)" in out
    assert s["format"] == "deepspec" and s["num_samples"] == 6 and s["num_shards"] == 3
    assert s["aux_layer_ids"] == LAYERS and s["num_aux_layers"] == 3 and s["hidden_size"] == H
    assert s["target"] == TARGET and s["num_tokens"] == sum(len(x["input_ids"]) for x in samples)
    for i in (0, 3, 5):
        rc, out, _ = run(capsys, path, dump_sample=i, output=str(tmp_path / f"{i}.npz"))
        assert rc == 0 and f"wrote sample {i}" in out
        check_dump(tmp_path / f"{i}.npz", samples[i])
    ds = open_cache(str(path))
    for i, x in enumerate(samples):
        assert_same_sample(ds[i], x)


def test_deepspec_verify_reports_all(tmp_path, capsys):
    path = tmp_path / "ref"
    samples = make_samples(6, seed=5)
    write_reference_cache(path, samples, [1, 3, 2])
    for name in ("shard-00000.bin", "shard-00002.bin"):  # the last samples of shards 0 and 2: 0 and 5
        f = path / name
        f.write_bytes(f.read_bytes()[:-3])
    rc, _, err = run(capsys, path, verify=True, dump_sample=1, output=str(tmp_path / "x.npz"))
    lines = err.strip().splitlines()
    assert rc == 1 and len(lines) == 3 and not (tmp_path / "x.npz").exists()
    assert "sample 0: target_last_hidden_states" in lines[0] and "'shard-00000.bin'" in lines[0]
    assert "sample 5: target_last_hidden_states" in lines[1] and "'shard-00002.bin'" in lines[1]
    assert lines[2] == "verify: FAILED (2 of 6 samples corrupt)"
    (path / "shard-00001.bin").unlink()
    with pytest.raises(FileNotFoundError, match=r"shard-00001\.bin.*missing"):
        run(capsys, path, verify=True)


def test_missing(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match=r"manifest\.json"):
        run(capsys, tmp_path)


def test_native_verify_reports_every_bad_shard(tmp_path, capsys):
    """Damage in two shards: `--verify` names both (it does not stop at the first), exit status 1."""
    path = tmp_path / "c"
    build(str(path), make_samples(6), cache.CacheSpec(**{**SPEC.to_json(), "num_shards": 2}))
    cache.finalize(str(path))
    chunk_files(path, 0, "last_hidden")[0].unlink()
    damaged = chunk_files(path, 1, "aux_hidden")[0]
    damaged.write_bytes(damaged.read_bytes()[:7])
    capsys.readouterr()
    with pytest.raises(cache.CacheCorruptError, match=r"2 problem\(s\)") as error:
        run(capsys, path, verify=True)
    assert "shard 0: cannot read last_hidden" in str(error.value)
    assert "shard 1: cannot read aux_hidden" in str(error.value)
