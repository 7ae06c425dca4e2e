"""The report's data folder holds what its work directory holds, nothing left from an earlier report."""

import json

import pytest

from dspark_jax.errors import UsageError
from dspark_jax.suite import report


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


def report_of(out, rows):
    """`out` as a report directory whose report holds `rows`."""
    (out / report.DATA_DIR).mkdir(parents=True)
    (out / report.DATA_DIR / "suite.json").write_text(json.dumps({"groups": rows}))


def test_a_report_holding_rows_this_one_lacks_is_not_overwritten(tmp_path):
    work, out = tmp_path / "work", tmp_path / "report"
    work.mkdir()
    (work / "suite.json").write_text(json.dumps({"groups": ["baseline"]}))
    report_of(out, ["baseline", "memory"])
    with pytest.raises(UsageError, match=r"rows \['memory'\] that this one lacks; give another --report_dir"):
        report.write_report(work, out)
    assert (out / report.DATA_DIR / "suite.json").exists()
