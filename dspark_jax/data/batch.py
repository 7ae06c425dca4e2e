"""The training batch: one spec of field names, dtypes and shapes for the pipeline, the step and AOT checks.

Shape letters (see the legend in `dspark_jax/__init__.py`): `B` rows, `T` = `data.max_length`,
`A` aux layers, `H` target hidden size, `N` = `train.num_anchors` (per row). A row holds one sample, or
with `data.pack` several whole samples one after another: `positions` restarts at 0 for each, and a
block sees only its own sample (`dspark_jax.draft.blocks`).

A run with `data.features = "online"` reads token rows only and computes the target's states in the
step: its batches lack the `STATE_FIELDS` (`Dims.states` False).

The pipeline builds every field on the host; the step reads the `device` ones. Per-prediction
arrays (labels, Markov predecessors, eval mask, teacher states) are derived on device from these
fields by `dspark_jax.draft.blocks`, so a step that moves anchors (Draft Memory) uses the same math.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from dspark_jax.data.anchors import sample_anchors


@dataclasses.dataclass(frozen=True)
class Field:
    name: str
    dtype: np.dtype
    dims: str  # one shape letter per axis
    device: bool  # read by the train/eval step
    doc: str


FIELDS: tuple[Field, ...] = (
    Field("input_ids", np.dtype(np.int32), "BT", True, "token ids, padded with the tokenizer's pad id"),
    Field("loss_mask", np.dtype(np.uint8), "BT", True, "1 on response tokens, 0 on prompt and padding"),
    Field("aux_hidden", np.dtype(ml_dtypes.bfloat16), "BTAH", True, "target aux layer outputs"),
    Field("last_hidden", np.dtype(ml_dtypes.bfloat16), "BTH", True, "target post-norm final state S"),
    Field(
        "positions",
        np.dtype(np.int32),
        "BT",
        True,
        "position of each token in its own sample (RoPE; restarts at 0 per packed sample); 0 on padding",
    ),
    Field("anchors", np.dtype(np.int32), "BN", True, "sorted anchors (row indices); padding = ANCHOR_PAD"),
    Field("block_keep", np.dtype(np.uint8), "BN", True, "1 for a real anchor, 0 for padding"),
    Field("seq_len", np.dtype(np.int32), "B", False, "tokens kept after truncation (all samples of the row)"),
    Field("num_samples", np.dtype(np.int32), "B", False, "samples packed in the row (1 without packing)"),
)
DEVICE_FIELDS: tuple[str, ...] = tuple(f.name for f in FIELDS if f.device)
# The target's states: read from the cache offline, computed in the step online (absent from the batch).
STATE_FIELDS: tuple[str, ...] = ("aux_hidden", "last_hidden")
# The per-token fields a cache record provides (the pipeline adds `positions`).
RECORD_FIELDS: dict[str, np.dtype] = {
    f.name: f.dtype for f in FIELDS if f.name in ("input_ids", "loss_mask", *STATE_FIELDS)
}
FEATURES = ("offline", "online")


def device_field_names(states: bool) -> tuple[str, ...]:
    """The fields the step reads, with or without the `STATE_FIELDS`, in `FIELDS` order."""
    return tuple(name for name in DEVICE_FIELDS if states or name not in STATE_FIELDS)


def record_fields(states: bool) -> dict[str, np.dtype]:
    """The per-token fields a record must provide, with or without the `STATE_FIELDS`."""
    return {name: dtype for name, dtype in RECORD_FIELDS.items() if states or name not in STATE_FIELDS}


@dataclasses.dataclass(frozen=True)
class Dims:
    """The sizes a batch's shapes depend on, besides its rows, and whether it holds the `STATE_FIELDS`."""

    max_length: int  # T
    num_aux: int  # A
    hidden_size: int  # H
    num_anchors: int  # N
    states: bool = True


def shapes(rows: int, dims: Dims) -> dict[str, tuple]:
    """Shape of every field of a batch of `rows` rows (in `FIELDS` order; no states unless `dims.states`)."""
    sizes = {"B": rows, "T": dims.max_length, "A": dims.num_aux, "H": dims.hidden_size, "N": dims.num_anchors}
    kept = [f for f in FIELDS if dims.states or f.name not in STATE_FIELDS]
    return {f.name: tuple(sizes[d] for d in f.dims) for f in kept}


def abstract_device_batch(rows: int, dims: Dims) -> dict[str, jax.ShapeDtypeStruct]:
    """`ShapeDtypeStruct`s of the device fields, for ahead-of-time compilation."""
    all_shapes = shapes(rows, dims)
    names = device_field_names(dims.states)
    return {f.name: jax.ShapeDtypeStruct(all_shapes[f.name], f.dtype) for f in FIELDS if f.name in names}


COUNTED_FIELDS = ("seq_len", "num_samples", "block_keep")


def batch_counts(batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """int32 totals of the `COUNTED_FIELDS` of a batch: `tokens` (kept tokens), `samples`, `anchors` (real
    blocks) and `rows`. On global arrays (`pipeline.to_global`) they count the rows of every process."""
    i32 = jnp.int32
    return {
        "tokens": jnp.sum(batch["seq_len"], dtype=i32),
        "samples": jnp.sum(batch["num_samples"], dtype=i32),
        "anchors": jnp.sum(batch["block_keep"], dtype=i32),
        "rows": jnp.asarray(batch["seq_len"].shape[0], i32),
    }


def device_fields(batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The fields of `batch` that the step reads: the `STATE_FIELDS` when the batch holds them (offline),
    every other device field always (KeyError naming the one missing)."""
    return {name: batch[name] for name in device_field_names(STATE_FIELDS[0] in batch)}


def synthetic(
    rows: int, dims: Dims, vocab_size: int, *, prompt_length: int | None = None, seed: int = 0
) -> dict[str, np.ndarray]:
    """A batch of the spec with random tokens and states (none without `dims.states`), the response from
    `prompt_length` on (default: a quarter of the sequence), anchors drawn as the pipeline draws them. For
    benchmarks and tests: the work of a step does not depend on the values."""
    rng = np.random.default_rng(seed)
    max_length, num_aux, hidden_size = dims.max_length, dims.num_aux, dims.hidden_size
    prompt = max_length // 4 if prompt_length is None else prompt_length
    loss_mask = np.zeros((rows, max_length), np.uint8)
    loss_mask[:, prompt:] = 1
    anchors, keep = map(np.stack, zip(*(sample_anchors(m, dims.num_anchors, rng) for m in loss_mask)))
    bf16 = ml_dtypes.bfloat16
    input_ids = rng.integers(0, vocab_size, (rows, max_length)).astype(np.int32)
    states = {}
    if dims.states:  # drawn after the ids: with or without states, the other fields are the same
        states["aux_hidden"] = rng.normal(size=(rows, max_length, num_aux, hidden_size)).astype(bf16)
        states["last_hidden"] = rng.normal(size=(rows, max_length, hidden_size)).astype(bf16)
    return {
        "input_ids": input_ids,
        "loss_mask": loss_mask,
        **states,
        "positions": np.broadcast_to(np.arange(max_length, dtype=np.int32), (rows, max_length)).copy(),
        "anchors": anchors,
        "block_keep": keep,
        "seq_len": np.full((rows,), max_length, np.int32),
        "num_samples": np.ones((rows,), np.int32),
    }
