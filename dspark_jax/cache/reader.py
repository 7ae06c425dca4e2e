"""Reading a dspark_jax cache: a grain RandomAccessDataSource and checksum verification."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import tensorstore as ts

from dspark_jax.cache import format as fmt
from dspark_jax.cache.format import CacheSpec

# Keys accepted by ``expect`` and how to find them in a manifest.
_EXPECT_KEYS = {
    "states": lambda m: m["spec"].get("states", True),  # manifests before `CacheSpec.states`: True
    "aux_layer_ids": lambda m: list(m["spec"]["aux_layer_ids"]),
    "hidden_size": lambda m: m["spec"]["hidden_size"],
    "tokenizer_fingerprint": lambda m: m["spec"]["tokenizer_fingerprint"],
    "target_fingerprint": lambda m: m["spec"]["target"].get("fingerprint"),
}


def check_expect(manifest: dict[str, Any], expect: dict[str, Any], where: str) -> None:
    """Raise ValueError naming the key, expected and found value for the first mismatch.

    ``states`` is checked first: a token-row cache names no aux layers, and that is not the news.
    """
    for key in sorted(expect, key=lambda k: k != "states"):
        if key not in _EXPECT_KEYS:
            raise ValueError(f"unknown expect key {key!r}; known: {sorted(_EXPECT_KEYS)}")
        want, found = expect[key], _EXPECT_KEYS[key](manifest)
        if (list(want) if isinstance(want, tuple | list) else want) != found:
            kind = {True: "a cache of target states", False: "a token-row cache (no target states)"}
            note = f" ({kind[found]})" if key == "states" else ""
            raise ValueError(f"cache {where!r} mismatch on {key}: expected {want!r}, found {found!r}{note}")


def committed_counts(path: str, manifest: dict[str, Any], allow_incomplete: bool) -> list[tuple[int, int]]:
    """(samples, tokens) per shard: from the manifest if complete, else from committed progress."""
    if manifest["complete"]:
        return [(s["num_samples"], s["num_tokens"]) for s in manifest["shards"]]
    if not allow_incomplete:
        raise ValueError(
            f"cache {path!r} is incomplete (not finalized): finish the build (rerun build_cache), or read "
            "the committed samples only (inspect_cache --allow_incomplete)"
        )
    kv = fmt.open_kvstore(path)
    out = []
    for s in manifest["shards"]:
        p = fmt.read_json(kv, fmt.progress_key(s["shard"]))
        out.append((p["samples_done"], p["tokens_done"]) if p else (0, 0))
    return out


class CacheDataSource:
    """grain RandomAccessDataSource over a dspark_jax cache, in the original global sample order.

    ``ds[i]`` -> dict of numpy arrays: input_ids int32[T], loss_mask uint8[T], and from a cache of
    states (``has_states``) aux_hidden bfloat16[T, n_aux, H], last_hidden bfloat16[T, H]; with
    ``read_states=False`` only the token rows are read, whatever the cache holds.
    ``expect`` checks the manifest (keys: states, aux_layer_ids, hidden_size, tokenizer_fingerprint,
    target_fingerprint). An incomplete cache raises unless ``allow_incomplete``, which
    exposes only committed samples (each shard's committed prefix, in shard order). Picklable:
    tensorstore handles are reopened lazily in each process.
    """

    def __init__(
        self,
        path: str,
        *,
        expect: dict[str, Any] | None = None,
        allow_incomplete: bool = False,
        read_states: bool = True,
    ) -> None:
        self.path = path
        self.manifest = fmt.read_manifest(path)
        self.check_expect(expect or {})
        self.spec = CacheSpec.from_json(self.manifest["spec"])
        self.has_states = self.spec.states
        self._names = self.spec.array_names if read_states else fmt.TOKEN_ARRAYS
        counts = committed_counts(path, self.manifest, allow_incomplete)
        self._shard_starts = np.concatenate([[0], np.cumsum([c[0] for c in counts])]).astype(np.int64)
        if self._shard_starts[-1] == 0:
            raise ValueError(f"cache {path!r} has 0 samples; nothing to train on")
        self._arrays: dict[tuple[int, str], ts.TensorStore] | None = None
        self._offsets = [self._read_offsets(s, n) for s, (n, _) in enumerate(counts)]

    def check_expect(self, expect: dict[str, Any]) -> None:
        """Raise ValueError naming the first key of ``expect`` the manifest does not match."""
        check_expect(self.manifest, expect, self.path)

    def _read_offsets(self, shard: int, n: int) -> np.ndarray:
        if not n:
            return np.zeros(1, np.int64)
        try:
            offsets = self._open(shard, "offsets")[: n + 1].read().result()
        except ValueError as e:
            raise CacheCorruptError(
                f"cache {self.path!r}: shard {shard}: offsets of samples 0..{n - 1} (shard-local) cannot be "
                f"read ({e}); run inspect_cache --verify and rebuild the cache"
            ) from None
        if offsets[0] != 0 or np.any(np.diff(offsets) <= 0):
            raise CacheCorruptError(f"cache {self.path!r}: shard {shard}: offsets are not increasing from 0")
        return offsets

    def _open(self, shard: int, name: str) -> ts.TensorStore:
        if self._arrays is None:
            self._arrays = {}
        key = (shard, name)
        if key not in self._arrays:
            self._arrays[key] = ts.open(
                fmt.array_spec(self.path, shard, name, self.spec, None), context=fmt.CONTEXT
            ).result()
        return self._arrays[key]

    def __len__(self) -> int:
        return int(self._shard_starts[-1])

    def lengths(self) -> np.ndarray:
        """Tokens of every sample, int64[len(self)], from the offsets alone (no array reads)."""
        return np.concatenate([np.diff(offsets) for offsets in self._offsets]).astype(np.int64)

    def token_counts(self, vocab_size: int) -> np.ndarray:
        """How often each token id occurs among the response tokens (`loss_mask` 1) of every committed
        sample, int64[vocab_size]: the text's token frequencies (e.g. a decoding-time draft vocabulary's)."""
        counts_V = np.zeros(vocab_size, np.int64)
        for shard, offsets in enumerate(self._offsets):
            n = int(offsets[-1])
            if not n:
                continue
            ids, mask = (self._open(shard, name)[:n].read() for name in ("input_ids", "loss_mask"))
            ids = ids.result()[mask.result() != 0]
            if len(ids) and not 0 <= ids.min() <= ids.max() < vocab_size:
                raise CacheCorruptError(
                    f"cache {self.path!r}: shard {shard} holds token ids outside 0..{vocab_size - 1}: the "
                    "cache is of another tokenizer"
                )
            counts_V += np.bincount(ids, minlength=vocab_size)
        return counts_V

    def locate(self, index: int) -> tuple[int, int, int]:
        """(shard, token start, token end) of global sample ``index``."""
        if not 0 <= index < len(self):
            raise IndexError(f"sample index {index} out of range [0, {len(self)})")
        shard = int(np.searchsorted(self._shard_starts, index, side="right")) - 1
        j = index - int(self._shard_starts[shard])
        return shard, int(self._offsets[shard][j]), int(self._offsets[shard][j + 1])

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        shard, t0, t1 = self.locate(int(index))
        futures = {n: self._open(shard, n)[t0:t1].read() for n in self._names}
        out, failed = {}, []
        for name, future in futures.items():
            try:
                out[name] = future.result()
            except ValueError as e:
                failed.append(f"{name} ({e})")
        if failed:
            raise CacheCorruptError(
                f"cache {self.path!r}: shard {shard}: sample {index} (tokens {t0}..{t1 - 1}) cannot be read: "
                f"{'; '.join(failed)}; run inspect_cache --verify and rebuild the cache"
            )
        return out

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_arrays": None}

    def __repr__(self) -> str:
        return f"CacheDataSource({self.path!r}, num_samples={len(self)})"


class CacheCorruptError(ValueError):
    """A checksum or read failure; the message names the shard, array and sample range."""


def _samples_of(offsets: np.ndarray, t0: int, t1: int) -> str:
    a = int(np.searchsorted(offsets, t0, side="right")) - 1
    b = int(np.searchsorted(offsets, t1, side="left"))
    return f"samples {a}..{b - 1} (shard-local)"


def verify(path: str, *, allow_incomplete: bool = False) -> int:
    """Recompute every checksum of the committed data; returns the number of samples verified.

    Raises CacheCorruptError listing every problem found (one line each, naming shard, array and
    shard-local sample range).
    """
    problems, samples = scan(path, allow_incomplete=allow_incomplete)
    if problems:
        raise CacheCorruptError(f"{len(problems)} problem(s) in cache {path!r}:\n" + "\n".join(problems))
    return samples


def scan(path: str, *, allow_incomplete: bool = False) -> tuple[list[str], int]:
    """Every checksum and read problem of the committed data, and the number of samples checked."""
    manifest = fmt.read_manifest(path)
    spec = CacheSpec.from_json(manifest["spec"])
    counts = committed_counts(path, manifest, allow_incomplete)
    kv = fmt.open_kvstore(path)
    problems: list[str] = []
    for s, (n, n_tok) in enumerate(counts):
        if n:
            problems += _scan_shard(path, kv, manifest, spec, s, n, n_tok)
    return problems, sum(c[0] for c in counts)


def _scan_shard(path: str, kv, manifest, spec: CacheSpec, s: int, n: int, n_tok: int) -> list[str]:
    """The problems of one shard's committed `n` samples / `n_tok` tokens."""
    progress = fmt.read_json(kv, fmt.progress_key(s))
    if progress is None:
        return [f"shard {s}: progress.json is missing"]
    sums = progress["checksums"]
    problems = []
    if manifest["complete"]:
        for name, want in manifest["shards"][s]["checksums"].items():
            got = sums[name] if name == "offsets" else fmt.root_hash(sums[name])
            if got != want:
                problems.append(f"shard {s}: {name} checksums in progress.json differ from manifest")

    def read(name: str, a: int, b: int) -> np.ndarray:
        store = ts.open(fmt.array_spec(path, s, name, spec, None), context=fmt.CONTEXT).result()
        return store[a:b].read().result()

    try:
        offsets = read("offsets", 0, n + 1)
    except ValueError as e:
        return [*problems, f"shard {s}: cannot read offsets (samples 0..{n - 1}): {e}"]
    if hashlib.sha256(offsets[1:].tobytes()).hexdigest() != sums["offsets"]:
        return [*problems, f"shard {s}: offsets checksum mismatch (samples 0..{n - 1})"]
    if offsets[0] != 0 or offsets[-1] != n_tok or np.any(np.diff(offsets) <= 0):
        return [*problems, f"shard {s}: offsets are not increasing from 0 to {n_tok}"]
    block = spec.chunk_tokens
    for name in spec.array_names:
        blocks, tail = sums[name]["blocks"], sums[name]["tail"]
        for b in range(-(-n_tok // block)):
            t0, t1 = b * block, min((b + 1) * block, n_tok)
            what = f"tokens {t0}..{t1 - 1}, {_samples_of(offsets, t0, t1)}"
            want = blocks[b] if b < len(blocks) else tail
            try:
                if fmt.sha256(read(name, t0, t1)) != want:
                    problems.append(f"shard {s}: {name} checksum mismatch at {what}")
            except ValueError as e:
                problems.append(f"shard {s}: cannot read {name} {what}: {e}")
    return problems
