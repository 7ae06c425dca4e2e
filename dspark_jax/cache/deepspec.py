"""The public DeepSpec v2 cache (PyTorch reference format): reader and a small writer.

Layout of a DeepSpec v2 cache directory (local or gs://, read through tensorstore kvstores):

- ``samples.idx``: 56-byte little-endian records ``<QIIQQQQQ``: sample_id, shard_id, seq_len T,
  then byte offsets (inside the shard file) of input_ids int32[T], attention_mask uint8[T],
  loss_mask uint8[T], target_hidden_states bf16[T, n_aux*H], target_last_hidden_states bf16[T, H].
- shard files: flat binary, the arrays above concatenated as raw little-endian bytes.
- ``manifest.json``. Its exact keys are not publicly documented; this module assumes (and
  ``write_deepspec_cache`` writes) ``{"version": 2, "format": "deepspec", "hidden_size": H,
  "aux_layer_ids": [...], "num_aux_layers": n_aux, "num_samples": N, "shards": [file names]}``.
  When reading, only ``version`` (2) and ``hidden_size`` are required; n_aux comes from
  ``num_aux_layers`` or ``len(aux_layer_ids)``; shard files default to ``shard_{id:05d}.bin``.

``write_deepspec_cache`` is the format writer for tests and interop, not a production builder.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from dspark_jax.cache import format as fmt

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
assert RECORD.itemsize == 56
INDEX = "samples.idx"
_FIELDS = ("input_ids", "attention_mask", "loss_mask", "target_hidden_states", "target_last_hidden_states")


def shard_name(shard_id: int) -> str:
    return f"shard_{shard_id:05d}.bin"


def is_deepspec(manifest: Mapping[str, Any]) -> bool:
    return manifest.get("format") != fmt.FORMAT_NAME and manifest.get("version") == 2


def read_deepspec_manifest(path: str) -> dict[str, Any]:
    """The DeepSpec manifest, normalised with ``num_aux_layers`` and ``shards`` filled in."""
    m = fmt.read_json(fmt.open_kvstore(path), fmt.MANIFEST)
    if m is None:
        raise FileNotFoundError(f"no {fmt.MANIFEST} in cache directory {path!r}")
    if not is_deepspec(m) or "hidden_size" not in m:
        raise ValueError(f"{path!r} is not a DeepSpec v2 cache (need version 2 and hidden_size)")
    n_aux = m.get("num_aux_layers") or len(m.get("aux_layer_ids") or [])
    if not n_aux:
        raise ValueError(f"{path!r}: DeepSpec manifest gives neither num_aux_layers nor aux_layer_ids")
    return {**m, "num_aux_layers": n_aux}


class DeepSpecDataSource:
    """grain RandomAccessDataSource over a DeepSpec v2 cache, in ``samples.idx`` order.

    ``ds[i]`` -> input_ids int32[T], loss_mask uint8[T], aux_hidden bfloat16[T, n_aux, H],
    last_hidden bfloat16[T, H] (numpy). ``expect`` keys: aux_layer_ids, hidden_size; keys the
    DeepSpec manifest does not record (tokenizer / target fingerprints) are skipped with a warning.
    """

    def __init__(self, path: str, *, expect: dict[str, Any] | None = None) -> None:
        self.path = path
        self.manifest = read_deepspec_manifest(path)
        self.hidden_size: int = self.manifest["hidden_size"]
        self.num_aux: int = self.manifest["num_aux_layers"]
        for key, want in (expect or {}).items():
            found = self.manifest.get(key)
            if found is None:
                logging.warning("DeepSpec cache %s does not record %s; not checked", path, key)
            elif (list(want) if isinstance(want, tuple | list) else want) != found:
                raise ValueError(f"cache {path!r} mismatch on {key}: expected {want!r}, found {found!r}")
        raw = fmt.open_kvstore(path).read(INDEX).result()
        if raw.state != "value":
            raise FileNotFoundError(f"DeepSpec cache {path!r} has no {INDEX}")
        if len(raw.value) % RECORD.itemsize:
            raise ValueError(f"{path!r}: {INDEX} size {len(raw.value)} is not a multiple of 56")
        self.index = np.frombuffer(raw.value, RECORD)
        if len(self.index) == 0:
            raise ValueError(f"cache {path!r} has 0 samples; nothing to train on")
        self._kv: ts.KvStore | None = None

    def __len__(self) -> int:
        return len(self.index)

    def _shard_file(self, shard_id: int) -> str:
        shards = self.manifest.get("shards")
        return shards[shard_id] if shards else shard_name(shard_id)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if not 0 <= index < len(self):
            raise IndexError(f"sample index {index} out of range [0, {len(self)})")
        if self._kv is None:
            self._kv = fmt.open_kvstore(self.path)
        rec = self.index[int(index)]
        t, h, a = int(rec["seq_len"]), self.hidden_size, self.num_aux
        shapes = {
            "input_ids": (np.int32, (t,)),
            "attention_mask": (np.uint8, (t,)),
            "loss_mask": (np.uint8, (t,)),
            "target_hidden_states": (fmt.BF16, (t, a, h)),
            "target_last_hidden_states": (fmt.BF16, (t, h)),
        }
        key = self._shard_file(int(rec["shard_id"]))
        futures = {}
        for name in ("input_ids", "loss_mask", "target_hidden_states", "target_last_hidden_states"):
            dtype, shape = shapes[name]
            start = int(rec[name])
            nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
            futures[name] = (
                self._kv.read(key, byte_range=slice(start, start + nbytes)),
                dtype,
                shape,
                nbytes,
            )
        out = {}
        for name, (f, dtype, shape, nbytes) in futures.items():
            res = f.result()
            if res.state != "value" or len(res.value) != nbytes:
                raise ValueError(f"{self.path!r}: sample {index}: {name} not readable from {key}")
            out[name] = np.frombuffer(res.value, dtype).reshape(shape)
        return {
            "input_ids": out["input_ids"],
            "loss_mask": out["loss_mask"],
            "aux_hidden": out["target_hidden_states"],
            "last_hidden": out["target_last_hidden_states"],
        }

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_kv": None}

    def __repr__(self) -> str:
        return f"DeepSpecDataSource({self.path!r}, num_samples={len(self)})"


def verify_deepspec(path: str) -> int:
    """Read every sample and check index consistency (the format has no checksums); returns N."""
    ds = DeepSpecDataSource(path)
    ids = ds.index["sample_id"]
    if len(np.unique(ids)) != len(ids):
        raise ValueError(f"{path!r}: duplicate sample_id in {INDEX}")
    for i in range(len(ds)):
        try:
            ds[i]
        except ValueError as e:
            raise ValueError(f"{path!r}: sample {i} (sample_id {int(ids[i])}) is corrupt: {e}") from e
    return len(ds)


def write_deepspec_cache(
    path: str,
    samples: Sequence[Mapping[str, np.ndarray]],
    hidden_size: int,
    aux_layer_ids: Sequence[int],
    samples_per_shard: int,
) -> None:
    """Write ``samples`` (native record dicts, optional attention_mask) as a DeepSpec v2 cache."""
    kv = fmt.open_kvstore(path)
    n_aux = len(aux_layer_ids)
    records = np.zeros(len(samples), RECORD)
    num_shards = -(-len(samples) // samples_per_shard)
    for shard in range(num_shards):
        parts: list[bytes] = []
        pos = 0
        for i in range(shard * samples_per_shard, min((shard + 1) * samples_per_shard, len(samples))):
            s = samples[i]
            t = len(s["input_ids"])
            arrays = {
                "input_ids": np.asarray(s["input_ids"], np.int32),
                "attention_mask": np.asarray(s.get("attention_mask", np.ones(t)), np.uint8),
                "loss_mask": np.asarray(s["loss_mask"], np.uint8),
                "target_hidden_states": np.asarray(s["aux_hidden"], fmt.BF16).reshape(t, n_aux * hidden_size),
                "target_last_hidden_states": np.asarray(s["last_hidden"], fmt.BF16).reshape(t, hidden_size),
            }
            records["sample_id"][i], records["shard_id"][i], records["seq_len"][i] = i, shard, t
            for name in _FIELDS:
                records[name][i] = pos
                data = np.ascontiguousarray(arrays[name]).tobytes()
                parts.append(data)
                pos += len(data)
        kv.write(shard_name(shard), b"".join(parts)).result()
    kv.write(INDEX, records.tobytes()).result()
    manifest = {
        "version": 2,
        "format": "deepspec",
        "hidden_size": hidden_size,
        "aux_layer_ids": list(aux_layer_ids),
        "num_aux_layers": n_aux,
        "num_samples": len(samples),
        "shards": [shard_name(s) for s in range(num_shards)],
    }
    fmt.write_json(kv, fmt.MANIFEST, manifest)
