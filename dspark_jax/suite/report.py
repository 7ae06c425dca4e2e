"""The suite's report: the seed's results table, the protocol, and plots, from the files the suite wrote.

`write_report(root, out)` copies every file a number comes from into `out/data/` (each group's
`metrics.jsonl`, `summary.json`, STS calibration and speculative reports, the shared target-only reports,
`suite.json` and `params.json`), then writes `out/report.md` and the PNGs from those copies alone, so the
report can be rebuilt and checked from what is committed beside it.
"""

from __future__ import annotations

import json
import shutil
import statistics
from collections.abc import Mapping

from etils import epath

from dspark_jax import groups as registry
from dspark_jax.errors import UsageError
from dspark_jax.run import checkpoints
from dspark_jax.suite import comparisons, plan, plots
from dspark_jax.suite.runner import (
    EVALUATION_DIR,
    PARAMS_FILE,
    SPECULATE_DIR,
    SUITE_FILE,
    TARGET_ONLY_DIR,
    setting_name,
)
from dspark_jax.training import intervals
from dspark_jax.training.metrics_writer import METRICS_FILE, MetricWriter
from dspark_jax.training.summary import SUMMARY_FILE

REPORT_FILE = "report.md"
DATA_DIR = "data"
PLOTS = ("tau_prob.png", "accept_rate.png", "accepted_length.png")
# Inference scalars mirrored to TensorBoard (`<root>/<group>/inference/`), one step per run.
INFERENCE_SCALARS = ("mal_pooled", "mal_per_request", "tokens_per_second", "loop_ms_per_cycle")


def _copy(src: epath.Path, dst: epath.Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)


def check_out(out: str | epath.Path, rows: list[str]) -> None:
    """Refuses a report directory whose report holds rows that `rows` lack: rewriting it would drop them (a
    `--groups` run's default report directory is the whole suite's)."""
    previous = epath.Path(out) / DATA_DIR / SUITE_FILE
    lost = (
        [g for g in json.loads(previous.read_text())["groups"] if g not in rows] if previous.exists() else []
    )
    if lost:
        raise UsageError(
            f"{out} holds a report with rows {lost} that this one lacks; give another --report_dir "
            f"(or delete {out} to replace it)"
        )


def collect(root: str | epath.Path, out: str | epath.Path) -> epath.Path:
    """Copies the suite's source files under `out/data` (emptied first: a report reads only what this work
    directory holds, never an earlier run's files); returns that directory."""
    root, data = epath.Path(root), epath.Path(out) / DATA_DIR
    if data.exists():
        data.rmtree()
    record = json.loads((root / SUITE_FILE).read_text())
    for name in (SUITE_FILE, PARAMS_FILE):
        _copy(root / name, data / name)
    if (root / TARGET_ONLY_DIR).exists():
        for path in (root / TARGET_ONLY_DIR).glob("*.json"):
            _copy(path, data / TARGET_ONLY_DIR / path.name)
    for name in record["groups"]:
        workdir = root / name
        for file in (METRICS_FILE, SUMMARY_FILE):
            _copy(workdir / file, data / name / file)
        sts = checkpoints.calibration_file(workdir, checkpoints.checkpoint_step(workdir))
        if sts.exists():
            _copy(sts, data / name / "sts.json")
            _copy(sts.parent / "reliability_greedy.png", epath.Path(out) / f"calibration_{name}.png")
        for path in (workdir / SPECULATE_DIR).glob("*.json"):
            _copy(path, data / name / SPECULATE_DIR / path.name)
        evaluation = workdir / EVALUATION_DIR / f"step_{checkpoints.checkpoint_step(workdir)}.json"
        if evaluation.exists():
            _copy(evaluation, data / name / comparisons.EVALUATION_JSON)
            _copy(evaluation.parent / f"{evaluation.stem}.npz", data / name / comparisons.EVALUATION_NPZ)
    return data


