"""A test whose xdist worker dies natively runs once more on a fresh worker.

A native crash (an abort or segfault inside XLA's or torch's runtime, e.g. LLVM aborting when a worker
holds too many memory mappings) kills the whole worker, not a Python assertion; the test it was running
is rescheduled once and reported as `RERUN` (the crash's output stays in the log). A test that crashes
twice fails as usual, so a crash the code causes still turns the run red. Loaded by `tests/conftest.py`.
"""

from __future__ import annotations

import pytest

_CRASHED: set[str] = set()


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
    """xdist's hook on the controller: reschedule the crashed test the first time it crashes."""
    if crashitem in _CRASHED:
        return
    _CRASHED.add(crashitem)
    sched.mark_test_pending(crashitem)
    report.outcome = "rerun"


def pytest_report_teststatus(report):
    if report.outcome == "rerun":
        return "rerun", "R", ("RERUN", {"yellow": True})
    return None
