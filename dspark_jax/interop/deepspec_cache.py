"""The DeepSpec v2 target cache (the public PyTorch reference's format): reader and a small writer.

A DeepSpec v2 cache is a directory (local or gs://, always read through tensorstore kvstores)
holding three kinds of file:

- ``manifest.json``: a JSON object, serialised by DeepSpec with ``indent=2, sort_keys=True`` and
  no trailing newline. Its protocol keys are ``version`` (2), ``num_samples``, ``num_shards``,
  ``target_layer_ids`` (the captured target layers, a non-empty ascending list; -1 is the
  embedding output), ``hidden_dtype`` ("bfloat16"), ``token_dtype`` ("int32"), ``mask_dtype``
  ("uint8"), ``index_record_size`` (56), ``hidden_size`` (H > 0), ``shards`` (a list of
  ``{"shard_id": i, "file_name": "shard-%05d.bin" % i}`` with ids 0, 1, 2, ...) and
  ``target_model_name_or_path`` (the target model, which DeepSpec's trainer compares with its
  config). DeepSpec's prepare script adds provenance keys (source_jsonl_paths, chat_template,
  max_length, min_loss_tokens, project_name, exp_name, git_sha); the reader ignores them.
- ``samples.idx``: exactly ``num_samples`` records of 56 bytes, little-endian ``<QIIQQQQQ``:
  sample_id, shard_id, seq_len T, then the byte offsets inside that shard's file of
  input_ids int32[T], attention_mask uint8[T], loss_mask uint8[T],
  target_hidden_states bf16[T, n_aux*H] and target_last_hidden_states bf16[T, H], where
  n_aux = len(target_layer_ids). Record i must carry sample_id i.
- the shard files named in the manifest: raw little-endian array bytes, each sample's five arrays
  back to back in the order above. ``target_hidden_states`` concatenates the captured layers
  along the last axis in ``target_layer_ids`` order, so it reshapes to ``aux_hidden [T, n_aux, H]``.

The format carries no checksums: ``verify_deepspec`` / ``scan_deepspec`` check the manifest and
the index and read every byte range of every sample. ``write_deepspec_cache`` is the format
writer for tests and interop (its caches load in DeepSpec unchanged), not a production builder.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from dspark_jax.cache import format as fmt
from dspark_jax.cache.reader import CacheCorruptError

VERSION = 2
RECORD = np.dtype(
    [
        ("sample_id", "<u8"),
        ("shard_id", "<u4"),
        ("seq_len", "<u4"),
        ("input_ids", "<u8"),
        ("attention_mask", "<u8"),
        ("loss_mask", "<u8"),
        ("target_hidden_states", "<u8"),
        ("target_last_hidden_states", "<u8"),
    ]
)
RECORD_SIZE = 56
assert RECORD.itemsize == RECORD_SIZE
INDEX = "samples.idx"
DTYPE_KEYS = {"hidden_dtype": "bfloat16", "token_dtype": "int32", "mask_dtype": "uint8"}
REQUIRED_KEYS = (
    "version",
    "num_samples",
    "num_shards",
    "target_layer_ids",
    "hidden_dtype",
    "token_dtype",
    "mask_dtype",
    "index_record_size",
    "hidden_size",
    "shards",
    "target_model_name_or_path",
)
# The arrays of one sample, in shard-file order.
FIELDS = ("input_ids", "attention_mask", "loss_mask", "target_hidden_states", "target_last_hidden_states")
# The arrays a training read needs (DeepSpec's own dataset skips attention_mask too).
_TRAIN_FIELDS = ("input_ids", "loss_mask", "target_hidden_states", "target_last_hidden_states")
# The record field (`dspark_jax.data.batch`) of each DeepSpec array a source reads.
_RECORD_NAMES = {
    "input_ids": "input_ids",
    "loss_mask": "loss_mask",
    "target_hidden_states": "aux_hidden",
    "target_last_hidden_states": "last_hidden",
}
# expect keys the DeepSpec manifest records, and under which manifest key.
_EXPECT_KEYS = {"aux_layer_ids": "target_layer_ids", "hidden_size": "hidden_size"}
# expect keys DeepSpec does not record: skipped with a warning.
_UNRECORDED_KEYS = ("tokenizer_fingerprint", "target_fingerprint")


def shard_name(shard_id: int) -> str:
    """DeepSpec's shard file name (with a hyphen): ``shard-00000.bin``."""
    return f"shard-{shard_id:05d}.bin"


