"""The grain input pipeline: cache records -> shuffled, padded, anchored per-process batches.

Records (`source[i]`, any grain random-access source): `input_ids int32[T]`,
`loss_mask uint8[T]`, `aux_hidden bf16[T, A, H]`, `last_hidden bf16[T, H]`; `T` varies per
record (other fields of a record are ignored). With `PipelineConfig.states` False (online features:
the step computes the target's states) records need only `input_ids` and `loss_mask`, any states they
hold are ignored, and batches have no `aux_hidden`/`last_hidden`; every other field is what the
pipeline with states gives for the same records and seed.

Order of operations (all deterministic in `PipelineConfig.seed`):

1. `MapDataset.range(len(source))` shuffled with `seed`, repeated `num_epochs` times with
   a different shuffle per epoch; stream position `g` is epoch `g // len(source)`. Packed
   (`pack`): the stream is a `PackPlan`'s rows instead, each a run of whole records of one epoch's
   seeded order that fits in `max_length` tokens.
2. Each stream element (row) reads its record(s), lays them out one after another, pads/truncates
   to `max_length` and draws its anchors with an RNG seeded by `(seed, epoch, g)`: independent of
   worker count, process count and iterator restarts.
3. The stream is cut into chunks of `per_process_batch`; process `p` of `num_processes` takes
   chunks `p, p + num_processes, ...`, so global step `i` covers stream positions
   `[i * global_batch, (i + 1) * global_batch)` whatever the process count. With finite epochs the tail that
   does not fill a global batch is dropped.

Batch dict (per process, `B = per_process_batch`, `T = max_length`, `N = num_anchors`): the
fields of `dspark_jax.data.batch.FIELDS` (less its `STATE_FIELDS` when `states` is False) -- token
fields padded to `T` (`input_ids` with `pad_id`, the rest with 0), `positions` (per record, from 0),
`anchors`/`block_keep` (see `anchors.sample_anchors` for the padding convention), `seq_len` (tokens
after truncation) and `num_samples` (records in the row). Labels, Markov predecessors and eval masks
are derived on device (`dspark_jax.draft.blocks`). The iterator counts truncated records
(`truncated_count`, a log line each time it passes a power of two) and that count is part of
its checkpointed state.

Checkpointing: the iterator is a `grain.DatasetIterator`; `train.checkpoint.Checkpointer` saves
its JSON state through grain's orbax handler (one file per process) and restores it into a fresh
`make_iterator(source, config)` with the same source and config. The state layout depends on
`worker_count` (grain keeps one cursor per worker), so resume with the same `worker_count` and
process count. Worker processes are spawned: scripts
that set `worker_count > 0` need the usual `if __name__ == "__main__":` guard.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import grain
import jax
import numpy as np
from absl import flags
from jax.sharding import Mesh, NamedSharding

from dspark_jax.data import anchors as anchors_lib
from dspark_jax.data.batch import record_fields
from dspark_jax.sharding import DEFAULT_RULES, Rules, logical_to_spec

log = logging.getLogger(__name__)

Batch = dict[str, np.ndarray]

_TRUNCATED = "_truncated"


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """Input pipeline settings.

    `batch_size` is the global batch (all processes, in rows); `num_epochs=None` repeats forever;
    `worker_count > 0` prepares batches in that many grain worker processes; `pack` puts several
    whole records in a row (`PackPlan`) instead of one; `states` False leaves the target's states out
    (records need none, batches have none).
    """

    max_length: int
    num_anchors: int
    batch_size: int
    seed: int
    pad_id: int
    num_epochs: int | None = None
    worker_count: int = 0
    pack: bool = False
    states: bool = True

    def __post_init__(self):
        for key in ("max_length", "num_anchors", "batch_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"PipelineConfig.{key} must be >= 1, got {getattr(self, key)}")
        if self.num_epochs is not None and self.num_epochs < 1:
            raise ValueError(f"PipelineConfig.num_epochs must be >= 1 or None, got {self.num_epochs}")
        if self.worker_count < 0:
            raise ValueError(f"PipelineConfig.worker_count must be >= 0, got {self.worker_count}")


def per_process_batch_size(config: PipelineConfig, process_count: int) -> int:
    """Rows of the global batch that one process loads; the global batch must divide evenly."""
    if config.batch_size % process_count:
        raise ValueError(
            f"PipelineConfig.batch_size={config.batch_size} (global) is not divisible by the "
            f"process count {process_count}"
        )
    return config.batch_size // process_count


def prepare_row(
    records: Sequence[Mapping[str, np.ndarray]], config: PipelineConfig, rng: np.random.Generator
) -> Batch:
    """Records one after another in a row of `max_length` tokens, with anchors drawn over the row.

    Fields as in the batch, without the batch dim. `positions` restarts at 0 for each record; a record
    that does not fit in what is left of the row is truncated (a packing plan only puts records
    together that fit). Adds the scalar `_truncated` flag, consumed by the iterator's truncation counter.
    """
    out: Batch = {}
    positions = np.zeros(config.max_length, np.int32)
    offset, truncated = 0, False
    fields = record_fields(config.states)
    for record in records:
        missing = [name for name in fields if name not in record]
        if missing:
            raise ValueError(f"record lacks fields {missing}; records need {list(fields)}")
        length = int(np.shape(record["input_ids"])[0])
        kept = min(length, config.max_length - offset)
        for name, dtype in fields.items():
            value = np.asarray(record[name])
            if value.shape[:1] != (length,):
                raise ValueError(f"field {name!r} has shape {value.shape}, expected leading length {length}")
            if name not in out:
                fill = config.pad_id if name == "input_ids" else 0
                out[name] = np.full((config.max_length, *value.shape[1:]), fill, dtype=dtype)
            out[name][offset : offset + kept] = value[:kept]
        positions[offset : offset + kept] = np.arange(kept)
        truncated |= kept < length
        offset += kept
    out["positions"] = positions
    out["anchors"], out["block_keep"] = anchors_lib.sample_anchors(
        out["loss_mask"], config.num_anchors, rng, positions
    )
    out["seq_len"] = np.int32(offset)
    out["num_samples"] = np.int32(len(records))
    out[_TRUNCATED] = np.uint8(truncated)
    return out


def record_lengths(source: Sequence) -> np.ndarray:
    """Tokens per record: the source's `lengths()` (caches read them from their index), else read."""
    if hasattr(source, "lengths"):
        return np.asarray(source.lengths(), np.int64)
    return np.array([np.shape(source[i]["input_ids"])[0] for i in range(len(source))], np.int64)


