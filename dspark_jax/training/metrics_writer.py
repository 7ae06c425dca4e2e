"""Metrics to `workdir/metrics.jsonl` (one JSON object per write) and TensorBoard.

Each line is `{"step": N, "train/loss": 2.31, ...}` with float values; NaN and ±inf are
written as `null` so the file stays strict JSON (TensorBoard still gets the raw value).
Only process 0 writes; on other processes every method is a no-op.

Resume safety: a run killed after its last checkpoint has logged steps that the resumed
run logs again. `MetricWriter(workdir, resume_step=k)` drops the lines with `step > k`
and asks TensorBoard to hide its events from step `k + 1` on (tensorboardX `purge_step`),
so the resumed run's file equals an uninterrupted run's. Pass the step the run starts
from (0 for a fresh run, which clears a previous run's lines); `None` appends.

A URL work directory (`gs://bucket/run`, anything `etils.epath` opens) is an object store,
which cannot append: the writer holds the file's lines (the kept ones read back on start)
and rewrites the whole object on start, at most every `sync_seconds` while writing, on
`flush()` and on `close()`. Flush before each checkpoint so that a resumed run finds every
line up to its step. TensorBoard events go to `gs://` and `s3://` through tensorboardX's own
uploaders (they need `google-cloud-storage` or `boto3`, not tensorflow); without one, or for
another scheme, one warning says so and only the JSONL file is written.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from etils import epath
from tensorboardX import SummaryWriter, record_writer

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
# TensorBoard's legal tag characters: a name is written to both outputs unchanged.
_NAME = re.compile(r"[A-Za-z0-9_.\-/]+")
TENSORBOARD_DIR = "tensorboard"
_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")
# URL schemes tensorboardX uploads events to: the package it needs, and whether it is installed.
_TENSORBOARD_UPLOADERS = {
    "gs": ("google-cloud-storage", record_writer.GCS_ENABLED),
    "s3": ("boto3", record_writer.S3_ENABLED),
}


class MetricWriter:
    """Writes scalar metrics per step to the JSONL file and TensorBoard (process 0 only)."""

    def __init__(
        self,
        workdir: str | os.PathLike[str],
        *,
        resume_step: int | None = None,
        enable_tensorboard: bool = True,
        sync_seconds: float = 60.0,
    ):
        url = _URL.match(os.fspath(workdir))
        scheme = url[1] if url else None
        self.workdir = epath.Path(workdir)
        self.path = self.workdir / METRICS_FILE
        self._sync_seconds = sync_seconds
        self._active = jax.process_index() == 0
        self._file = None
        self._lines: list[str] | None = None  # a URL work directory's whole file
        self._tensorboard = None
        self._closed = False
        if not self._active:
            return
        if scheme is None:
            self.workdir.mkdir(parents=True, exist_ok=True)
            if resume_step is not None:
                tmp = self.path.parent / (self.path.name + ".tmp")
                tmp.write_text("".join(_kept_lines(self.path, resume_step)))
                tmp.replace(self.path)
            self._file = self.path.open("a")
        else:
            self._lines = _kept_lines(self.path, resume_step)
            self._upload()
        if enable_tensorboard:
            self._tensorboard = _tensorboard(self.workdir / TENSORBOARD_DIR, scheme, resume_step)

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Writes one line for `step`; every value must be a scalar (float, numpy or jax)."""
        if self._closed:
            raise ValueError(f"the metric writer of {self.path} is closed")
        if not self._active:
            return
        values = {name: _scalar(name, value) for name, value in metrics.items()}
        if "step" in values:
            raise ValueError("'step' is reserved for the step number; rename the metric")
        illegal = [name for name in values if not _NAME.fullmatch(name)]
        if illegal:
            raise ValueError(
                f"metric name {illegal[0]!r} is not a legal TensorBoard tag (letters, digits, '_', '.', "
                "'-', '/'); the JSONL keys and TensorBoard tags are the same names"
            )
        record = {"step": int(step), **{k: v if math.isfinite(v) else None for k, v in values.items()}}
        line = json.dumps(record) + "\n"
        if self._lines is None:
            self._file.write(line)
            self._file.flush()
        else:
            self._lines.append(line)
            if time.monotonic() - self._synced >= self._sync_seconds:
                self._upload()
        if self._tensorboard is not None:
            for name, value in values.items():
                self._tensorboard.add_scalar(name, value, int(step))

    def flush(self) -> None:
        """Pushes buffered TensorBoard events out and, for a URL work directory, rewrites the JSONL
        object (a local file's lines are flushed per write)."""
        if self._lines is not None:
            self._upload()
        if self._tensorboard is not None:
            self._tensorboard.flush()

    def close(self) -> None:
        """Flushes and closes both outputs; later writes are errors."""
        if self._closed:
            return
        self._closed = True
        if self._file is not None:
            self._file.close()
        if self._lines is not None:
            self._upload()
        if self._tensorboard is not None:
            self._tensorboard.close()

    def __enter__(self) -> MetricWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _upload(self) -> None:
        self.path.write_text("".join(self._lines))
        self._synced = time.monotonic()


def _tensorboard(logdir: epath.Path, scheme: str | None, resume_step: int | None) -> SummaryWriter | None:
    """tensorboardX's writer for `logdir` (`scheme` None: a local path); None, after one warning, for a URL
    it cannot upload to."""
    if scheme is not None:
        package, installed = _TENSORBOARD_UPLOADERS.get(scheme, (None, False))
        if not installed:
            why = (
                f"tensorboardX uploads {scheme}:// events only with the {package} package installed"
                if package
                else f"tensorboardX uploads only gs:// and s3:// events, not {scheme}://"
            )
            log.warning("no TensorBoard events under %s (%s); metrics.jsonl is written", logdir, why)
            return None
    purge_step = None if resume_step is None else resume_step + 1
    return SummaryWriter(os.fspath(logdir), purge_step=purge_step)


def _scalar(name: str, value: Any) -> float:
    array = np.asarray(value)
    if array.shape != ():
        raise ValueError(f"metric {name!r} must be a scalar, got shape {array.shape}")
    return float(array)


def _kept_lines(path: epath.Path, resume_step: int | None) -> list[str]:
    """The lines of `path` (none when it does not exist) whose step is at most `resume_step` (all of
    them for None), each ending in a newline.

    A torn last line (the process died mid-write) is dropped; a corrupt line elsewhere is
    an error naming the line.
    """
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    kept = []
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if number == len(lines):
                break
            raise ValueError(f"{path}:{number} is not a JSON line ({e}); fix or remove it to resume") from e
        if resume_step is None or record["step"] <= resume_step:
            kept.append(line + "\n")
    return kept