def is_deepspec(manifest: Mapping[str, Any]) -> bool:
    """Whether a parsed manifest.json is DeepSpec's (version 2 with index_record_size)."""
    return (
        isinstance(manifest, Mapping)
        and manifest.get("format") != fmt.FORMAT_NAME
        and manifest.get("version") == VERSION
        and "index_record_size" in manifest
    )


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def validate_deepspec_manifest(m: Any, path: str) -> None:
    """Raise a one-line ValueError naming ``path``, the key, and expected vs found, if ``m`` is
    not a valid DeepSpec v2 manifest (the same rules as DeepSpec's own validator, plus
    ``target_model_name_or_path``, which DeepSpec's trainer requires). Extra keys are ignored."""
    where = f"cache {path!r}: {fmt.MANIFEST}"

    def bad(key: str, found: Any, want: str) -> ValueError:
        return ValueError(f"{where} key {key!r} is {found!r}, DeepSpec v2 requires {want}")

    if not isinstance(m, Mapping):
        raise ValueError(f"{where} is a JSON {type(m).__name__}, DeepSpec v2 requires an object")
    missing = [k for k in REQUIRED_KEYS if k not in m]
    if missing:
        raise ValueError(
            f"{where} lacks key(s) {', '.join(map(repr, missing))}; DeepSpec v2 requires all of "
            f"{', '.join(REQUIRED_KEYS)}"
        )
    if not (_is_int(m["version"]) and m["version"] == VERSION):
        raise bad("version", m["version"], str(VERSION))
    for key, want in DTYPE_KEYS.items():
        if m[key] != want:
            raise bad(key, m[key], repr(want))
    if not (_is_int(m["index_record_size"]) and m["index_record_size"] == RECORD_SIZE):
        raise bad("index_record_size", m["index_record_size"], str(RECORD_SIZE))
    if not (_is_int(m["hidden_size"]) and m["hidden_size"] > 0):
        raise bad("hidden_size", m["hidden_size"], "a positive integer")
    if not (_is_int(m["num_samples"]) and m["num_samples"] >= 0):
        raise bad("num_samples", m["num_samples"], "a non-negative integer")
    ids = m["target_layer_ids"]
    if not (isinstance(ids, list) and ids and all(_is_int(i) for i in ids)):
        raise bad("target_layer_ids", ids, "a non-empty list of integers")
    if ids != sorted(ids):
        raise bad("target_layer_ids", ids, f"ascending order ({sorted(ids)})")
    if not isinstance(m["target_model_name_or_path"], str):
        raise bad("target_model_name_or_path", m["target_model_name_or_path"], "a string")
    if not (_is_int(m["num_shards"]) and m["num_shards"] >= 0):
        raise bad("num_shards", m["num_shards"], "a non-negative integer")
    shards = m["shards"]
    if not isinstance(shards, list):
        raise bad("shards", shards, "a list of {shard_id, file_name} objects")
    if m["num_shards"] != len(shards):
        raise ValueError(
            f"{where} key 'num_shards' is {m['num_shards']} but key 'shards' lists {len(shards)}; "
            "DeepSpec v2 requires them equal"
        )
    for i, s in enumerate(shards):
        if not (isinstance(s, Mapping) and "shard_id" in s and "file_name" in s):
            raise bad(f"shards[{i}]", s, "an object with shard_id and file_name")
        if not (_is_int(s["shard_id"]) and s["shard_id"] == i):
            raise ValueError(
                f"{where} key 'shards'[{i}] has shard_id {s['shard_id']!r}, DeepSpec v2 requires "
                f"contiguous shard ids from 0 (expected {i})"
            )
        if not (isinstance(s["file_name"], str) and s["file_name"]):
            raise bad(f"shards[{i}].file_name", s["file_name"], "a non-empty file name")


def read_deepspec_manifest(path: str, kv: ts.KvStore | None = None) -> dict[str, Any]:
    """The validated DeepSpec v2 manifest of the cache at ``path`` (extra keys kept as read)."""
    kv = kv or fmt.open_kvstore(path)
    res = kv.read(fmt.MANIFEST).result()
    if res.state != "value":
        raise FileNotFoundError(f"cache {path!r}: no {fmt.MANIFEST} in the cache directory")
    try:
        m = json.loads(res.value)
    except ValueError as e:
        raise ValueError(f"cache {path!r}: {fmt.MANIFEST} is not valid JSON ({e})") from None
    validate_deepspec_manifest(m, path)
    return m


