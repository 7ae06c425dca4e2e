"""On-storage layout of a dspark_jax target cache: spec, manifest, paths and checksums.

Layout of one cache directory (a local path or a ``gs://bucket/prefix`` URL; all I/O goes
through tensorstore kvstores, never the local filesystem API)::

    manifest.json                 spec, sample ranges per shard, and after ``finalize``:
                                  per-shard counts and checksums, totals, complete = true
    shards/00000/progress.json    commit record of shard 0 (samples/tokens done, checksums)
    shards/00000/input_ids        zarr3 int32    [N_tok]
    shards/00000/loss_mask        zarr3 uint8    [N_tok]
    shards/00000/aux_hidden       zarr3 bfloat16 [N_tok, n_aux, H]   (states caches only)
    shards/00000/last_hidden      zarr3 bfloat16 [N_tok, H]          (states caches only)
    shards/00000/offsets          zarr3 int64    [n + 1]  shard-local token offsets

A token-row cache (``CacheSpec.states = False``, what ``data.features = "online"`` trains on: the
target's states are computed in the step) holds only ``input_ids`` and ``loss_mask``.

Shard ``i`` of ``num_shards`` holds the contiguous global samples
``[i*n_samples//num_shards, (i+1)*n_samples//num_shards)``; the layout depends only on
``(n_samples, num_shards)``. Token arrays are chunked ``chunk_tokens`` along ``N_tok`` (whole
along the other dims) with the zarr3 ``crc32c`` codec, so any flipped byte fails the read.

Checksums: for every token array, the sha256 of each consecutive block of ``chunk_tokens``
tokens (C-order little-endian bytes) plus the sha256 of the trailing partial block; for
``offsets``, the sha256 of ``offsets[1:n+1]``. They depend only on the data, not on how the
writes were batched, so a resumed build reproduces them exactly. The manifest stores one
root hash per shard and array (sha256 over the block digests); progress.json the blocks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any

import ml_dtypes
import numpy as np
import tensorstore as ts

FORMAT_NAME = "dspark_jax"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
# Capacity along N_tok while a shard is being written; finalize_shard shrinks it to the count.
TOKEN_CAPACITY = 2**40

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES: dict[str, np.dtype] = {
    "input_ids": np.dtype(np.int32),
    "loss_mask": np.dtype(np.uint8),
    "aux_hidden": BF16,
    "last_hidden": BF16,
    "offsets": np.dtype(np.int64),
}
TOKEN_ARRAYS = ("input_ids", "loss_mask")
STATE_ARRAYS = ("aux_hidden", "last_hidden")
_ZARR_DTYPES = {"int32": "int32", "uint8": "uint8", "bfloat16": "bfloat16", "int64": "int64"}


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """What a cache holds; fixed when the cache is created.

    aux_layer_ids: target layers whose outputs form ``aux_hidden`` (-1 = embedding output).
    hidden_size: target hidden size H. num_shards: number of independently writable shards.
    target: free-form identity of the target (source, fingerprint / weight hash, ...).
    tokenizer_fingerprint: hash of the tokenizer.
    states: whether the cache holds the target's states (``aux_hidden``, ``last_hidden``); a token-row
    cache (False) holds only ``input_ids`` and ``loss_mask`` and names no aux layers (``()``). Manifests
    written before this field read as True.
    chunk_tokens: zarr chunk length along N_tok, also the checksum block length. A random read
    decodes whole chunks, so keep it near the typical sample length (512: ~650 samples/s at
    T=512, A=3, H=576 on 2 CPU cores, vs ~90 samples/s with 2048).
    """

    aux_layer_ids: tuple[int, ...]
    hidden_size: int
    num_shards: int
    target: dict[str, Any]
    tokenizer_fingerprint: str
    chunk_tokens: int = 512
    states: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "aux_layer_ids", tuple(int(i) for i in self.aux_layer_ids))
        if self.num_shards < 1 or self.hidden_size < 1 or self.chunk_tokens < 1:
            raise ValueError(f"invalid CacheSpec: {self}")
        if self.states and not self.aux_layer_ids:
            raise ValueError(f"invalid CacheSpec: a cache of states needs aux_layer_ids: {self}")
        if not self.states and self.aux_layer_ids:
            raise ValueError(f"invalid CacheSpec: a token-row cache (states=False) has no aux layers: {self}")

    @property
    def array_names(self) -> tuple[str, ...]:
        """The token-major arrays of every shard, in a fixed order."""
        return TOKEN_ARRAYS + (STATE_ARRAYS if self.states else ())

    def token_shape(self, name: str) -> tuple[int, ...]:
        """Per-token trailing shape of a token-major array."""
        return {
            "input_ids": (),
            "loss_mask": (),
            "aux_hidden": (len(self.aux_layer_ids), self.hidden_size),
            "last_hidden": (self.hidden_size,),
        }[name]

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["aux_layer_ids"] = list(self.aux_layer_ids)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> CacheSpec:
        """The spec of a manifest. Caches written before 2026-12 also record the width of an optional
        per-token array that no writer ever filled (null): keys this spec does not know are dropped when
        null and refused otherwise."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = {k: v for k, v in d.items() if k not in known}
        if any(v is not None for v in unknown.values()):
            raise ValueError(f"the cache spec records {unknown} that this version does not read; rebuild it")
        d = {k: v for k, v in d.items() if k in known}
        return cls(**{**d, "aux_layer_ids": tuple(d["aux_layer_ids"])})


