"""The report's data folder holds what its work directory holds, nothing left from an earlier report."""

import json

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
