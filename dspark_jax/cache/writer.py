"""Resumable, crash-safe writing of a dspark_jax cache (layout in ``format.py``).

Typical build, possibly split over processes (each owning a disjoint set of shards)::

    layout = create_or_open(path, spec, num_samples)          # every process, idempotent
    for shard in my_shards:
        w = ShardWriter(path, shard)
        for batch in batches_of(layout.shard_sample_range(shard)[w.samples_done:]):
            w.append(batch)                                  # writes data, then commits
        w.finalize_shard()
    finalize(path)                                           # once, after all shards

Each ``append`` writes the arrays first and then atomically replaces the shard's
``progress.json``; a writer killed at any point resumes from the last commit (the
uncommitted tail is overwritten) and readers never see uncommitted samples. One writer per
shard at a time.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from dspark_jax.cache import format as fmt
from dspark_jax.cache.format import CacheSpec


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """Handle of a created cache: where it is, what it holds and how samples map to shards."""

    path: str
    spec: CacheSpec
    num_samples: int

    def shard_sample_range(self, shard: int) -> range:
        """Global sample indices held by ``shard``."""
        return fmt.shard_sample_range(shard, self.num_samples, self.spec.num_shards)


def _skeleton(spec: CacheSpec, num_samples: int) -> dict[str, Any]:
    shards = []
    for s in range(spec.num_shards):
        r = fmt.shard_sample_range(s, num_samples, spec.num_shards)
        shards.append({"shard": s, "sample_start": r.start, "sample_end": r.stop})
    return {
        "format": fmt.FORMAT_NAME,
        "format_version": fmt.FORMAT_VERSION,
        "spec": spec.to_json(),
        "dtypes": {n: fmt.DTYPES[n].name for n in (*spec.array_names, "offsets")},
        "num_samples": num_samples,
        "num_tokens": None,
        "shards": shards,
        "complete": False,
    }


def create_or_open(path: str, spec: CacheSpec, num_samples: int) -> CacheLayout:
    """Create the cache's manifest skeleton, or check an existing one matches ``spec``/``num_samples``.

    Raises ValueError naming the first differing field.
    """
    if num_samples < 0:
        raise ValueError(f"num_samples must be >= 0, got {num_samples}")
    kv = fmt.open_kvstore(path)
    existing = fmt.read_json(kv, fmt.MANIFEST)
    if existing is None:
        fmt.write_json(kv, fmt.MANIFEST, _skeleton(spec, num_samples))
    else:
        # Through CacheSpec: a manifest written before a field was added reads with its default.
        found = {
            **CacheSpec.from_json(existing["spec"]).to_json(),
            "num_samples": existing.get("num_samples"),
        }
        wanted = {**spec.to_json(), "num_samples": num_samples}
        for key in sorted(set(found) | set(wanted)):
            if found.get(key) != wanted.get(key):
                raise ValueError(
                    f"cache {path!r} exists with a different {key}: found {found.get(key)!r}, "
                    f"requested {wanted.get(key)!r}"
                )
    return CacheLayout(path, spec, num_samples)


def _check_sample(i: int, sample: Mapping[str, np.ndarray], spec: CacheSpec) -> dict[str, np.ndarray]:
    """Validate and cast one sample; errors name the sample index and the field."""
    missing = [n for n in spec.array_names if n not in sample]
    if missing:
        raise ValueError(f"sample {i}: missing field(s) {missing}")
    ids = np.asarray(sample["input_ids"])
    if ids.ndim != 1 or len(ids) == 0:
        raise ValueError(f"sample {i}: input_ids must have shape [T] with T > 0, got {ids.shape}")
    t = len(ids)
    out = {}
    for name in spec.array_names:
        a = np.asarray(sample[name])
        want = (t, *spec.token_shape(name))
        if a.shape != want:
            raise ValueError(f"sample {i}: field {name!r} has shape {a.shape}, expected {want} (T={t})")
        dt = fmt.DTYPES[name]
        if a.dtype.kind in "iub" and dt.kind in "iu" and a.size:
            info = np.iinfo(dt)
            if a.min() < info.min or a.max() > info.max:
                raise ValueError(f"sample {i}: field {name!r} has values outside {dt.name}")
        if dt.kind in "iu" and a.dtype.kind not in "iub":
            raise ValueError(f"sample {i}: field {name!r} must be integer, got {a.dtype}")
        out[name] = a.astype(dt, copy=False)
    return out


class ShardWriter:
    """Appends samples, in order, to one shard of an existing cache and commits after each batch.

    ``samples_done`` / ``start_sample`` give the resume point (shard-local count / global index
    of the next sample to append).
    """

    def __init__(self, path: str, shard: int) -> None:
        manifest = fmt.read_manifest(path)
        self.path = path
        self.shard = shard
        self.spec = CacheSpec.from_json(manifest["spec"])
        self.sample_range = fmt.shard_sample_range(shard, manifest["num_samples"], self.spec.num_shards)
        self._kv = fmt.open_kvstore(path)
        progress = fmt.read_json(self._kv, fmt.progress_key(shard)) or {
            "samples_done": 0,
            "tokens_done": 0,
            "complete": False,
            "checksums": {n: {"blocks": [], "tail": None} for n in self.spec.array_names},
        }
        self.samples_done: int = progress["samples_done"]
        self.tokens_done: int = progress["tokens_done"]
        self.complete: bool = progress["complete"]
        n = len(self.sample_range)
        token_len = None if self.complete else fmt.TOKEN_CAPACITY
        self._arrays = {
            name: ts.open(
                fmt.array_spec(path, shard, name, self.spec, token_len), context=fmt.CONTEXT
            ).result()
            for name in self.spec.array_names
        }
        self._offsets = ts.open(
            fmt.array_spec(path, shard, "offsets", self.spec, n + 1), context=fmt.CONTEXT
        ).result()
        self._hashers = self._resume_hashers(progress["checksums"])
        self._offsets_hash = hashlib.sha256(
            self._offsets[1 : self.samples_done + 1].read().result().tobytes()
        )

    @property
    def start_sample(self) -> int:
        """Global index of the next sample to append."""
        return self.sample_range.start + self.samples_done

    def _resume_hashers(self, checksums: dict[str, Any]) -> dict[str, fmt.BlockHasher]:
        """Rebuild the running block hashes by re-reading the committed partial block."""
        block = self.spec.chunk_tokens
        hashers = {}
        for name in self.spec.array_names:
            h = fmt.BlockHasher(block, checksums[name]["blocks"])
            start = len(h.blocks) * block
            h.update(self._arrays[name][start : self.tokens_done].read().result())
            if h.tail != checksums[name]["tail"]:
                raise ValueError(
                    f"shard {self.shard}: committed tail of {name!r} (tokens {start}..{self.tokens_done}) "
                    "does not match its checksum; the cache is corrupt"
                )
            hashers[name] = h
        return hashers

    def append(self, samples: Sequence[Mapping[str, np.ndarray]]) -> None:
        """Write ``samples`` (dicts of input_ids int32[T], loss_mask uint8[T], and in a cache of states
        aux_hidden bf16[T,A,H], last_hidden bf16[T,H]) after the committed ones, then commit.
        """
        if self.complete:
            raise ValueError(f"shard {self.shard} is already finalized")
        if not samples:
            return
        remaining = len(self.sample_range) - self.samples_done
        if len(samples) > remaining:
            raise ValueError(f"shard {self.shard}: {len(samples)} samples appended but only {remaining} left")
        checked = [_check_sample(self.start_sample + i, s, self.spec) for i, s in enumerate(samples)]
        cols = {n: np.concatenate([c[n] for c in checked]) for n in self.spec.array_names}
        t0, t1 = self.tokens_done, self.tokens_done + len(cols["input_ids"])
        ends = t0 + np.cumsum([len(c["input_ids"]) for c in checked], dtype=np.int64)
        k0, k1 = self.samples_done, self.samples_done + len(samples)
        futures = [self._arrays[n][t0:t1].write(cols[n]) for n in self.spec.array_names]
        futures.append(self._offsets[k0 : k1 + 1].write(np.concatenate([[t0], ends]).astype(np.int64)))
        for f in futures:
            f.result()
        for n in self.spec.array_names:
            self._hashers[n].update(cols[n])
        self._offsets_hash.update(ends.tobytes())
        self.samples_done, self.tokens_done = k1, t1
        self._commit()

    def _commit(self) -> None:
        fmt.write_json(self._kv, fmt.progress_key(self.shard), self.progress())

    def progress(self) -> dict[str, Any]:
        """The shard's commit record (what progress.json holds)."""
        return {
            "shard": self.shard,
            "samples_done": self.samples_done,
            "tokens_done": self.tokens_done,
            "complete": self.complete,
            "checksums": {
                **{n: h.state() for n, h in self._hashers.items()},
                "offsets": self._offsets_hash.hexdigest(),
            },
        }

    def finalize_shard(self) -> None:
        """Mark the shard complete (all its samples committed); shrinks arrays to the token count."""
        if self.complete:
            return
        if self.samples_done != len(self.sample_range):
            raise ValueError(
                f"shard {self.shard}: {self.samples_done} of {len(self.sample_range)} samples written"
            )
        for name, arr in self._arrays.items():
            trailing = [None] * (arr.rank - 1)
            self._arrays[name] = arr.resize(
                exclusive_max=[self.tokens_done, *trailing], resize_metadata_only=True
            ).result()
        self.complete = True
        self._commit()


