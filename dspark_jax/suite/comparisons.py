"""The report's comparisons: each row's figures with 95% intervals, its gains over the reference row of the
same budget (paired over validation samples and over requests), and the seed's group table with the answer
the measured numbers give.

Reads the copies under the report's `data/`: `<row>/evaluation.json` and `.npz` (the suite's evaluate
stage: each row's final checkpoint on its own blocks and on the same prefixes) and `<row>/speculate/*.json`
(per-request tokens and cycles, per-batch tokens and seconds). The reference rows are the suite's first
group's: its own run and its same-budget continuations; a row is compared with the one of its cumulative
step, and a row that starts from another's checkpoint also with that checkpoint's row.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence

import numpy as np
from etils import epath

from dspark_jax import groups as registry
from dspark_jax.suite import plan
from dspark_jax.suite.runner import SPECULATE_DIR, setting_name
from dspark_jax.training import intervals
from dspark_jax.training.intervals import Interval, SampleSums

EVALUATION_JSON, EVALUATION_NPZ = "evaluation.json", "evaluation.npz"
OWN, SAME = "own", "same_prefixes"


@dataclasses.dataclass(frozen=True)
class Row:
    """One row of the suite as the comparisons read it: its plan entry, its evaluation (per-sample sums on
    its own blocks and on the same prefixes) and its speculative runs."""

    group: plan.Group
    step: int
    samples: Mapping[str, SampleSums]  # OWN and, with a prefix-picking group in the suite, SAME
    speculative: Mapping[str, dict]  # setting name -> speculate record

    @property
    def own_blocks_are_uniform(self) -> bool:
        """Its own blocks are the batch's anchors (False for a group that picks its own prefixes)."""
        return registry.get(self.group.module).prefixes is None


def load_rows(data: epath.Path, suite_groups: Sequence[plan.Group], names: Sequence[str]) -> list[Row]:
    """The rows of `names` that have an evaluation under `data`, in suite order."""
    by_name = {g.name: g for g in suite_groups}
    rows = []
    for name in names:
        path = data / name / EVALUATION_JSON
        if name not in by_name or not path.exists():
            continue
        record = json.loads(path.read_text())
        with (data / name / EVALUATION_NPZ).open("rb") as f:
            arrays = dict(np.load(f))
        samples = {
            kind: SampleSums(**{field: arrays[f"{kind}/{field}"] for field in SampleSums._fields})
            for kind in (OWN, SAME)
            if f"{kind}/tau_K" in arrays
        }
        spec = {p.stem: json.loads(p.read_text()) for p in (data / name / SPECULATE_DIR).glob("*.json")}
        rows.append(Row(by_name[name], record["step"], samples, spec))
    return rows


def _greedy(row: Row) -> dict | None:
    """The temperature-0 run (the fixed schedule where it ran)."""
    runs = row.speculative
    return runs.get(setting_name(0.0, "fixed")) or runs.get(setting_name(0.0, "confidence"))


def _mal_parts(record: dict) -> tuple[np.ndarray, np.ndarray] | None:
    per = record["speculative"].get("per_request")
    return (np.asarray(per["tokens"], float), np.asarray(per["cycles"], float)) if per else None


def _tps_parts(record: dict) -> tuple[np.ndarray, np.ndarray] | None:
    per = record["speculative"].get("per_batch")
    return (np.asarray(per["tokens"], float), np.asarray(per["seconds"], float)) if per else None


def _safe(fn, *args) -> Interval | None:
    """An interval, or None where there are too few units for one."""
    try:
        return fn(*args)
    except ValueError:
        return None


def _figure(interval: Interval, digits: int, signed: bool) -> str:
    """`1.3270 [1.3201, 1.3339]`, in scientific notation where the fixed digits would all read zero."""
    values = (interval.estimate, interval.low, interval.high)
    kind = "e" if 0 < max(map(abs, values)) < 0.5 * 10.0**-digits else "f"
    f = lambda x: format(x, f"{'+' if signed else ''}.{1 if kind == 'e' else digits}{kind}")
    return f"{f(values[0])} [{f(values[1])}, {f(values[2])}]"


