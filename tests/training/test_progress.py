"""ProgressLogger line format, moving-window rate and ETA; format_duration."""

import logging

import pytest

from dspark_jax.training.progress import ProgressLogger, format_duration, format_rate


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0s"), (44.6, "45s"), (751, "12m31s"), (3600, "1h00m"), (11_220, "3h07m"), (187_200, "2d04h")],
)
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


def test_format_duration_and_rate_of_unknowns():
    assert format_duration(float("nan")) == "?" and format_duration(-1) == "?"
    assert format_rate(0.0) == "? steps/s" and format_rate(0.25) == "4.0 s/step"


class _Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_line_rate_window_and_eta(caplog):
    clock = _Clock()
    progress = ProgressLogger(2604, start_step=0, every_seconds=10, window=2, clock=clock)
    clock.now += 5
    assert progress.update(10) is None  # not due yet
    # First interval: 60 s for 20 steps (compilation), then 10 s per 40 steps.
    clock.now += 55
    assert progress.update(20) == "step 20/2604 (0.8%) | 3.0 s/step | ETA 2h09m"  # (2604 - 20) * 3 s
    clock.now += 10
    progress.update(60)
    clock.now += 10
    with caplog.at_level(logging.INFO, logger="dspark_jax.training.progress"):
        line = progress.update(100, {"loss": 2.3134, "tau": 1.8432})
    # The window holds the last two intervals only: 80 steps in 20 s = 4 steps/s.
    eta = format_duration((2604 - 100) / 4.0)
    assert line == f"step 100/2604 (3.8%) | 4.0 steps/s | loss 2.31 | tau 1.84 | ETA {eta}"
    assert eta == "10m26s"
    assert caplog.messages == [line]


def test_last_step_and_force_always_log():
    clock = _Clock()
    progress = ProgressLogger(50, start_step=40, every_seconds=1e9, clock=clock)
    clock.now += 2
    assert progress.update(45, force=True) == "step 45/50 (90.0%) | 2.5 steps/s | ETA 2s"
    clock.now += 2
    assert progress.update(50) == "step 50/50 (100.0%) | 2.5 steps/s | ETA 0s"