class _Group:
    """What the report reads of one group, from the copied files."""

    def __init__(self, data: epath.Path, name: str):
        self.name = name
        self.lines = [json.loads(x) for x in (data / name / METRICS_FILE).read_text().splitlines()]
        self.summary = json.loads((data / name / SUMMARY_FILE).read_text())
        self.evals = [x for x in self.lines if x.get("eval/tau_prob") is not None]
        self.final = self.evals[-1] if self.evals else {}
        self.step_seconds = [x["train/step_seconds"] for x in self.lines if x.get("train/step_seconds")]
        self.spec = {
            path.stem: json.loads(path.read_text()) for path in (data / name / SPECULATE_DIR).glob("*.json")
        }
        sts = data / name / "sts.json"
        self.sts = json.loads(sts.read_text()) if sts.exists() else None

    def speculative(self, temperature: float, schedule: str | None = None) -> dict | None:
        """The run at `temperature` with `schedule`; None = the fixed schedule's, else the confidence's."""
        names = [setting_name(temperature, x) for x in ((schedule,) if schedule else ("fixed", "confidence"))]
        return next((self.spec[name] for name in names if name in self.spec), None)


def _num(value, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _signed(value, digits: int = 4) -> str:
    return "-" if value is None else f"{value:+.{digits}f}"


_LABELS: dict[str, str] = {g.name: g.label for members in plan.suites().values() for g in members}


def _label(name: str) -> str:
    """A row's display name: the suite plan's (registered groups and same-budget rows)."""
    return _LABELS.get(name, name)


def _row_label(name: str, picked: set[str]) -> str:
    """A row's display name, marked where its figures are on the prefixes it picks itself."""
    return _label(name) + (f" {comparisons.PICKED}" if name in picked else "")


def _notes(groups: list[_Group]) -> str:
    """The groups' notes on reading their figures (`Experiment.report.report_note`), one sentence each."""
    found = (registry.find(g.name) for g in groups)
    return "".join(f" {e.report.report_note}" for e in found if e and e.report.report_note)


def _starts(groups: list[_Group]) -> str:
    """Which groups start from another's final checkpoint (`Experiment.model.init_from`)."""
    found = [e for e in (registry.find(g.name) for g in groups) if e and e.model.init_from]
    return "".join(
        f"; {e.display_name} starts from {_label(e.model.init_from)}'s final checkpoint and trains as many"
        " new steps (its steps are cumulative)"
        for e in found
    )


def _group_columns(groups: list[_Group]) -> list[tuple[str, str]]:
    """The groups' own metric columns (`Experiment.report.report_columns`), each once, in group order."""
    columns = {}
    for g in groups:
        experiment = registry.find(g.name)
        for key, title in experiment.report.report_columns if experiment else ():
            columns.setdefault(key, title)
    return list(columns.items())


def _ablations(groups: list[_Group]) -> list[str]:
    """The ablations some row was evaluated without (`Experiment.report.evaluation_ablations`), each once: the
    target context first."""
    names = {}
    for g in groups:
        experiment = registry.find(g.name)
        for ablation in experiment.report.evaluation_ablations if experiment else ():
            names.setdefault(ablation.name, None)
    return list(names)


def _ablation_cell(final: Mapping, name: str) -> str:
    """tau_prob without the input and the paired gain over it with its interval, e.g.
    `1.512 (+0.341 [+0.320, +0.362])`."""
    without, gain = final.get(f"eval/tau_prob_without_{name}"), final.get(f"eval/{name}_gain")
    if without is None:
        return "-"
    if gain is None:
        return _num(without, 4)
    low, high = final[f"eval/{name}_gain_low95"], final[f"eval/{name}_gain_high95"]
    return f"{without:.4f} ({gain:+.4f} [{low:+.4f}, {high:+.4f}])"


def _results_table(
    groups: list[_Group], params: Mapping[str, dict], block: int, picked: set[str]
) -> list[str]:
    rates = [f"acc@{i}" for i in range(block)]
    own = _group_columns(groups)
    ablations = _ablations(groups)
    head = [
        "group",
        "step",
        "tau_prob",
        *rates,
        "MAL T=0",
        "MAL T=1",
        "tok/s T=0 (speedup)",
        "s/step",
        "params added",
        *(title for _, title in own),
        *(f"tau_prob without {name} (gain [95%])" for name in ablations),
    ]
    body = []
    for g in groups:
        f = g.final
        greedy, sampled = g.speculative(0.0), g.speculative(1.0)
        mal = lambda r: _num(r["speculative"]["mal_pooled"]) if r else "-"
        speed = (
            f"{greedy['speculative']['tokens_per_second']:.1f} ({greedy['speedup']:.2f}x)" if greedy else "-"
        )
        added = params.get(g.name, {}).get("added")
        cells = [
            _row_label(g.name, picked),
            str(f.get("step", "-")),
            _num(f.get("eval/tau_prob"), 4),
            *(_num(f.get(f"eval/accept_rate_{i}")) for i in range(block)),
            mal(greedy),
            mal(sampled),
            speed,
            _num(statistics.median(g.step_seconds) if g.step_seconds else None, 2),
            "-" if added is None else f"{added:+,}",
            *(_signed(f.get(f"eval/{key}")) for key, _ in own),
            *(_ablation_cell(f, name) for name in ablations),
        ]
        body.append(cells)
    return comparisons.markdown(head, body)


def _decoding_row(g: _Group, t: float, schedule: str, r: dict) -> list[str]:
    s, ph = r["speculative"], r["cycle_phases_ms"]
    verified = s.get("mean_verified_length")
    split = "{cycle_ms:.1f} ({draft_ms:.1f} / {select_ms:.1f} / {verify_ms:.1f})".format(**ph) if ph else "-"
    return [
        _label(g.name),
        setting_name(t, schedule),
        f"{s['mal_pooled']:.3f} / {s['mal_per_request']:.3f}",
        _num(verified, 2) if verified is not None else str(r["settings"]["proposals_per_cycle"]),
        split,
        f"{s['tokens_per_second']:.1f}",
        f"{r['target_only']['tokens_per_second']:.1f}",
        f"{r['speedup']:.2f}x",
        r.get("identical_to_target_greedy", "-"),
        f"`{DATA_DIR}/{g.name}/{SPECULATE_DIR}/{setting_name(t, schedule)}.json`",
    ]


def _decoding_table(groups: list[_Group], protocol: Mapping) -> list[str]:
    head = [
        "group",
        "setting",
        "MAL pooled / per request",
        "verified per cycle",
        "cycle ms (draft / select / verify)",
        "tok/s",
        "target-only tok/s",
        "speedup",
        "greedy = target",
        "file",
    ]
    body = [
        _decoding_row(g, t, schedule, r)
        for g in groups
        for t, schedule in protocol["settings"]
        if (r := g.speculative(t, schedule)) is not None
    ]
    return comparisons.markdown(head, body)


def plot_series(groups: list[_Group], picked: set[str]) -> dict[str, dict]:
    """Each plot's series by legend label: every row in each plot, a row's acceptance on the prefixes it
    picks itself (`picked`) marked as such, a row without a greedy decode named so with no bars."""
    label = lambda g: _row_label(g.name, picked)
    block = _block_size(groups)
    histograms = {}
    for g in groups:
        r = g.speculative(0.0)
        if r is None:
            histograms[f"{_label(g.name)} (not decoded)"] = {}
            continue
        h = r["speculative"]["accepted_length_histogram"]
        total = max(sum(h.values()), 1)
        histograms[_label(g.name)] = {k: v / total for k, v in h.items()}
    return {
        "tau_prob.png": {
            label(g): (
                [x["step"] for x in g.evals],
                [x["eval/tau_prob"] for x in g.evals],
                [x.get("eval/tau_prob_low95") for x in g.evals],
                [x.get("eval/tau_prob_high95") for x in g.evals],
            )
            for g in groups
        },
        "accept_rate.png": {
            label(g): (list(range(block)), [g.final.get(f"eval/accept_rate_{i}", 0.0) for i in range(block)])
            for g in groups
        },
        "accepted_length.png": histograms,
    }


def _plots(out: epath.Path, groups: list[_Group], picked: set[str]) -> None:
    series = plot_series(groups, picked)
    mark = f"; {comparisons.PICKED}: on the prefixes the row picks itself" if picked else ""
    plots.lines(
        out / "tau_prob.png",
        series["tau_prob.png"],
        xlabel="step (cumulative for runs started from a checkpoint)",
        ylabel="eval tau_prob (band: 95% over validation samples)",
        title="Validation tau_prob per group" + mark,
    )
    plots.lines(
        out / "accept_rate.png",
        series["accept_rate.png"],
        xlabel="proposal position i",
        ylabel="eval accept_rate_i",
        title="Teacher-forced acceptance by position (final evaluation)" + mark,
    )
    plots.grouped_bars(
        out / "accepted_length.png",
        series["accepted_length.png"],
        xlabel="tokens accepted per cycle (greedy; the fixed schedule where it ran)",
        ylabel="share of cycles",
        title="Accepted length per cycle",
    )


def _block_size(groups: list[_Group]) -> int:
    return max(
        (int(k.rsplit("_", 1)[1]) + 1 for g in groups for k in g.final if k.startswith("eval/accept_rate_")),
        default=7,
    )


def _tensorboard(root: epath.Path, groups: list[_Group]) -> None:
    """Mirrors the inference figures to TensorBoard beside each group's training scalars."""
    for g in groups:
        if not g.spec:
            continue
        step = g.final.get("step", 0)
        values = {
            f"inference/{setting}/{key}": r["speculative"][key]
            for setting, r in g.spec.items()
            for key in INFERENCE_SCALARS
        }
        values |= {f"inference/{setting}/speedup": r["speedup"] for setting, r in g.spec.items()}
        with MetricWriter(root / g.name / "inference", resume_step=0) as writer:
            writer.write(step, values)


def _seeds_section(found: list[comparisons.Entry], gained: list[comparisons.Gain]) -> list[str]:
    table = comparisons.seeds_table(found, gained)
    if not table:
        return []
    return [
        "## Across training seeds",
        "",
        "Rows trained with several `train.seed`s (`--seeds`; the same caches, target and validation batches):"
        " each seed's figure, their mean, spread and range (the intervals above include this spread).",
        "",
        *table,
        "",
    ]


def write_report(root: str | epath.Path, out: str | epath.Path) -> epath.Path:
    """Writes `out/report.md`, its plots and `out/data/`; returns the report's path."""
    root, out = epath.Path(root), epath.Path(out)
    check_out(out, json.loads((root / SUITE_FILE).read_text())["groups"])
    out.mkdir(parents=True, exist_ok=True)
    data = collect(root, out)
    record = json.loads((data / SUITE_FILE).read_text())
    params = json.loads((data / PARAMS_FILE).read_text())
    groups = [_Group(data, name) for name in record["groups"]]
    seeded = plan.with_seeds(plan.suites()[record["suite"]], record["protocol"].get("seeds", 1))
    suite_groups = [g for g in seeded if g.name in record["groups"]]
    _LABELS.update({g.name: g.label for g in suite_groups})
    found = comparisons.entries(comparisons.load_rows(data, suite_groups, record["groups"]))
    gained = comparisons.gains(found, suite_groups)
    picker = next((e for e in map(registry.find, record["groups"]) if e and e.model.prefixes), None)
    same_note = "none here."
    if picker:
        same_note = f"{picker.display_name}'s final checkpoint picks them. {picker.model.prefixes_note}"
    picked = {r.group.name for e in found for r in e.runs if not r.own_blocks_are_uniform}
    _plots(out, groups, picked)
    _tensorboard(root, groups)
    block = _block_size(groups)
    protocol, env = record["protocol"], record.get("environment", {})
    wall = {name: sum(stages.values()) for name, stages in record["stages"].items()}
    text = [
        f"# Suite `{record['suite']}`, preset `{record['preset']}`",
        "",
        f"Command: `{plan.command_line(record)}`",
        "",
        "Names: `tau_prob` is the seed's tau_probabilistic, `acc@i` (`accept_rate_i` in the logs) its"
        " accept_rate@i; TensorBoard and `metrics.jsonl` keep the logged names.",
        "",
        "## The seed's groups",
        "",
        "Each group's row of the seed's group table (from the registry, `Experiment.report.design`) and the"
        " answer its paired gains below give at this budget:",
        "",
        *comparisons.design_table(suite_groups, gained, params),
        "",
        "## Figures with 95% intervals",
        "",
        "Each row's final checkpoint on the validation cache (`data/<row>/evaluation.json` and `.npz`, the"
        " sums per validation sample). *Own blocks* are each group's own anchors: the uniformly drawn ones,"
        f" or, marked {comparisons.PICKED}, the prefixes a group picks itself (its stage-2 anchors). *Same"
        f" prefixes* are one group's picks measured for every row: {same_note}"
        f" Intervals: {intervals.LEVEL:.0%}, bootstrap over validation samples (BCa, {intervals.RESAMPLES}"
        " resamples), MAL over requests; a row trained with several seeds shows the seeds' mean, its"
        " interval widened by the spread between seeds (the t half-width of their mean, added in"
        " quadrature).",
        "",
        *comparisons.figures_table(found),
        "",
        "## Gains over the same-budget reference",
        "",
        "Paired differences (the same validation samples, the same prefixes, the same requests in each"
        " resample; seed k against seed k, the spread between seeds included as above); **bold** where the"
        " interval excludes zero, i.e. the difference is told apart from noise at this budget. Each row is"
        " compared with the reference row of its own cumulative step; a row that starts from a checkpoint"
        " also with that checkpoint's row.",
        "",
        *comparisons.gains_table(gained),
        "",
        *_seeds_section(found, gained),
        "## Results",
        "",
        "Offline metrics are the final evaluation on the validation cache (`data/<group>/metrics.jsonl`);"
        " MAL and tokens/s are speculative decoding with real target verification (the fixed schedule"
        " where it ran, else the confidence schedule)"
        " (`data/<group>/speculate/`); s/step is the median of the logged `train/step_seconds`; params added"
        " are draft parameters beyond the baseline's (`data/params.json`). The columns after it are"
        " particular groups' own `eval/` metrics." + _notes(groups),
        "",
        *_results_table(groups, params, block, picked),
        "",
        "![tau_prob](tau_prob.png)",
        "",
        "![accept rate by position](accept_rate.png)",
        "",
        "## Speculative decoding, every setting",
        "",
        "`verified per cycle` is the scheduler's mean verified proposals (the fixed schedule verifies all).",
        "",
        *_decoding_table(groups, protocol),
        "",
        "![accepted length](accepted_length.png)",
        "",
        "## Confidence calibration",
        "",
        "Predicted survival against measured greedy acceptance on held-out validation blocks, before and"
        " after STS (`data/<group>/sts.json`):",
        "",
        *(f"![{g.name}](calibration_{g.name}.png)" for g in groups if g.sts),
        "",
        "## Protocol",
        "",
        f"- Groups: {', '.join(_label(g.name) for g in groups)}; each trains its preset's `train.stop_step`"
        f" steps on the same caches{_starts(groups)}.",
        *(
            f"- {_label(g.name)}: step {g.summary['step']} (+{g.summary['pretrained_steps']} pretrained),"
            f" wall {wall.get(g.name, 0.0) / 60:.1f} min in the suite"
            for g in groups
        ),
        "- Prompts: the first {} of `{}`, {} new tokens, concurrency {}; settings (temperature, schedule):"
        " {}; cycle latency split {}.".format(
            protocol["limit"] or "all",
            epath.Path(protocol["input"]).name,
            protocol["max_new_tokens"],
            protocol["concurrency"],
            ", ".join(f"({t:g}, {schedule})" for t, schedule in protocol["settings"]),
            "measured" if protocol["time_phases"] else "not measured",
        ),
        "- Hardware: {} ({}), {} host CPUs; JAX {}, Python {}.".format(
            env.get("backend"),
            ", ".join(sorted(set(env.get("devices", [])))),
            env.get("host_cpus"),
            env.get("jax"),
            env.get("python"),
        ),
        "- Commit: {}{}.".format(
            env.get("commit"), " (with uncommitted changes)" if env.get("uncommitted_changes") else ""
        ),
        f"- Wall time in the suite: {sum(wall.values()) / 60:.1f} min (`data/suite.json`, per group and"
        " stage).",
        "",
    ]
    path = out / REPORT_FILE
    path.write_text("\n".join(text))
    return path
