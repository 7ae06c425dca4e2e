"""An Engram table: its hashing (`HashSpec`), compression map and rows; file I/O and device lookup.

File format: one safetensors file with tensors `compress` (int64[V]: token id -> compressed id) and
`rows` (float32[R, W]: every hash head's table, concatenated head after head) plus a metadata entry
`dspark_engram` (JSON): format version, the `HashSpec`, the tokenizer fingerprint, the rows' SHA-256
and how the table was fitted. A table is refused on load when any of it disagrees with itself or with
what the run expects (tokenizer, orders, heads, widths).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.groups.engram.hashing import HashSpec, device_hashes, split_int64

FORMAT_VERSION = 1
METADATA_KEY = "dspark_engram"


class EngramTable(NamedTuple):
    """A table on device (a pytree; orders and heads follow from the shapes).

    `compress_V` int32 token id -> compressed id; `mult_hi_N`, `mult_lo_N` the multipliers' uint32
    words; `primes_Z` uint32 table sizes; `offsets_Z` int32 first row of each head; `pad` the compressed
    pad id (int32 scalar); `rows_xW` the concatenated rows `[sum(primes), W]`.
    """

    compress_V: jax.Array
    mult_hi_N: jax.Array
    mult_lo_N: jax.Array
    primes_Z: jax.Array
    offsets_Z: jax.Array
    pad: jax.Array
    rows_xW: jax.Array

    @property
    def dim(self) -> int:
        """Feature width U = Z * W."""
        return self.primes_Z.shape[0] * self.rows_xW.shape[1]

    def row_ids(self, ids_xT: jax.Array, positions_xT: jax.Array) -> jax.Array:
        """int32 `[..., T, Z]`: the rows of the n-grams ending at each token (`positions_xT` count from
        each sequence's start; earlier positions are padding)."""
        max_order = self.mult_hi_N.shape[0]
        hashes_xTxZ = device_hashes(
            self.mult_hi_N,
            self.mult_lo_N,
            self.primes_Z,
            jnp.take(self.compress_V, ids_xT, axis=0),
            positions_xT,
            max_order=max_order,
            heads=self.primes_Z.shape[0] // (max_order - 1),
            pad_id=self.pad,
        )
        return hashes_xTxZ + self.offsets_Z

    def features(self, ids_xT: jax.Array, positions_xT: jax.Array) -> jax.Array:
        """Raw Engram features `e [..., T, U]` of the prefixes ending at each token."""
        rows_xTxZxW = jnp.take(self.rows_xW, self.row_ids(ids_xT, positions_xT), axis=0)
        return rows_xTxZxW.reshape(*rows_xTxZxW.shape[:-2], self.dim)


def device_table(
    spec: HashSpec, compress_V: np.ndarray, rows_xW: np.ndarray, dtype=jnp.float32
) -> EngramTable:
    hi, lo = split_int64(spec.multipliers)
    return EngramTable(
        jnp.asarray(compress_V, jnp.int32),
        jnp.asarray(hi),
        jnp.asarray(lo),
        jnp.asarray(np.asarray(spec.primes, np.uint32)),
        jnp.asarray(spec.offsets, jnp.int32),
        jnp.asarray(spec.pad_id, jnp.int32),
        jnp.asarray(rows_xW, dtype),
    )


@dataclasses.dataclass(frozen=True)
class HostTable:
    """A table as read from (or written to) its file."""

    spec: HashSpec
    compress_V: np.ndarray
    rows_xW: np.ndarray
    tokenizer_fingerprint: str
    fit: Mapping[str, Any]

    def to_device(self, dtype=jnp.float32) -> EngramTable:
        return device_table(self.spec, self.compress_V, self.rows_xW, dtype)


def _digest(rows_xW: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(rows_xW, np.float32).tobytes()).hexdigest()


def save_table(path: str | os.PathLike, table: HostTable) -> None:
    """Writes `table` atomically (a temporary file renamed into place)."""
    from safetensors.numpy import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = np.ascontiguousarray(table.rows_xW, np.float32)
    meta = {
        "format_version": FORMAT_VERSION,
        "spec": dataclasses.asdict(table.spec),
        "tokenizer_fingerprint": table.tokenizer_fingerprint,
        "rows_sha256": _digest(rows),
        "fit": dict(table.fit),
    }
    tmp = path.with_name(path.name + ".tmp")
    save_file(
        {"compress": np.asarray(table.compress_V, np.int64), "rows": rows},
        str(tmp),
        metadata={METADATA_KEY: json.dumps(meta)},
    )
    os.replace(tmp, path)


class TableError(ValueError):
    """A table file that cannot be used: corrupt, or made for another tokenizer or shape."""


def load_table(path: str | os.PathLike, expect: Mapping[str, Any] | None = None) -> HostTable:
    """Reads and checks a table file; `expect` maps `tokenizer_fingerprint`, `vocab_size`, `max_order`,
    `heads`, `head_dim` or `dim` to the values the run needs."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"Engram table {path} not found: fit one with `python -m dspark_jax.fit_engram`"
        )
    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = json.loads((f.metadata() or {})[METADATA_KEY])
            compress, rows = f.get_tensor("compress"), f.get_tensor("rows")
        spec = HashSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in meta["spec"].items()})
    except Exception as e:  # header, JSON, missing key or field: all mean the file is not a table
        raise TableError(
            f"Engram table {path} is corrupt or not a table ({type(e).__name__}: {e}): fit it again"
        ) from e
    problems = []
    if meta.get("format_version") != FORMAT_VERSION:
        problems.append(f"format version {meta.get('format_version')} (this code reads {FORMAT_VERSION})")
    if rows.shape != (spec.num_rows, spec.head_dim):
        problems.append(f"rows {rows.shape} but the spec needs ({spec.num_rows}, {spec.head_dim})")
    if len(spec.multipliers) != spec.max_order or len(spec.primes) != spec.num_hashes:
        problems.append("multipliers or primes do not match the orders and heads")
    if (
        compress.ndim != 1
        or compress.size == 0
        or compress.max() >= spec.compressed_vocab
        or compress.min() < 0
    ):
        problems.append(f"compression map outside [0, {spec.compressed_vocab})")
    if not problems and _digest(rows) != meta.get("rows_sha256"):
        problems.append("rows checksum mismatch")
    if problems:
        raise TableError(f"Engram table {path} is corrupt: {'; '.join(problems)}: fit it again")
    table = HostTable(spec, compress, rows, meta["tokenizer_fingerprint"], meta.get("fit", {}))
    check_table(table, expect or {}, str(path))
    return table


def check_table(table: HostTable, expect: Mapping[str, Any], where: str) -> None:
    """Raises `TableError` naming every expectation the table does not meet."""
    have = {
        "tokenizer_fingerprint": table.tokenizer_fingerprint,
        "vocab_size": int(table.compress_V.shape[0]),
        "max_order": table.spec.max_order,
        "heads": table.spec.heads,
        "head_dim": table.spec.head_dim,
        "dim": table.spec.dim,
    }
    wrong = [f"{k} {have[k]!r} (expected {v!r})" for k, v in expect.items() if have[k] != v]
    if wrong:
        raise TableError(
            f"Engram table {where} does not fit this run: {'; '.join(wrong)}; "
            "fit a table for this target and config (python -m dspark_jax.fit_engram) or point "
            "config.engram.table_path at the right one"
        )