class PackPlan(Sequence):
    """The rows of a packed stream: `plan[g] = (epoch, record indices of row g)`.

    Each epoch takes the records in its own seeded random order and packs consecutive ones into a row
    while they fit in `max_length` tokens (next fit; a longer record gets a row of its own and is
    truncated there). Epochs are planned when first reached; `num_epochs=None` repeats forever (the
    length is then `sys.maxsize`, as grain's `repeat`). Thread-safe (grain's prefetch threads read rows
    concurrently; planning an epoch is one critical section) and picklable, for grain workers.
    """

    def __init__(self, lengths: np.ndarray, max_length: int, seed: int, num_epochs: int | None):
        self._lengths = np.minimum(np.asarray(lengths, np.int64), max_length)
        self._max_length = max_length
        self._seed = seed
        self._num_epochs = num_epochs
        self._rows: list[tuple[int, ...]] = []  # the planned epochs' rows, in stream order
        self._epoch_starts = [0]  # first row of each planned epoch, then the end
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _plan_through(self, epochs: int) -> None:
        """Plans epochs until `epochs` are planned (under the lock: two threads never plan one epoch)."""
        with self._lock:
            while len(self._epoch_starts) - 1 < epochs:
                self._plan_epoch()

    def _plan_epoch(self) -> None:
        epoch = len(self._epoch_starts) - 1
        order = np.random.default_rng((self._seed, epoch)).permutation(len(self._lengths))
        row: list[int] = []
        used = 0
        for index in order.tolist():
            if row and used + self._lengths[index] > self._max_length:
                self._rows.append(tuple(row))
                row, used = [], 0
            row.append(index)
            used += int(self._lengths[index])
        self._rows.append(tuple(row))
        self._epoch_starts.append(len(self._rows))

    def __len__(self) -> int:
        if self._num_epochs is None:
            return sys.maxsize
        self._plan_through(self._num_epochs)
        return self._epoch_starts[self._num_epochs]

    def __getitem__(self, row: int) -> tuple[int, tuple[int, ...]]:
        if row < 0 or (self._num_epochs is not None and row >= len(self)):
            raise IndexError(f"row {row} out of range")
        if self._epoch_starts[-1] <= row:
            with self._lock:
                while self._epoch_starts[-1] <= row:
                    self._plan_epoch()
        epoch = bisect.bisect_right(self._epoch_starts, row) - 1
        return epoch, self._rows[row]


class PipelineIterator(grain.DatasetIterator):
    """The pipeline iterator: grain state plus the truncation counter (`truncated_count`, `sample_count`).

    Strips the per-record truncation flags from the batches it yields.
    """

    def __init__(self, parent: grain.DatasetIterator):
        super().__init__(parent)
        self.truncated_count = 0
        self.sample_count = 0

    def __next__(self) -> Batch:
        batch = dict(next(self._parent))
        flags = batch.pop(_TRUNCATED)
        before = self.truncated_count
        self.truncated_count += int(flags.sum())
        self.sample_count += int(flags.shape[0])
        if self.truncated_count and before.bit_length() != self.truncated_count.bit_length():
            log.warning(
                "input pipeline: %d of %d samples so far were truncated to max_length",
                self.truncated_count,
                self.sample_count,
            )
        return batch

    def get_state(self) -> dict[str, Any]:
        return {
            "parent": self._parent.get_state(),
            "truncated_count": self.truncated_count,
            "sample_count": self.sample_count,
        }

    def set_state(self, state: dict[str, Any]) -> None:
        self._parent.set_state(state["parent"])
        self.truncated_count = int(state["truncated_count"])
        self.sample_count = int(state["sample_count"])


