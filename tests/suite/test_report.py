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


def _write_run(work, name, step, own, same=None, decoded=True, acc0=0.4):
    """One finished run of a suite row: metrics, summary, evaluation sums (`own`/`same`: (tau [K], blocks
    [K]) per validation sample) and, when `decoded`, a greedy decode of 16 requests."""
    import numpy as np

    from dspark_jax.suite.runner import EVALUATION_DIR, SPECULATE_DIR, setting_name

    run = work / name
    (run / EVALUATION_DIR).mkdir(parents=True)
    tau = float(own[0].sum() / own[1].sum())
    lines = [
        {"step": step, "train/step_seconds": 1.0},
        {"step": step, "eval/tau_prob": tau, "eval/accept_rate_0": acc0},
    ]
    (run / "metrics.jsonl").write_text("\n".join(map(json.dumps, lines)))
    (run / "summary.json").write_text(json.dumps({"step": step, "pretrained_steps": 0}))
    arrays, record = {}, {"step": step}
    for kind, (tau_K, blocks_K) in (("own", own), ("same_prefixes", same)):
        if tau_K is None:
            continue
        k = len(tau_K)
        arrays |= {
            f"{kind}/keys_Kx3": np.stack([np.zeros(k), np.zeros(k), np.arange(k)], 1).astype(np.int64),
            f"{kind}/tau_K": tau_K,
            f"{kind}/blocks_K": blocks_K,
            f"{kind}/accept_KxS": (tau_K - blocks_K)[:, None] * 0.5,
            f"{kind}/accept_count_KxS": blocks_K[:, None],
        }
    np.savez(run / EVALUATION_DIR / f"step_{step}.npz", **arrays)
    (run / EVALUATION_DIR / f"step_{step}.json").write_text(json.dumps(record))
    if decoded:
        (run / SPECULATE_DIR).mkdir()
        rng = np.random.default_rng(len(name))
        cycles = rng.integers(20, 30, 16)
        spec = {
            "speculative": {
                "mal_pooled": 2.0,
                "mal_per_request": 2.0,
                "loop_ms_per_cycle": 50.0,
                "tokens_per_second": 10.0,
                "per_request": {"tokens": (cycles * 2).tolist(), "cycles": cycles.tolist()},
                "accepted_length_histogram": {"1": 3, "2": 5},
            },
            "cycle_phases_ms": None,
            "settings": {"proposals_per_cycle": 7},
            "target_only": {"tokens_per_second": 8.0},
            "speedup": 1.25,
        }
        (run / SPECULATE_DIR / f"{setting_name(0.0, 'fixed')}.json").write_text(json.dumps(spec))


def _fake_suite(tmp_path, monkeypatch):
    """A finished `seed` suite's work directory, written by hand: Baseline and Engram-Markov with three
    seeds each (per-seed offsets shared by both, Engram-Markov's paired gains +0.04, -0.03, +0.05 over
    little sample noise: `tests/training/test_intervals.py`'s runs), and Draft Memory once, undecoded (it
    picks its own prefixes: its own blocks are not the uniform anchors)."""
    from tests.training.test_intervals import _seeded_runs

    monkeypatch.setattr(report.checkpoints, "checkpoint_step", lambda workdir: 3)
    work = tmp_path / "work"
    ours, theirs, den, gains = _seeded_runs()
    names = []
    for s in range(3):
        suffix = f"_seed{s}" if s else ""
        for name, tau in (("baseline", theirs), ("engram_markov", ours)):
            _write_run(work, name + suffix, 3, (tau[s], den[s]), (tau[s], den[s]))
            names.append(name + suffix)
    _write_run(
        work, "memory", 3, (theirs[0] * 1.01, den[0]), (theirs[0] * 1.01, den[0]), decoded=False, acc0=0.5
    )
    names.insert(2, "memory")
    protocol = {
        "settings": [[0.0, "fixed"]],
        "limit": 16,
        "input": "mt_bench.jsonl",
        "max_new_tokens": 8,
        "concurrency": 2,
        "time_phases": False,
        "seeds": 3,
        "budget": 3,
    }
    record = {
        "suite": "seed",
        "preset": "smoke",
        "groups": names,
        "protocol": protocol,
        "overrides": [],
        "stages": {n: {"train": 1.0} for n in names},
        "environment": {},
    }
    (work / "suite.json").write_text(json.dumps(record))
    (work / "params.json").write_text("{}")
    return work, ours, theirs, den, gains


def _table(text, title):
    body = text.split(f"## {title}")[1].split("\n## ")[0]
    lines = [line for line in body.splitlines() if line.startswith("| ") and "---" not in line]
    return {cells[0]: cells for cells in (line.strip("| ").split(" | ") for line in lines[1:])}


def test_a_seeded_rows_figures_and_gains_carry_the_spread_between_seeds(tmp_path, monkeypatch):
    """The report's interval of a row trained with three seeds covers every seed's own figure, and its
    gain is not marked told apart (bold) where each seed alone, over samples, would be."""
    import re

    from dspark_jax.training import intervals

    work, ours, theirs, den, gains = _fake_suite(tmp_path, monkeypatch)
    text = report.write_report(work, tmp_path / "report").read_text()
    numbers = lambda cell: [float(x) for x in re.findall(r"[-+]?\d+\.\d+", cell)]
    figures = _table(text, "Figures with 95% intervals")
    estimate, low, high = numbers(figures["Engram-Markov"][3])
    per_seed = ours.sum(1) / den.sum(1)
    assert figures["Engram-Markov"][2] == "3" and low <= per_seed.min() and per_seed.max() <= high
    assert estimate == pytest.approx(per_seed.mean(), abs=1e-4)
    assert all(
        intervals.paired_difference(ours[s], den[s], theirs[s], den[s]).excludes_zero for s in range(3)
    )
    gain = _table(text, "Gains over the same-budget reference")["Engram-Markov"]
    assert (
        gain[3] == "3"
        and "**" not in gain[4]
        and numbers(gain[4])[0] == pytest.approx(sum(gains) / 3, abs=3e-3)
    )
    assert not any(name.endswith("seed +1") for name in _table(text, "The seed's groups"))


def test_every_row_is_in_every_plot_and_picked_prefixes_carry_one_mark(tmp_path, monkeypatch):
    """Draft Memory's own blocks are the prefixes it picks: the figures table, the text and the plots mark
    them with the same `(a')`; a row without a greedy decode stays in the accepted-length plot, named so."""
    from dspark_jax.suite import comparisons

    work, *_ = _fake_suite(tmp_path, monkeypatch)
    text = report.write_report(work, tmp_path / "report").read_text()
    figures = _table(text, "Figures with 95% intervals")
    assert figures["Draft Memory"][3].endswith(comparisons.PICKED) and f"marked {comparisons.PICKED}" in text
    assert not figures["Baseline"][3].endswith(comparisons.PICKED)
    assert f"Draft Memory {comparisons.PICKED}" in _table(text, "Results")
    data = tmp_path / "report" / report.DATA_DIR
    groups = [report._Group(data, name) for name in json.loads((data / "suite.json").read_text())["groups"]]
    series = report.plot_series(groups, {"memory"})
    assert f"Draft Memory {comparisons.PICKED}" in series["accept_rate.png"]
    assert "Baseline" in series["accept_rate.png"]
    assert (
        len(series["accepted_length.png"]) == len(groups)
        and "Draft Memory (not decoded)" in series["accepted_length.png"]
    )
