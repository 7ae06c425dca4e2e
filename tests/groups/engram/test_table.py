"""Engram tables: the streaming fit against a float64 running-mean reference, resume, I/O and refusals."""

import numpy as np
import pytest
from flax import nnx

from dspark_jax.groups.engram import fit
from dspark_jax.groups.engram.hashing import HashSpec, host_hashes
from dspark_jax.groups.engram.table import HostTable, TableError, load_table, save_table
from dspark_jax.target.model import Transformer
from tests.inference.test_speculate import TARGET, H, V

COMPRESS = np.arange(V) % 40  # ids 40.. share compressed ids with 0..7
SPEC = HashSpec.create(
    max_order=3, heads=2, head_dim=3, seed=1, layer_id=0, compressed_vocab=40, pad_id=2, table_size=60
)


def _sequences(seed=0, n=9):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, V, rng.integers(3, 40)).astype(np.int32) for _ in range(n)]


def _reference_rows(model, sequences):
    """Float64 means, one sequence at a time (no padding, no buckets)."""
    proj = fit.projections(SPEC, H, seed=4).astype(np.float64)
    sums = np.zeros((SPEC.num_rows, SPEC.head_dim))
    counts = np.zeros(SPEC.num_rows)
    for ids in sequences:
        hidden = np.asarray(model(ids[None]).hidden_BxTxH[0], np.float64)
        rows = host_hashes(SPEC, COMPRESS[ids], np.arange(len(ids))) + SPEC.offsets
        for t in range(len(ids)):
            for z in range(SPEC.num_hashes):
                sums[rows[t, z]] += hidden[t] @ proj[z]
                counts[rows[t, z]] += 1
    return sums / np.maximum(counts, 1)[:, None], counts


@pytest.fixture(scope="module")
def model():
    return Transformer(TARGET, rngs=nnx.Rngs(0))


def _fit(model, sequences, path, **kw):
    return fit.fit_rows(
        model,
        SPEC,
        COMPRESS,
        sequences,
        table_path=path,
        fingerprint="f1",
        projection_seed=4,
        tokens_per_batch=64,
        progress=False,
        **kw,
    )


def test_fit_equals_running_mean_reference(model, tmp_path):
    sequences = _sequences()
    rows, stats = _fit(model, sequences, tmp_path / "t.safetensors")
    want, counts = _reference_rows(model, sequences)
    np.testing.assert_allclose(rows, want, rtol=1e-4, atol=1e-5)
    assert stats["rows_hit"] == int((counts > 0).sum()) and stats["tokens"] == sum(map(len, sequences))
    assert not np.any(rows[counts == 0])  # rows never hit stay zero


def test_killed_fit_resumes_to_the_same_rows(model, tmp_path, monkeypatch):
    sequences = _sequences(seed=1)
    path = tmp_path / "t.safetensors"
    whole, _ = _fit(model, sequences, tmp_path / "whole.safetensors")

    class Killed(Exception):
        """The fit's process dying mid-way."""

    class DyingBar:
        def __init__(self, *a, **k):
            self.calls = 0

        def update(self, n):
            self.calls += 1
            if self.calls == 4:  # the resume skip, then three forwards
                raise Killed

        def close(self):
            """Nothing to close."""

    monkeypatch.setattr(fit, "tqdm", DyingBar)
    with pytest.raises(Killed):
        _fit(model, sequences, path, commit_every=1)
    monkeypatch.undo()
    assert fit.partial_path(path).exists()
    resumed, _ = _fit(model, sequences, path, commit_every=1)
    np.testing.assert_array_equal(resumed, whole)
    # A partial fit of other settings is not trusted.
    stale, _ = fit.fit_rows(
        model,
        SPEC,
        COMPRESS,
        sequences[:2],
        table_path=path,
        fingerprint="other",
        projection_seed=4,
        tokens_per_batch=64,
        progress=False,
    )
    assert stale.shape == whole.shape


def _table(rows=None):
    rows = np.random.default_rng(0).normal(size=(SPEC.num_rows, SPEC.head_dim)) if rows is None else rows
    return HostTable(SPEC, COMPRESS.astype(np.int64), rows.astype(np.float32), "tok-a", {"note": "test"})


EXPECT = {
    "tokenizer_fingerprint": "tok-a",
    "vocab_size": V,
    "max_order": 3,
    "heads": 2,
    "head_dim": 3,
    "dim": 12,
}


def test_save_load_round_trip(tmp_path):
    table = _table()
    save_table(tmp_path / "t.safetensors", table)
    back = load_table(tmp_path / "t.safetensors", EXPECT)
    assert back.spec == SPEC and back.fit == {"note": "test"}
    np.testing.assert_array_equal(back.rows_xW, table.rows_xW)
    np.testing.assert_array_equal(back.compress_V, COMPRESS)
    device = back.to_device()
    assert device.dim == 12 and device.rows_xW.shape == (SPEC.num_rows, 3)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"tokenizer_fingerprint": "tok-b"}, "tokenizer_fingerprint 'tok-a' \\(expected 'tok-b'\\)"),
        ({"head_dim": 4, "dim": 16}, "head_dim 3 \\(expected 4\\); dim 12 \\(expected 16\\)"),
        ({"vocab_size": 50}, "vocab_size 48 \\(expected 50\\)"),
    ],
)
def test_a_table_for_another_tokenizer_or_shape_is_refused(tmp_path, change, message):
    save_table(tmp_path / "t.safetensors", _table())
    with pytest.raises(TableError, match=f"does not fit this run: {message}.*fit_engram"):
        load_table(tmp_path / "t.safetensors", {**EXPECT, **change})


def test_corrupt_tables_are_refused(tmp_path):
    path = tmp_path / "t.safetensors"
    with pytest.raises(FileNotFoundError, match="not found: fit one with"):
        load_table(path)
    save_table(path, _table())
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # one flipped byte in the rows
    path.write_bytes(bytes(data))
    with pytest.raises(TableError, match="corrupt: rows checksum mismatch"):
        load_table(path)
    path.write_bytes(bytes(data[: len(data) // 2]))  # truncated
    with pytest.raises(TableError, match="corrupt or not a table"):
        load_table(path)
    path.write_text("not a table")
    with pytest.raises(TableError, match="corrupt or not a table"):
        load_table(path)