class _PipelineDataset(grain.IterDataset):
    """Wraps the batch dataset so that iterating it gives a `PipelineIterator`."""

    def __iter__(self) -> PipelineIterator:
        return PipelineIterator(self._parent.__iter__())


class _Prepare:
    """Picklable `map_with_index` function: stream position `g`, source index (or, packed, a `PackPlan`
    row `(epoch, indices)`) -> prepared row."""

    def __init__(self, source: Sequence, config: PipelineConfig):
        self._source = source
        self._config = config
        self._num_records = len(source)

    def __call__(self, position: int, item: int | tuple[int, tuple[int, ...]]) -> Batch:
        if isinstance(item, tuple):
            epoch, indices = item
        else:
            epoch, indices = position // self._num_records, (int(item),)
        rng = np.random.default_rng((self._config.seed, epoch, position))
        try:
            records = [self._source[int(i)] for i in indices]
            return prepare_row(records, self._config, rng)
        except ValueError as e:
            which = f"record {indices[0]}" if len(indices) == 1 else f"record among {list(indices)}"
            raise ValueError(f"input pipeline: bad {which} of the source: {e}") from e


def make_dataset(
    source: Sequence,
    config: PipelineConfig,
    *,
    process_index: int | None = None,
    process_count: int | None = None,
) -> grain.IterDataset:
    """The per-process batch dataset (see the module docstring); process defaults come from jax."""
    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} is not in [0, {process_count})")
    local_batch = per_process_batch_size(config, process_count)
    num_records = len(source)
    if num_records == 0:
        raise ValueError("input pipeline: the data source is empty")
    if config.num_epochs is not None and num_records * config.num_epochs < config.batch_size:
        raise ValueError(
            f"input pipeline: {num_records} records x {config.num_epochs} epochs is less than one "
            f"global batch of {config.batch_size}"
        )
    prepare = _Prepare(source, config)
    prepare(0, 0)  # fail fast on a malformed record format

    if config.pack:
        plan = PackPlan(record_lengths(source), config.max_length, config.seed, config.num_epochs)
        if config.num_epochs is not None and len(plan) < config.batch_size:
            raise ValueError(
                f"input pipeline: {num_records} records x {config.num_epochs} epochs pack into {len(plan)} "
                f"rows, less than one global batch of {config.batch_size}"
            )
        ds = grain.MapDataset.source(plan)
    else:
        ds = grain.MapDataset.range(num_records).seed(config.seed).shuffle().repeat(config.num_epochs)
    ds = ds.map_with_index(prepare)
    ds = ds.batch(local_batch, drop_remainder=True)
    if config.num_epochs is not None:
        ds = ds[: len(ds) // process_count * process_count]
    ds = ds[process_index::process_count]
    it_ds = ds.to_iter_dataset()
    if config.worker_count:
        # grain's worker start-up reads absl flags; outside `absl.app.run` (tests, notebooks)
        # they are unparsed and grain would raise, so fall back to the flag defaults.
        if not flags.FLAGS.is_parsed():
            flags.FLAGS.mark_as_parsed()
        it_ds = it_ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=config.worker_count))
    return _PipelineDataset(it_ds)


def make_iterator(
    source: Sequence,
    config: PipelineConfig,
    *,
    process_index: int | None = None,
    process_count: int | None = None,
) -> PipelineIterator:
    """A fresh checkpointable iterator over `make_dataset(...)`; has `truncated_count`."""
    return iter(make_dataset(source, config, process_index=process_index, process_count=process_count))


def to_global(
    batch: Mapping[str, np.ndarray], mesh: Mesh, rules: Rules = DEFAULT_RULES
) -> dict[str, jax.Array]:
    """Process-local batch -> global `jax.Array`s, leading dim on the 'batch' logical axis.

    Every process passes its `[B_local, ...]` rows; the global leading dim is
    `B_local * jax.process_count()`.
    """
    out = {}
    for name, local in batch.items():
        global_shape = (local.shape[0] * jax.process_count(), *local.shape[1:])
        spec = logical_to_spec(("batch",) + (None,) * (local.ndim - 1), global_shape, mesh, rules)
        out[name] = jax.make_array_from_process_local_data(NamedSharding(mesh, spec), local, global_shape)
    return out