def _check_shard_files(kv: ts.KvStore, path: str, manifest: Mapping[str, Any]) -> None:
    """FileNotFoundError naming every shard file of the manifest that is absent (0-byte reads)."""
    names = [s["file_name"] for s in manifest["shards"]]
    futures = [kv.read(n, byte_range=slice(0, 0)) for n in names]
    missing = [n for n, f in zip(names, futures, strict=True) if f.result().state != "value"]
    if missing:
        raise FileNotFoundError(
            f"cache {path!r}: shard file(s) {', '.join(map(repr, missing))} named in "
            f"{fmt.MANIFEST} key 'shards' are missing"
        )


def read_deepspec_index(kv: ts.KvStore, path: str, manifest: Mapping[str, Any]) -> np.ndarray:
    """``samples.idx`` as a RECORD array, checked against the manifest with vectorised numpy:
    size, dense sample ids (record i has sample_id i), shard ids in range, seq_len > 0."""
    raw = kv.read(INDEX).result()
    if raw.state != "value":
        raise FileNotFoundError(f"cache {path!r}: {INDEX} is missing")
    size, n = len(raw.value), manifest["num_samples"]
    if size % RECORD_SIZE:
        raise ValueError(
            f"cache {path!r}: {INDEX} holds {size} bytes, not a multiple of {fmt.MANIFEST} key "
            f"'index_record_size' ({RECORD_SIZE})"
        )
    if size != n * RECORD_SIZE:
        raise ValueError(
            f"cache {path!r}: {INDEX} holds {size // RECORD_SIZE} records ({size} bytes), "
            f"{fmt.MANIFEST} key 'num_samples' is {n} (expected {n * RECORD_SIZE} bytes)"
        )
    index = np.frombuffer(raw.value, RECORD)
    bad = np.flatnonzero(index["sample_id"] != np.arange(n, dtype=np.uint64))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"cache {path!r}: {INDEX} record {i} has sample_id {int(index['sample_id'][i])}, DeepSpec v2 "
            f"requires sample_id == record index (dense, sorted; {bad.size} records differ)"
        )
    bad = np.flatnonzero(index["shard_id"] >= manifest["num_shards"])
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"cache {path!r}: {INDEX} record {i} has shard_id {int(index['shard_id'][i])}, but "
            f"{fmt.MANIFEST} key 'num_shards' is {manifest['num_shards']}"
        )
    bad = np.flatnonzero(index["seq_len"] == 0)
    if bad.size:
        raise ValueError(
            f"cache {path!r}: {INDEX} record {int(bad[0])} has seq_len 0, DeepSpec v2 requires seq_len > 0"
        )
    return index


