"""`tests/worker_crash.py`: a test that kills its xdist worker once passes on the rerun; one that kills
it every time fails the run."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CONFTEST = "from tests.worker_crash import pytest_handlecrashitem, pytest_report_teststatus  # noqa: F401\n"

TESTS = """
    import os
    from pathlib import Path

    def test_crashes_on_its_first_run_only(tmp_path_factory):
        flag = Path(os.environ["CRASH_FLAG"])
        if not flag.exists():
            flag.touch()
            os.abort()

    def test_crashes_every_time():
        if os.environ.get("CRASH_ALWAYS"):
            os.abort()
"""


def _run(tmp_path, always):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_crash.py").write_text(textwrap.dedent(TESTS))
    env = dict(os.environ, PYTHONPATH=str(ROOT), CRASH_FLAG=str(tmp_path / "crashed"))
    env.pop("CRASH_ALWAYS", None)
    if always:
        env["CRASH_ALWAYS"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider", "."],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("always", [False, True], ids=["once", "always"])
def test_a_test_that_crashes_its_worker_once_passes_and_one_that_always_does_fails(tmp_path, always):
    run = _run(tmp_path, always)
    summary = run.stdout.strip().splitlines()[-1]
    if always:
        assert run.returncode == 1, run.stdout
        assert "1 failed, 1 passed, 2 rerun" in summary, summary  # the always-crashing test: 2 crashes
    else:
        assert run.returncode == 0, run.stdout
        assert "2 passed, 1 rerun" in summary, summary
