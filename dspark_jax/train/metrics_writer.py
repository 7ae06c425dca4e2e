"""Metrics to `workdir/metrics.jsonl` (one JSON object per write) and TensorBoard.

Each line is `{"step": N, "train/loss": 2.31, ...}` with float values; NaN and ±inf are
written as `null` so the file stays strict JSON (TensorBoard still gets the raw value).
Only process 0 writes; on other processes every method is a no-op.

Resume safety: a run killed after its last checkpoint has logged steps that the resumed
run logs again. `MetricWriter(workdir, resume_step=k)` drops the lines with `step > k`
and asks TensorBoard to hide its events from step `k + 1` on (tensorboardX `purge_step`),
so the resumed run's file equals an uninterrupted run's. Pass the step the run starts
from (0 for a fresh run, which clears a previous run's lines); `None` appends.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from etils import epath
from tensorboardX import SummaryWriter

METRICS_FILE = "metrics.jsonl"
# TensorBoard's legal tag characters: a name is written to both outputs unchanged.
_NAME = re.compile(r"[A-Za-z0-9_.\-/]+")
TENSORBOARD_DIR = "tensorboard"


class MetricWriter:
    """Appends scalar metrics per step to the JSONL file and TensorBoard (process 0 only)."""

    def __init__(
        self,
        workdir: str | os.PathLike[str],
        *,
        resume_step: int | None = None,
        enable_tensorboard: bool = True,
    ):
        self.workdir = epath.Path(workdir)
        self.path = self.workdir / METRICS_FILE
        self._active = jax.process_index() == 0
        self._file = None
        self._tensorboard = None
        if not self._active:
            return
        self.workdir.mkdir(parents=True, exist_ok=True)
        if resume_step is not None:
            _truncate(self.path, resume_step)
        self._file = self.path.open("a")
        if enable_tensorboard:
            purge_step = None if resume_step is None else resume_step + 1
            self._tensorboard = SummaryWriter(str(self.workdir / TENSORBOARD_DIR), purge_step=purge_step)

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Writes one line for `step`; every value must be a scalar (float, numpy or jax)."""
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
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tensorboard is not None:
            for name, value in values.items():
                self._tensorboard.add_scalar(name, value, int(step))

    def flush(self) -> None:
        """Pushes buffered TensorBoard events to disk (JSONL lines are flushed per write)."""
        if self._tensorboard is not None:
            self._tensorboard.flush()

    def close(self) -> None:
        """Flushes and closes both outputs; later writes are errors."""
        if self._file is not None:
            self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()

    def __enter__(self) -> MetricWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _scalar(name: str, value: Any) -> float:
    array = np.asarray(value)
    if array.shape != ():
        raise ValueError(f"metric {name!r} must be a scalar, got shape {array.shape}")
    return float(array)


def _truncate(path: epath.Path, resume_step: int) -> None:
    """Rewrites `path` without the lines whose step is after `resume_step`.

    A torn last line (the process died mid-write) is dropped; a corrupt line elsewhere is
    an error naming the line.
    """
    if not path.exists():
        return
    lines = path.read_text().splitlines()
    kept = []
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if number == len(lines):
                break
            raise ValueError(f"{path}:{number} is not a JSON line ({e}); fix or remove it to resume") from e
        if record["step"] <= resume_step:
            kept.append(line + "\n")
    tmp = path.parent / (path.name + ".tmp")
    tmp.write_text("".join(kept))
    tmp.replace(path)
