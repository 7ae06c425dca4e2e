"""The report's data folder holds what its work directory holds, nothing left from an earlier report."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dspark_jax.errors import UsageError
from dspark_jax.suite import report

ROOT = Path(__file__).resolve().parents[2]


def test_a_report_drops_files_an_earlier_report_left_in_its_data_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(report.checkpoints, "checkpoint_step", lambda workdir: 3)
    work, out = tmp_path / "work", tmp_path / "report"
    (work / "baseline" / "speculate").mkdir(parents=True)
    (work / "suite.json").write_text(json.dumps({"groups": ["baseline"]}))
    (work / "params.json").write_text("{}")
    for name in ("metrics.jsonl", "summary.json"):
        (work / "baseline" / name).write_text("{}")
    (work / "baseline" / "speculate" / "t0-fixed.json").write_text("{}")
    stale = out / report.DATA_DIR / "baseline" / "speculate" / "t1-fixed.json"
    stale.parent.mkdir(parents=True)
    stale.write_text('{"from": "an earlier run"}')
    data = report.collect(work, out)
    assert sorted(p.name for p in (data / "baseline" / "speculate").iterdir()) == ["t0-fixed.json"]
    assert (data / "baseline" / "summary.json").exists() and not stale.exists()


def _report_of(out, rows):
    (out / report.DATA_DIR).mkdir(parents=True)
    (out / report.DATA_DIR / "suite.json").write_text(json.dumps({"groups": rows}))


def test_a_report_holding_rows_this_one_lacks_is_not_overwritten(tmp_path):
    work, out = tmp_path / "work", tmp_path / "report"
    work.mkdir()
    (work / "suite.json").write_text(json.dumps({"groups": ["baseline"]}))
    _report_of(out, ["baseline", "memory"])
    with pytest.raises(UsageError, match=r"rows \['memory'\] that this one lacks; give another --report_dir"):
        report.write_report(work, out)
    assert (out / report.DATA_DIR / "suite.json").exists()


def test_a_groups_run_into_a_whole_suites_report_directory_is_refused_before_any_work(tmp_path):
    out, work = tmp_path / "report", tmp_path / "work"
    _report_of(out, ["baseline", "memory"])
    cmd = [
        sys.executable,
        "-m",
        "dspark_jax.experiments",
        "--suite=seed",
        "--preset=smoke",
        "--groups=baseline",
    ]
    proc = subprocess.run(
        [*cmd, f"--workdir={work}", f"--report_dir={out}"], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 2 and "give another --report_dir" in proc.stderr, proc.stderr[-2000:]
    assert not work.exists()  # nothing trained