def shard_sample_range(shard: int, num_samples: int, num_shards: int) -> range:
    """Global sample indices held by ``shard``: ``[shard*N//S, (shard+1)*N//S)``."""
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard {shard} out of range [0, {num_shards})")
    return range(shard * num_samples // num_shards, (shard + 1) * num_samples // num_shards)


def estimate_bytes(num_tokens: int, spec: CacheSpec, num_samples: int = 0) -> int:
    """Uncompressed bytes of a cache with ``num_tokens`` tokens (and ``num_samples`` samples)."""
    per_token = sum(DTYPES[n].itemsize * int(np.prod(spec.token_shape(n))) for n in spec.array_names)
    return num_tokens * per_token + 8 * (num_samples + spec.num_shards)


# ---------------------------------------------------------------------------------------- paths / I/O


def join(path: str, *parts: str) -> str:
    """Join a cache path (local or gs://) with relative parts using '/'."""
    return "/".join([path.rstrip("/"), *parts])


# One tensorstore context for the process, so that every open of a `memory://` cache sees the same store.
CONTEXT = ts.Context()


def kvstore_spec(path: str) -> dict[str, Any]:
    """tensorstore kvstore spec of a directory: ``gs://bucket/prefix`` (gcs), ``memory://prefix``,
    ``file:///abs/path`` or a local path (file)."""
    if path.startswith("gs://"):
        bucket, _, prefix = path[len("gs://") :].partition("/")
        return {"driver": "gcs", "bucket": bucket, "path": prefix.strip("/") + "/" if prefix else ""}
    if path.startswith("memory://"):
        prefix = path[len("memory://") :].strip("/")
        return {"driver": "memory", "path": prefix + "/" if prefix else ""}
    if path.startswith("file://"):
        path = path[len("file://") :]
    elif "://" in path:
        raise ValueError(
            f"cache path {path!r}: unsupported URL scheme (use gs://, memory://, file:// or a path)"
        )
    return {"driver": "file", "path": os.path.abspath(path) + "/"}


def open_kvstore(path: str) -> ts.KvStore:
    """A kvstore rooted at directory ``path``; keys are relative to it."""
    return ts.KvStore.open(kvstore_spec(path), context=CONTEXT).result()


def read_json(kv: ts.KvStore, key: str) -> dict[str, Any] | None:
    """The JSON object stored at ``key``, or None if the key is missing."""
    res = kv.read(key).result()
    return json.loads(res.value) if res.state == "value" else None


def write_json(kv: ts.KvStore, key: str, obj: dict[str, Any]) -> None:
    """Atomically replace ``key`` with canonical JSON (sorted keys, no timestamps)."""
    kv.write(key, canonical_json(obj)).result()


def canonical_json(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj, sort_keys=True, indent=1) + "\n").encode()


def read_manifest(path: str) -> dict[str, Any]:
    """The manifest of the cache at ``path``; FileNotFoundError if there is none."""
    m = read_json(open_kvstore(path), MANIFEST)
    if m is None:
        raise FileNotFoundError(f"no {MANIFEST} in cache directory {path!r} (not a dspark_jax cache?)")
    if m.get("format") != FORMAT_NAME or m.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{path!r}: unsupported cache format {m.get('format')!r} v{m.get('format_version')}, "
            f"expected {FORMAT_NAME!r} v{FORMAT_VERSION}"
        )
    return m


def shard_dir(shard: int) -> str:
    return f"shards/{shard:05d}"


def progress_key(shard: int) -> str:
    return f"{shard_dir(shard)}/progress.json"


def array_spec(path: str, shard: int, name: str, spec: CacheSpec, length: int | None) -> dict[str, Any]:
    """tensorstore zarr3 spec of one shard array; with ``length`` it creates it if missing.

    Opened for reading (no ``length``), a missing chunk is an error, never a block of fill values.
    """
    kv = kvstore_spec(join(path, shard_dir(shard), name))
    if length is None:
        return {"driver": "zarr3", "kvstore": kv, "open": True, "fill_missing_data_reads": False}
    trailing = list(spec.token_shape(name)) if name != "offsets" else []
    chunk0 = spec.chunk_tokens if name != "offsets" else max(1, min(length, 1 << 16))
    return {
        "driver": "zarr3",
        "kvstore": kv,
        "open": True,
        "create": True,
        # Every written chunk is stored, all-zero ones too, so a missing chunk always means lost data.
        "store_data_equal_to_fill_value": True,
        "metadata": {
            "shape": [length, *trailing],
            "data_type": _ZARR_DTYPES[DTYPES[name].name],
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [chunk0, *trailing]}},
            "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
            "fill_value": 0,
        },
    }


# ---------------------------------------------------------------------------------------- checksums


class BlockHasher:
    """sha256 per block of ``block`` rows of a token-major array, fed in arbitrary pieces."""

    def __init__(self, block: int, blocks: list[str] | None = None) -> None:
        self.block = block
        self.blocks: list[str] = list(blocks or [])
        self._h = hashlib.sha256()
        self._rows = 0

    def update(self, rows: np.ndarray) -> None:
        """Feed the next rows [n, ...] (in token order)."""
        i = 0
        while i < len(rows):
            take = min(self.block - self._rows, len(rows) - i)
            self._h.update(np.ascontiguousarray(rows[i : i + take]).tobytes())
            self._rows += take
            i += take
            if self._rows == self.block:
                self.blocks.append(self._h.hexdigest())
                self._h, self._rows = hashlib.sha256(), 0

    @property
    def tail(self) -> str | None:
        """Digest of the current partial block, None if there is none."""
        return self._h.copy().hexdigest() if self._rows else None

    def state(self) -> dict[str, Any]:
        return {"blocks": list(self.blocks), "tail": self.tail}


def root_hash(state: dict[str, Any]) -> str:
    """One digest over an array's block digests and tail (what the manifest records)."""
    return hashlib.sha256(" ".join([*state["blocks"], state["tail"] or ""]).encode()).hexdigest()


def sha256(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()
