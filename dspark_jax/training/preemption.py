"""Clean stops on preemption: SIGTERM/SIGINT become a flag polled at step boundaries.

Single-process runs install Python handlers that only set a flag, so the training loop
finishes its step, saves a checkpoint and exits. A second signal goes to the previous
handler (Ctrl-C twice interrupts at once). Multi-process runs
install nothing: JAX's preemption service (started by `jax.distributed.initialize`)
owns SIGTERM there and `should_stop` asks it for the step at which every process stops
together, so all of them take part in the same collective save::

    with PreemptionGuard() as guard:
        for step in range(start, stop):
            state = train_step(state, next(it))
            if guard.should_stop(step + 1):
                ckpt.save(step + 1, state, data_iter=it, force=True)
                break
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Sequence
from types import FrameType
from typing import Any

import jax
from jax.experimental import multihost_utils

log = logging.getLogger(__name__)


class PreemptionGuard:
    """Context manager turning `signals` into `requested = True`; restores the old handlers on exit."""

    def __init__(self, signals: Sequence[signal.Signals] = (signal.SIGTERM, signal.SIGINT)):
        self.signals = tuple(signals)
        self._requested = False
        self._previous: dict[signal.Signals, Any] = {}

    @property
    def requested(self) -> bool:
        """Whether a stop signal arrived since the guard was entered."""
        return self._requested

    def should_stop(self, step: int) -> bool:
        """Whether to save and stop after `step`; call it at every step on every process."""
        return self._requested or multihost_utils.reached_preemption_sync_point(step)

    def __enter__(self) -> PreemptionGuard:
        self._requested = False
        if jax.process_count() == 1:
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._restore_handlers()

    def _restore_handlers(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        del frame
        if self._requested:
            log.warning("second %s: stopping now", signal.Signals(signum).name)
            self._restore_handlers()
            signal.raise_signal(signum)
            return
        log.warning("%s received: saving and stopping at the next step boundary", signal.Signals(signum).name)
        self._requested = True
