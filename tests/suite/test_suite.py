"""The seed suite end to end on the smoke preset: seven rows, every plot, numbers traceable, resumable."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dspark_jax.run import checkpoints
from dspark_jax.suite import comparisons, plan, report
from dspark_jax.suite.runner import setting_name
from tests.suite.test_report import report_of

ROOT = Path(__file__).resolve().parents[2]


def _suite(tmp_path, *extra):
    cmd = [
        sys.executable,
        "-m",
        "dspark_jax.experiments",
        "--suite=seed",
        "--preset=smoke",
        f"--workdir={tmp_path / 'work'}",
        f"--report_dir={tmp_path / 'report'}",
        f"--override=data.cache_dir={tmp_path / 'caches'}",
        "--override=mesh.fsdp=1",
        *extra,
    ]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3000)


def test_a_groups_run_into_a_whole_suites_report_directory_is_refused_before_any_work(tmp_path):
    report_of(tmp_path / "report", ["baseline", "memory"])
    proc = _suite(tmp_path, "--groups=baseline")
    assert proc.returncode == 2 and "give another --report_dir" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "work").exists()  # nothing trained


# The rows whose mechanics the seed suite's report adds: Draft Memory (the prefix picker, two stages), the
# frozen reranker on the Baseline's checkpoint, the Baseline continued to its budget (the same-budget
# reference). Every group trains, evaluates and decodes end to end in `tests/training/test_online.py`.
SUITE_GROUPS = ("memory", "reranker_frozen")


@pytest.mark.slow
def test_seed_suite_on_smoke_writes_the_table_and_plots_and_skips_finished_groups(tmp_path):
    # The baseline alone first (no Draft Memory row: no same prefixes yet); the suite's rows then add the
    # baseline's same-prefix figures to its finished evaluation (`_check_comparisons` reads them).
    first = _suite(tmp_path, "--groups=baseline")
    assert first.returncode == 0, first.stderr[-4000:]
    assert "same_prefixes" not in json.loads(
        next((tmp_path / "work" / "baseline").glob("evaluation/*.json")).read_text()
    )
    rows_flag = "--groups=" + ",".join(SUITE_GROUPS)
    proc = _suite(tmp_path, rows_flag)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = tmp_path / "report"
    text = (out / report.REPORT_FILE).read_text()
    groups = plan.groups("seed", SUITE_GROUPS)
    assert [g.name for g in groups] == ["baseline", "memory", "reranker_frozen", "baseline_same_budget"]
    results = text.split("## Results")[1].split("![tau_prob]")[0]
    rows = [
        line
        for line in results.splitlines()
        if line.startswith("| ") and not line.startswith(("| group", "| ---"))
    ]
    labels = [row.split(" | ")[0][2:] for row in rows]  # Draft Memory's figures are on its picked prefixes
    assert labels == [g.label + (f" {comparisons.PICKED}" if g.name == "memory" else "") for g in groups]
    for name in (*report.PLOTS, *(f"calibration_{g.name}.png" for g in groups)):
        assert (out / name).stat().st_size > 1000, name
        assert f"({name})" in text

    data = out / report.DATA_DIR
    for g, row in zip(groups, rows):
        cells = row.split(" | ")
        evals = [json.loads(x) for x in (data / g.name / "metrics.jsonl").read_text().splitlines()]
        final = [x for x in evals if x.get("eval/tau_prob") is not None][-1]
        assert cells[1] == str(final["step"]) and cells[2] == f"{final['eval/tau_prob']:.4f}"
        context, memory = cells[-2], cells[-1].removesuffix(" |")  # the ablation columns, the context first
        gain = f"{final['eval/context_gain']:+.4f} [{final['eval/context_gain_low95']:+.4f}, "
        assert context.startswith(f"{final['eval/tau_prob_without_context']:.4f} ({gain}"), context
        assert (memory == "-") == (g.name != "memory"), memory
        spec = json.loads((data / g.name / "speculate" / f"{setting_name(0.0, 'fixed')}.json").read_text())
        assert cells[10] == f"{spec['speculative']['mal_pooled']:.3f}"
        assert spec["identical_to_target_greedy"] == "2/2"
        for t, schedule in plan.PROTOCOLS["smoke"].settings:  # both temperatures, both schedules
            assert (data / g.name / "speculate" / f"{setting_name(t, schedule)}.json").exists()
    frozen = [x for x in (data / "reranker_frozen" / "metrics.jsonl").read_text().splitlines()]
    assert json.loads(frozen[-1])["step"] == 6  # a budget of 3 baseline steps + 3 new ones, cumulative
    _check_comparisons(text, data, groups)
    params = json.loads((data / "params.json").read_text())
    assert params["baseline"]["added"] == 0 and params["reranker_frozen"]["added"] > 0
    assert params["baseline_same_budget"]["added"] == 0
    stages = json.loads((data / "suite.json").read_text())["stages"]

    again = _suite(tmp_path, rows_flag)
    assert again.returncode == 0, again.stderr[-4000:]
    assert "suite: training" not in again.stderr and again.stderr.count("trained (step") == len(groups)
    assert json.loads((tmp_path / "work" / "suite.json").read_text())["stages"] == stages


@pytest.mark.slow
def test_the_suite_runs_online_from_token_rows_alone(tmp_path):
    """`--override=data.features=online`: every stage of two groups (Draft Memory's two stages and the frozen
    reranker on the baseline's checkpoint) trains, evaluates, calibrates and decodes with the target in the
    step; the caches hold token rows only (no states anywhere under the cache directory)."""
    proc = _suite(tmp_path, "--groups=memory,reranker_frozen", "--override=data.features=online")
    assert proc.returncode == 0, proc.stderr[-4000:]
    manifests = [json.loads(p.read_text()) for p in (tmp_path / "caches").rglob("manifest.json")]
    assert manifests and all(m["spec"]["states"] is False for m in manifests)
    data = tmp_path / "report" / report.DATA_DIR
    for name in ("baseline", "memory", "reranker_frozen"):
        assert (data / name / "evaluation.json").exists()
        spec = json.loads((data / name / "speculate" / f"{setting_name(0.0, 'fixed')}.json").read_text())
        assert spec["identical_to_target_greedy"] == "2/2"
        assert checkpoints.run_config(tmp_path / "work" / name).data.features == "online"


def _section(text, title):
    """The body rows of the first table under `## title`, as cell lists."""
    body = text.split(f"## {title}")[1].split("\n## ")[0]
    lines = [line for line in body.splitlines() if line.startswith("| ") and "---" not in line]
    return [line.split(" | ") for line in lines[1:]]


def _interval(cell):
    """`1.2345 [1.2000, 1.3000]` (bold or not) -> three floats."""
    return tuple(map(float, re.findall(r"[-+]?\d+\.\d+(?:e[-+]?\d+)?", cell)[:3]))


def _check_comparisons(text, data, groups):
    """The seed's group table, the figures with intervals, the same-budget row and the paired gains, each
    traceable to the evaluation files the report copied."""
    evaluation = {g.name: json.loads((data / g.name / "evaluation.json").read_text()) for g in groups}
    same = next(g for g in groups if g.continues)
    assert evaluation[same.name]["step"] == 6 and evaluation["reranker_frozen"]["step"] == 6

    design = _section(text, "The seed's groups")
    assert [r[0][2:] for r in design] == [g.label for g in groups if not g.continues]
    assert all(r[-1] not in ("-", "- |") for r in design)  # each group's answer at this budget

    figures = {r[0][2:]: r for r in _section(text, "Figures with 95% intervals")}
    assert set(figures) == {g.label for g in groups}
    for g in groups:
        assert figures[g.label][2] == "1"  # seeds
        estimate, low, high = _interval(figures[g.label][3])
        assert estimate == pytest.approx(evaluation[g.name]["own"]["tau_prob"], abs=1e-4)
        assert low <= estimate <= high
        same_prefixes = evaluation[g.name]["same_prefixes"]["metrics"]["tau_prob"]
        assert _interval(figures[g.label][4])[0] == pytest.approx(same_prefixes, abs=1e-4)

    gains = {(r[0][2:], r[2]): r for r in _section(text, "Gains over the same-budget reference")}
    start = gains[("Prefix reranker frozen", "Baseline step 3 (its starting checkpoint)")]
    budget = gains[("Prefix reranker frozen", f"{same.label} step 6 (same budget)")]
    for row, against in ((start, "baseline"), (budget, same.name)):
        want = evaluation["reranker_frozen"]["own"]["tau_prob"] - evaluation[against]["own"]["tau_prob"]
        assert row[3] == "1" and _interval(row[4])[0] == pytest.approx(want, abs=1e-4)
    memory = gains[("Draft Memory", "Baseline step 3 (same budget)")]
    assert memory[4] == "-" and "[" in memory[5]  # own blocks: other prefixes
