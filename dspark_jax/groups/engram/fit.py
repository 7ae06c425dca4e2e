"""Fitting an Engram table in one streaming pass over a frozen target's forward.

Each row holds the running mean of a fixed, seeded per-head projection of the target's post-norm state
`S[t]` over the positions whose n-gram (ending at `t`) hashes to it; rows never hit stay zero. The
projection of hash head `z` is `W_z [H, W]`, Gaussian with variance `1/H` from `projection_seed`.

Sequences go through the target longest bucket first (power-of-two lengths, right padding); the sums
and counts live on device. Every `commit_every` forwards they are written next to the table
(`<table>.partial.safetensors`, atomically) with the number of forwards done, so a killed fit resumes
where it stopped; the finished table replaces the partial file.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from dspark_jax.groups.engram.hashing import HashSpec
from dspark_jax.groups.engram.table import device_table
from dspark_jax.target.generate import prompt_bucket
from dspark_jax.target.model import Transformer

log = logging.getLogger(__name__)


def projections(spec: HashSpec, hidden: int, seed: int) -> np.ndarray:
    """float32 `[Z, H, W]`: the fixed per-head projections of `S[t]`."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((spec.num_hashes, hidden, spec.head_dim)) / np.sqrt(hidden)).astype(
        np.float32
    )


def batches(lengths: Sequence[int], tokens_per_batch: int) -> list[list[int]]:
    """Sequence indices per forward: one power-of-two length bucket each, longest bucket first."""
    by_bucket: dict[int, list[int]] = {}
    for index, n in enumerate(lengths):
        by_bucket.setdefault(prompt_bucket(n), []).append(index)
    out = []
    for length in sorted(by_bucket, reverse=True):
        rows = max(1, tokens_per_batch // length)
        members = by_bucket[length]
        out += [members[i : i + rows] for i in range(0, len(members), rows)]
    return out


def _accumulate(target_state, table, proj_ZxHxW, sums_xW, counts_x, tokens_BxT, valid_BxT, *, graphdef):
    hidden_BxTxH = nnx.merge(graphdef, target_state)(tokens_BxT, valid_BxT=valid_BxT).hidden_BxTxH
    positions_BxT = jnp.broadcast_to(jnp.arange(tokens_BxT.shape[1]), tokens_BxT.shape)
    rows_BxTxZ = table.row_ids(tokens_BxT, positions_BxT)
    values_BxTxZxW = jnp.einsum("bth,zhw->btzw", hidden_BxTxH.astype(jnp.float32), proj_ZxHxW)
    weight_BxT = valid_BxT.astype(jnp.float32)
    sums_xW = sums_xW.at[rows_BxTxZ].add(values_BxTxZxW * weight_BxT[..., None, None])
    counts_x = counts_x.at[rows_BxTxZ].add(jnp.broadcast_to(weight_BxT[..., None], rows_BxTxZ.shape))
    return sums_xW, counts_x


def partial_path(table_path: str | os.PathLike) -> Path:
    return Path(str(table_path) + ".partial.safetensors")


def _save_partial(path: Path, sums, counts, done: int, fingerprint: str) -> None:
    from safetensors.numpy import save_file

    tmp = path.with_name(path.name + ".tmp")
    meta = {"forwards_done": str(done), "fit_fingerprint": fingerprint}
    save_file({"sums": np.asarray(sums), "counts": np.asarray(counts)}, str(tmp), metadata=meta)
    os.replace(tmp, path)


def _load_partial(path: Path, fingerprint: str):
    """`(sums, counts, forwards done)` of a matching partial fit, or None (a stale one is discarded)."""
    from safetensors import safe_open

    if not path.exists():
        return None
    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
            if meta.get("fit_fingerprint") != fingerprint:
                log.warning("Engram fit %s belongs to other fit settings: starting over", path)
                return None
            return f.get_tensor("sums"), f.get_tensor("counts"), int(meta["forwards_done"])
    except Exception as e:  # a torn or foreign file: the fit restarts rather than trusting it
        log.warning("Engram fit %s is unreadable (%s): starting over", path, e)
        return None


def fit_rows(
    model: Transformer,
    spec: HashSpec,
    compress_V: np.ndarray,
    sequences: Sequence[np.ndarray],
    *,
    table_path: str | os.PathLike,
    fingerprint: str,
    projection_seed: int,
    tokens_per_batch: int = 8192,
    commit_every: int = 16,
    progress: bool = True,
) -> tuple[np.ndarray, dict]:
    """The fitted rows `[R, W]` of `spec` over `sequences` (token ids) and fit statistics.

    `fingerprint` identifies everything the fit depends on; a partial fit with another one is ignored.
    """
    graphdef, target_state = nnx.split(model)
    table = device_table(spec, compress_V, np.zeros((1, spec.head_dim), np.float32))
    proj = jnp.asarray(projections(spec, model.cfg.hidden_size, projection_seed))
    step = jax.jit(functools.partial(_accumulate, graphdef=graphdef), donate_argnums=(3, 4))
    plan = batches([len(s) for s in sequences], tokens_per_batch)
    partial = partial_path(table_path)
    resumed = _load_partial(partial, fingerprint)
    if resumed is None:
        sums, counts, done = (
            np.zeros((spec.num_rows, spec.head_dim), np.float32),
            np.zeros(spec.num_rows, np.float32),
            0,
        )
    else:
        sums, counts, done = resumed
        log.info("Engram fit resumes after %d of %d forwards", done, len(plan))
    sums, counts = jnp.asarray(sums), jnp.asarray(counts)
    total_tokens = sum(len(s) for s in sequences)
    bar = tqdm(total=total_tokens, desc=f"fit Engram {table_path}", unit="tok", disable=not progress)
    bar.update(sum(len(sequences[i]) for group in plan[:done] for i in group))
    begin = time.perf_counter()
    for index in range(done, len(plan)):
        group = plan[index]
        length = prompt_bucket(max(len(sequences[i]) for i in group))
        rows = max(1, tokens_per_batch // length)
        tokens = np.zeros((rows, length), np.int32)
        valid = np.zeros((rows, length), bool)
        for row, i in enumerate(group):
            tokens[row, : len(sequences[i])] = sequences[i]
            valid[row, : len(sequences[i])] = True
        sums, counts = step(target_state, table, proj, sums, counts, jnp.asarray(tokens), jnp.asarray(valid))
        bar.update(int(valid.sum()))
        if (index + 1) % commit_every == 0 and index + 1 < len(plan):
            _save_partial(partial, sums, counts, index + 1, fingerprint)
    bar.close()
    counts = np.asarray(counts)
    rows_xW = np.asarray(sums) / np.maximum(counts, 1)[:, None]
    stats = {
        "sequences": len(sequences),
        "tokens": total_tokens,
        "rows_hit": int((counts > 0).sum()),
        "rows": spec.num_rows,
        "seconds_this_process": round(time.perf_counter() - begin, 1),
    }
    log.info("Engram fit: %s", json.dumps(stats))
    return rows_xW.astype(np.float32), stats