class DeepSpecDataSource:
    """grain RandomAccessDataSource over a DeepSpec v2 cache, in ``samples.idx`` order.

    ``ds[i]`` -> input_ids int32[T], loss_mask uint8[T], aux_hidden bfloat16[T, n_aux, H],
    last_hidden bfloat16[T, H] (numpy); with ``read_states=False`` only input_ids and loss_mask.
    Opening validates the manifest, the presence of every shard file and the index (see
    ``read_deepspec_index``). ``expect`` keys: states (always True: DeepSpec caches hold states),
    aux_layer_ids (compared with target_layer_ids), hidden_size;
    tokenizer_fingerprint / target_fingerprint are not recorded by DeepSpec and are skipped with
    a warning. Picklable: the kvstore is reopened lazily in each process.
    """

    has_states = True

    def __init__(self, path: str, *, expect: dict[str, Any] | None = None, read_states: bool = True) -> None:
        self.path = path
        self._fields = _TRAIN_FIELDS if read_states else _TRAIN_FIELDS[:2]
        kv = fmt.open_kvstore(path)
        self.manifest = read_deepspec_manifest(path, kv)
        self.hidden_size: int = self.manifest["hidden_size"]
        self.aux_layer_ids: list[int] = list(self.manifest["target_layer_ids"])
        self.num_aux: int = len(self.aux_layer_ids)
        self.shard_files: list[str] = [s["file_name"] for s in self.manifest["shards"]]
        self.check_expect(expect or {})
        _check_shard_files(kv, path, self.manifest)
        self.index = read_deepspec_index(kv, path, self.manifest)
        if len(self.index) == 0:
            raise ValueError(f"cache {path!r} has 0 samples; nothing to train on")
        self._kv: ts.KvStore | None = None

    def check_expect(self, expect: Mapping[str, Any]) -> None:
        """Raise ValueError naming the first key of ``expect`` the manifest does not match."""
        for key, want in expect.items():
            if key == "states":
                if want is not True:
                    raise ValueError(
                        f"cache {self.path!r} mismatch on states: expected {want!r}, found True "
                        "(a DeepSpec cache holds target states)"
                    )
                continue
            if key in _UNRECORDED_KEYS:
                logging.warning("DeepSpec cache %s does not record %s; not checked", self.path, key)
                continue
            if key not in _EXPECT_KEYS:
                known = sorted([*_EXPECT_KEYS, *_UNRECORDED_KEYS, "states"])
                raise ValueError(f"unknown expect key {key!r}; known: {known}")
            found = self.manifest[_EXPECT_KEYS[key]]
            if (list(want) if isinstance(want, tuple | list) else want) != found:
                raise ValueError(
                    f"cache {self.path!r} mismatch on {key}: expected {want!r}, found {found!r} "
                    f"({fmt.MANIFEST} key {_EXPECT_KEYS[key]!r})"
                )

    def __len__(self) -> int:
        return len(self.index)

    def lengths(self) -> np.ndarray:
        """Tokens of every sample, int64[len(self)], from the index alone."""
        return self.index["seq_len"].astype(np.int64)

    def _shapes(self, t: int) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
        h, a = self.hidden_size, self.num_aux
        return {
            "input_ids": (np.dtype("<i4"), (t,)),
            "attention_mask": (np.dtype(np.uint8), (t,)),
            "loss_mask": (np.dtype(np.uint8), (t,)),
            "target_hidden_states": (fmt.BF16, (t, a, h)),
            "target_last_hidden_states": (fmt.BF16, (t, h)),
        }

    def _start_reads(self, index: int, names: Sequence[str]) -> tuple[str, dict[str, Any]]:
        """Issue the byte-range reads of sample ``index``; (shard file, {name: read state})."""
        if self._kv is None:
            self._kv = fmt.open_kvstore(self.path)
        rec = self.index[index]
        key = self.shard_files[int(rec["shard_id"])]
        reads = {}
        for name, (dtype, shape) in self._shapes(int(rec["seq_len"])).items():
            if name in names:
                start = int(rec[name])
                stop = start + int(np.prod(shape)) * dtype.itemsize
                reads[name] = (self._kv.read(key, byte_range=slice(start, stop)), dtype, shape, start, stop)
        return key, reads

    def _finish_reads(self, index: int, key: str, reads: dict[str, Any]) -> dict[str, np.ndarray]:
        """The arrays of sample ``index``, or CacheCorruptError naming the shard file, the sample
        and every array whose byte range could not be read (the message has no cache path)."""
        out, bad, reason = {}, [], ""
        for name, (future, dtype, shape, start, stop) in reads.items():
            try:
                res = future.result()
            except ValueError as e:  # e.g. OUT_OF_RANGE: the byte range is past the end of the file
                bad.append(f"{name} bytes [{start}, {stop})")
                reason = reason or str(e)
                continue
            if res.state != "value":
                bad.append(f"{name} bytes [{start}, {stop})")
                reason = reason or "the shard file is missing"
            elif len(res.value) != stop - start:
                bad.append(f"{name} bytes [{start}, {stop})")
                reason = reason or f"short read of {len(res.value)} bytes"
            else:
                out[name] = np.frombuffer(res.value, dtype).reshape(shape)
        if bad:
            raise CacheCorruptError(
                f"sample {index}: {', '.join(bad)} not readable from shard file {key!r} ({reason})"
            )
        return out

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        index = int(index)
        if not 0 <= index < len(self):
            raise IndexError(f"sample index {index} out of range [0, {len(self)})")
        try:
            out = self._finish_reads(index, *self._start_reads(index, self._fields))
        except CacheCorruptError as e:
            raise CacheCorruptError(f"cache {self.path!r}: {e}") from None
        return {_RECORD_NAMES[name]: out[name] for name in self._fields}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_kv": None}

    def __repr__(self) -> str:
        return f"DeepSpecDataSource({self.path!r}, num_samples={len(self)})"


def scan_deepspec(path: str, window: int = 32) -> tuple[int, list[str]]:
    """Read all five arrays of every sample; returns (num_samples, one message per bad sample).

    Manifest, shard-file and index problems raise at open (as in ``DeepSpecDataSource``); the
    byte-range reads of ``window`` samples are in flight at a time.
    """
    ds = DeepSpecDataSource(path)
    problems: list[str] = []
    pending: list[tuple[int, str, dict[str, Any]]] = []

    def drain(keep: int) -> None:
        while len(pending) > keep:
            i, key, reads = pending.pop(0)
            try:
                ds._finish_reads(i, key, reads)
            except CacheCorruptError as e:
                problems.append(str(e))

    for i in range(len(ds)):
        pending.append((i, *ds._start_reads(i, FIELDS)))
        drain(window)
    drain(0)
    return len(ds), problems


