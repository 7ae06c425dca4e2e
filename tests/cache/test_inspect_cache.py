"""inspect_cache CLI on both formats: summary JSON, --verify, --dump_sample."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from test_cache import SPEC, build, chunk_files, make_samples

from dspark_jax import cache, inspect_cache


def run(capsys, *argv) -> tuple[int, str, str]:
    rc = inspect_cache.main([str(a) for a in argv])
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
    rc, out, _ = run(capsys, path, "--verify", "--dump_sample=3", f"--output={tmp_path / 's.npz'}")
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
    rc, _, err = run(capsys, path, "--verify")
    assert rc == 1 and "shard 0" in err and "input_ids" in err


def test_deepspec(tmp_path, capsys):
    samples = make_samples(4, seed=1)
    cache.write_deepspec_cache(str(tmp_path / "d"), samples, 16, (2, 5, 7), samples_per_shard=2)
    rc, out, _ = run(capsys, tmp_path / "d", "--verify", "--dump_sample=2", f"--output={tmp_path / 'd.npz'}")
    s = summary(out)
    assert rc == 0 and s["format"] == "deepspec" and s["num_samples"] == 4 and s["hidden_size"] == 16
    assert s["num_tokens"] == sum(len(x["input_ids"]) for x in samples) and "verify: OK" in out
    check_dump(tmp_path / "d.npz", samples[2])


def test_missing(tmp_path, capsys):
    rc, _, err = run(capsys, tmp_path)
    assert rc == 1 and "manifest.json" in err
