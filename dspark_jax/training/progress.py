"""A periodic progress line with rate and ETA for long loops.

    step 120/2604 (4.6%) | 3.2 steps/s | loss 2.31 | tau 1.84 | ETA 12m56s

The rate is measured over the last `window` logged intervals, so the first interval's
compile time fades out instead of skewing the ETA for the whole run.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

log = logging.getLogger(__name__)


def format_duration(seconds: float) -> str:
    """`45s`, `12m31s`, `3h07m`, `2d04h`; `?` for a negative or non-finite duration."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    total = round(seconds)
    days, rest = divmod(total, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


def format_rate(steps_per_second: float) -> str:
    """`3.2 steps/s`, or `4.0 s/step` below one step per second."""
    if steps_per_second <= 0 or not math.isfinite(steps_per_second):
        return "? steps/s"
    if steps_per_second >= 1:
        return f"{steps_per_second:.1f} steps/s"
    return f"{1 / steps_per_second:.1f} s/step"


class ProgressLogger:
    """Logs `step i/N (p%) | rate | metrics | ETA` at most every `every_seconds` (and at the end)."""

    def __init__(
        self,
        total_steps: int,
        start_step: int = 0,
        *,
        every_seconds: float = 10.0,
        window: int = 5,
        clock: Callable[[], float] = time.monotonic,
        logger: logging.Logger = log,
    ):
        if window < 1:
            raise ValueError(f"{window=} must be at least 1")
        self.total_steps = total_steps
        self.every_seconds = every_seconds
        self._clock = clock
        self._logger = logger
        self._samples: collections.deque[tuple[float, int]] = collections.deque(maxlen=window + 1)
        self._samples.append((clock(), start_step))

    def update(
        self, step: int, metrics: Mapping[str, Any] | None = None, *, force: bool = False
    ) -> str | None:
        """Logs and returns the line when due (or `force`, or at `total_steps`); else None.

        `step` counts completed steps; `metrics` values are scalars shown with 3 digits.
        """
        now = self._clock()
        if not (force or step >= self.total_steps or now - self._samples[-1][0] >= self.every_seconds):
            return None
        self._samples.append((now, step))
        (t0, s0), (t1, s1) = self._samples[0], self._samples[-1]
        rate = (s1 - s0) / (t1 - t0) if t1 > t0 else math.nan
        eta = (self.total_steps - step) / rate if rate > 0 else math.nan
        parts = [f"step {step}/{self.total_steps} ({100 * step / self.total_steps:.1f}%)", format_rate(rate)]
        parts += [f"{name} {float(value):.3g}" for name, value in (metrics or {}).items()]
        parts.append(f"ETA {format_duration(eta)}")
        line = " | ".join(parts)
        self._logger.info(line)
        return line