def fmt(interval: Interval | None, digits: int = 4, signed: bool = False) -> str:
    """A figure and its interval; a signed difference whose interval excludes zero in bold."""
    if interval is None:
        return "-"
    text = _figure(interval, digits, signed)
    return f"**{text}**" if signed and interval.excludes_zero else text


def markdown(head: list[str], body: list[list[str]]) -> list[str]:
    """A markdown table's lines."""
    line = lambda cells: "| " + " | ".join(cells) + " |"
    return [line(head), "|" + " --- |" * len(head), *map(line, body)]


def figures_table(rows: Sequence[Row]) -> list[str]:
    """Each row's tau_prob (own blocks, same prefixes), accept_rate_0, MAL and tokens/s with 95% intervals."""
    head = [
        "row",
        "step",
        "tau_prob, own blocks",
        "tau_prob, same prefixes",
        "acc@0, own blocks",
        "MAL T=0",
        "tok/s T=0",
    ]
    body = []
    for r in rows:
        own = intervals.metric_parts(r.samples[OWN])
        same = intervals.metric_parts(r.samples[SAME]) if SAME in r.samples else None
        greedy = _greedy(r)
        mal = _mal_parts(greedy) if greedy else None
        tps = _tps_parts(greedy) if greedy else None
        body.append(
            [
                r.group.label,
                str(r.step),
                fmt(_safe(intervals.ratio, *own["tau_prob"]))
                + ("" if r.own_blocks_are_uniform else " stage 2"),
                fmt(_safe(intervals.ratio, *same["tau_prob"])) if same else "-",
                fmt(_safe(intervals.ratio, *own["accept_rate_0"]), 3),
                fmt(_safe(intervals.ratio, *mal), 3) if mal else "-",
                fmt(_safe(intervals.ratio, *tps), 1) if tps else "-",
            ]
        )
    return markdown(head, body)


@dataclasses.dataclass(frozen=True)
class Gain:
    """A row against another row: paired differences of tau_prob (own blocks when both are the uniform
    anchors, and on the same prefixes), accept_rate_0 and greedy MAL."""

    row: Row
    against: Row
    kind: str  # "same budget" or "its starting checkpoint"
    tau_own: Interval | None
    tau_same: Interval | None
    accept0_same: Interval | None
    mal: Interval | None


def _gain(row: Row, against: Row, kind: str) -> Gain:
    both_uniform = row.own_blocks_are_uniform and against.own_blocks_are_uniform
    own = intervals.paired_gains(row.samples[OWN], against.samples[OWN]) if both_uniform else {}
    same = {}
    if SAME in row.samples and SAME in against.samples:
        same = intervals.paired_gains(row.samples[SAME], against.samples[SAME])
    mal = None
    ours, theirs = (_greedy(r) for r in (row, against))
    if ours and theirs and (a := _mal_parts(ours)) and (b := _mal_parts(theirs)) and len(a[0]) == len(b[0]):
        mal = _safe(intervals.paired_difference, *a, *b)
    return Gain(row, against, kind, own.get("tau_prob"), same.get("tau_prob"), same.get("accept_rate_0"), mal)


def gains(rows: Sequence[Row], suite_groups: Sequence[plan.Group]) -> list[Gain]:
    """Every non-reference row against the reference row of its step and seed; a row that starts from
    another's checkpoint also against that row (its starting point), a continued run against its source."""
    reference = suite_groups[0].module
    refs = {(r.group.seed_offset, r.step): r for r in rows if r.group.module == reference}
    by_name = {r.group.name: r for r in rows}
    out = []
    for r in rows:
        ref = refs.get((r.group.seed_offset, r.step))
        if r.group.module != reference and ref is not None:
            out.append(_gain(r, ref, "same budget"))
        if r.group.starts_from in by_name:
            out.append(_gain(r, by_name[r.group.starts_from], "its starting checkpoint"))
        if r.group.continues in by_name:
            out.append(_gain(r, by_name[r.group.continues], "the same run, fewer steps"))
    return out