def verify_deepspec(path: str) -> int:
    """Check the manifest and index and read every sample (the format has no checksums);
    returns the number of samples, or raises CacheCorruptError listing every bad sample."""
    n, problems = scan_deepspec(path)
    if problems:
        raise CacheCorruptError(
            f"cache {path!r}: {len(problems)} of {n} samples are corrupt: {'; '.join(problems)}"
        )
    return n


def deepspec_manifest(
    *,
    num_samples: int,
    num_shards: int,
    hidden_size: int,
    target_layer_ids: Sequence[int],
    target_model_name_or_path: str,
) -> dict[str, Any]:
    """The manifest DeepSpec writes for these values (its protocol keys, no provenance keys)."""
    return {
        "version": VERSION,
        "num_samples": int(num_samples),
        "num_shards": int(num_shards),
        "target_layer_ids": [int(i) for i in target_layer_ids],
        **DTYPE_KEYS,
        "index_record_size": RECORD_SIZE,
        "hidden_size": int(hidden_size),
        "shards": [{"shard_id": s, "file_name": shard_name(s)} for s in range(num_shards)],
        "target_model_name_or_path": str(target_model_name_or_path),
    }


def write_deepspec_cache(
    path: str,
    samples: Sequence[Mapping[str, np.ndarray]],
    hidden_size: int,
    aux_layer_ids: Sequence[int],
    samples_per_shard: int,
    *,
    target_model_name_or_path: str = "",
) -> None:
    """Write ``samples`` (native record dicts: input_ids, loss_mask, aux_hidden [T, n_aux, H],
    last_hidden [T, H], optional attention_mask, default all ones) as a DeepSpec v2 cache.

    The format writer for tests and interop: it emits DeepSpec's exact layout (``shard-NNNNN.bin``
    files of ``samples_per_shard`` samples each, ``samples.idx``, and a manifest with DeepSpec's
    protocol keys serialised as DeepSpec does), so DeepSpec loads the cache unchanged. DeepSpec's
    trainer compares ``target_model_name_or_path`` with its own config: pass the real one for
    interop. It is not a production builder (no resume, no multi-process, one write per shard).
    """
    ids = [int(i) for i in aux_layer_ids]
    if not ids or ids != sorted(ids):
        raise ValueError(
            f"aux_layer_ids must be a non-empty ascending list (DeepSpec requires it), got {ids}"
        )
    if hidden_size < 1 or samples_per_shard < 1:
        raise ValueError(
            f"hidden_size ({hidden_size}) and samples_per_shard ({samples_per_shard}) must be >= 1"
        )
    kv = fmt.open_kvstore(path)
    n_aux, h = len(ids), hidden_size
    records = np.zeros(len(samples), RECORD)
    num_shards = -(-len(samples) // samples_per_shard)
    for shard in range(num_shards):
        parts: list[bytes] = []
        pos = 0
        for i in range(shard * samples_per_shard, min((shard + 1) * samples_per_shard, len(samples))):
            s = samples[i]
            t = len(s["input_ids"])
            if t < 1 or np.shape(s["aux_hidden"]) != (t, n_aux, h) or np.shape(s["last_hidden"]) != (t, h):
                raise ValueError(
                    f"sample {i}: need T >= 1, aux_hidden [T, {n_aux}, {h}], last_hidden [T, {h}]; got "
                    f"T={t}, {np.shape(s['aux_hidden'])}, {np.shape(s['last_hidden'])}"
                )
            arrays = {
                "input_ids": np.asarray(s["input_ids"], "<i4"),
                "attention_mask": np.asarray(s.get("attention_mask", np.ones(t)), np.uint8),
                "loss_mask": np.asarray(s["loss_mask"], np.uint8),
                "target_hidden_states": np.asarray(s["aux_hidden"], fmt.BF16).reshape(t, n_aux * h),
                "target_last_hidden_states": np.asarray(s["last_hidden"], fmt.BF16),
            }
            records["sample_id"][i], records["shard_id"][i], records["seq_len"][i] = i, shard, t
            for name in FIELDS:
                records[name][i] = pos
                data = np.ascontiguousarray(arrays[name]).tobytes()
                parts.append(data)
                pos += len(data)
        kv.write(shard_name(shard), b"".join(parts)).result()
    kv.write(INDEX, records.tobytes()).result()
    manifest = deepspec_manifest(
        num_samples=len(samples),
        num_shards=num_shards,
        hidden_size=h,
        target_layer_ids=ids,
        target_model_name_or_path=target_model_name_or_path,
    )
    kv.write(fmt.MANIFEST, json.dumps(manifest, indent=2, sort_keys=True).encode()).result()
