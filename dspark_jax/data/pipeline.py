"""The grain input pipeline: cache records -> shuffled, padded, anchored per-process batches.

Records (`source[i]`, any grain random-access source): `input_ids int32[T]`,
`loss_mask uint8[T]`, `aux_hidden bf16[T, A, H]`, `last_hidden bf16[T, H]`; `T` varies per
record (other fields of a record are ignored).

Order of operations (all deterministic in `PipelineConfig.seed`):

1. `MapDataset.range(len(source))` shuffled with `seed`, repeated `num_epochs` times with
   a different shuffle per epoch; stream position `g` is epoch `g // len(source)`.
2. Each stream element reads its record, pads/truncates it to `max_length` and draws its
   anchors with an RNG seeded by `(seed, epoch, g)`: independent of worker count,
   process count and iterator restarts.
3. The stream is cut into chunks of `per_process_batch`; process `p` of `num_processes` takes
   chunks `p, p + num_processes, ...`, so global step `i` covers stream positions
   `[i * global_batch, (i + 1) * global_batch)` whatever the process count. With finite epochs the tail that
   does not fill a global batch is dropped.

Batch dict (per process, `B = per_process_batch`, `T = max_length`, `N = num_anchors`): the
fields of `dspark_jax.data.batch.FIELDS` -- token fields padded to `T` (`input_ids` with
`pad_id`, the rest with 0), `anchors`/`block_keep` (see `anchors.sample_anchors` for the padding
convention) and `seq_len` (length after truncation). Labels, Markov predecessors and eval masks
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

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import grain
import jax
import numpy as np
from absl import flags
from jax.sharding import Mesh, NamedSharding

from dspark_jax.data import anchors as anchors_lib
from dspark_jax.data.batch import TOKEN_FIELDS
from dspark_jax.sharding import DEFAULT_RULES, Rules, logical_to_spec

log = logging.getLogger(__name__)

Batch = dict[str, np.ndarray]

_TRUNCATED = "_truncated"


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """Input pipeline settings.

    `batch_size` is the global batch (all processes); `num_epochs=None` repeats forever;
    `worker_count > 0` prepares batches in that many grain worker processes.
    """

    max_length: int
    num_anchors: int
    batch_size: int
    seed: int
    pad_id: int
    num_epochs: int | None = None
    worker_count: int = 0

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


def prepare_record(
    record: Mapping[str, np.ndarray], config: PipelineConfig, rng: np.random.Generator
) -> Batch:
    """One record padded/truncated to `max_length` with its anchors (fields as in the batch, no batch dim).

    Adds the scalar `_truncated` flag, consumed by the iterator's truncation counter.
    """
    missing = [name for name in TOKEN_FIELDS if name not in record]
    if missing:
        raise ValueError(f"record lacks fields {missing}; records need {list(TOKEN_FIELDS)}")
    length = int(np.shape(record["input_ids"])[0])
    kept = min(length, config.max_length)
    out: Batch = {}
    for name, dtype in TOKEN_FIELDS.items():
        value = np.asarray(record[name])
        if value.shape[:1] != (length,):
            raise ValueError(f"field {name!r} has shape {value.shape}, expected leading length {length}")
        fill = config.pad_id if name == "input_ids" else 0
        padded = np.full((config.max_length, *value.shape[1:]), fill, dtype=dtype)
        padded[:kept] = value[:kept]
        out[name] = padded
    out["anchors"], out["block_keep"] = anchors_lib.sample_anchors(out["loss_mask"], config.num_anchors, rng)
    out["seq_len"] = np.int32(kept)
    out[_TRUNCATED] = np.uint8(length > config.max_length)
    return out


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
    """Picklable `map_with_index` function: stream position `g`, source index -> prepared record."""

    def __init__(self, source: Sequence, config: PipelineConfig):
        self._source = source
        self._config = config
        self._num_records = len(source)

    def __call__(self, position: int, source_index: int) -> Batch:
        epoch = position // self._num_records
        rng = np.random.default_rng((self._config.seed, epoch, position))
        try:
            return prepare_record(self._source[int(source_index)], self._config, rng)
        except ValueError as e:
            raise ValueError(f"input pipeline: bad record {source_index} of the source: {e}") from e


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