def gains_table(found: Sequence[Gain]) -> list[str]:
    head = [
        "row",
        "step",
        "against",
        "d tau_prob, uniform anchors",
        "d tau_prob, same prefixes",
        "d acc@0, same prefixes",
        "d MAL T=0",
    ]
    body = [
        [
            g.row.group.label,
            str(g.row.step),
            f"{g.against.group.label} step {g.against.step} ({g.kind})",
            fmt(g.tau_own, signed=True),
            fmt(g.tau_same, signed=True),
            fmt(g.accept0_same, 3, signed=True),
            fmt(g.mal, 3, signed=True),
        ]
        for g in found
    ]
    return markdown(head, body)


def _verdict(g: Gain) -> str:
    """What one comparison says at this budget, from its intervals."""
    told = [x for x in (g.tau_same, g.tau_own) if x is not None]
    if not told:
        return f"no paired figure against {g.against.group.label}"
    x = told[0]
    where = "same prefixes" if x is g.tau_same else "uniform anchors"
    against = f"{g.against.group.label} step {g.against.step} ({g.kind})"
    figure = f"step {g.row.step}: tau_prob {_figure(x, 4, True)} ({where})"
    if x.excludes_zero:
        return f"{figure} {'above' if x.estimate > 0 else 'below'} {against}: beyond noise"
    return f"{figure} against {against}: not told apart from noise"


def design_table(
    rows: Sequence[Row], suite_groups: Sequence[plan.Group], found: Sequence[Gain], params: Mapping[str, dict]
) -> list[str]:
    """The seed's group table, each row's cells from the registry (`Experiment.design`), plus the answer its
    gains give at this budget."""
    head = ["group", "initialisation", "updates", "adds", "question", "answer at this budget"]
    body = []
    for group in suite_groups:
        design = registry.get(group.module).design
        if group.continues or design is None:
            continue
        added = params.get(group.name, {}).get("added")
        adds = design.adds + ("" if not added else f" (+{added:,} parameters)")
        answers = [_verdict(g) for g in found if g.row.group.name == group.name]
        answers += [_verdict(g) for g in found if g.row.group.continues == group.name == g.against.group.name]
        answer = "; ".join(answers) or "-"
        body.append([group.label, design.initialisation, design.updates, adds, design.question, answer])
    return markdown(head, body)


def _base(group: plan.Group) -> str:
    """The row a seed row repeats (`plan.with_seeds`)."""
    return group.name.removesuffix(f"_seed{group.seed_offset}") if group.seed_offset else group.name


def seeds_table(rows: Sequence[Row], found: Sequence[Gain]) -> list[str]:
    """Per row trained with several seeds: tau_prob on its own blocks and its same-budget gain (on the same
    prefixes where its own blocks are its own picks), mean and standard deviation across the seeds, and
    the range; empty without seed rows."""
    if not any(r.group.seed_offset for r in rows):
        return []
    taus, deltas, labels = {}, {}, {}
    for r in rows:
        base = _base(r.group)
        labels.setdefault(base, r.group.label)
        num, den = intervals.metric_parts(r.samples[OWN])["tau_prob"]
        taus.setdefault(base, []).append(float(num.sum() / den.sum()))
    for g in found:
        if g.kind == "same budget" and (x := g.tau_own or g.tau_same) is not None:
            deltas.setdefault(_base(g.row.group), []).append(x.estimate)

    def spread(values: list[float], signed: bool) -> str:
        if not values:
            return "-"
        v = np.asarray(values)
        sd = float(v.std(ddof=1)) if len(v) > 1 else 0.0
        f = (lambda x: f"{x:+.4f}") if signed else (lambda x: f"{x:.4f}")
        return f"{f(v.mean())} +- {sd:.4f} ({f(v.min())} .. {f(v.max())})"

    head = ["row", "seeds", "tau_prob, own blocks: mean +- sd (range)", "d tau_prob, same budget: mean +- sd"]
    body = [
        [labels[b], str(len(taus[b])), spread(taus[b], False), spread(deltas.get(b, []), True)] for b in taus
    ]
    return markdown(head, body)