def read_progress(path: str, shard: int) -> dict[str, Any] | None:
    """The committed progress record of ``shard``, or None if nothing was committed."""
    return fmt.read_json(fmt.open_kvstore(path), fmt.progress_key(shard))


def finalize(path: str) -> dict[str, Any]:
    """Check every shard is complete and write the final manifest (counts, checksums); returns it."""
    kv = fmt.open_kvstore(path)
    manifest = fmt.read_manifest(path)
    progress = [fmt.read_json(kv, fmt.progress_key(s["shard"])) for s in manifest["shards"]]
    incomplete = [s["shard"] for s, p in zip(manifest["shards"], progress) if not (p and p["complete"])]
    if incomplete:
        raise ValueError(f"cannot finalize {path!r}: shards {incomplete} are not complete")
    shards = []
    for s, p in zip(manifest["shards"], progress):
        sums = {n: fmt.root_hash(v) for n, v in p["checksums"].items() if n != "offsets"}
        sums["offsets"] = p["checksums"]["offsets"]
        shards.append(
            {
                **{k: s[k] for k in ("shard", "sample_start", "sample_end")},
                "num_samples": p["samples_done"],
                "num_tokens": p["tokens_done"],
                "checksums": sums,
            }
        )
    manifest.update(shards=shards, num_tokens=sum(s["num_tokens"] for s in shards), complete=True)
    fmt.write_json(kv, fmt.MANIFEST, manifest)
    return manifest
