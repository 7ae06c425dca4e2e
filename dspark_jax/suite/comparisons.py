"""The report's comparisons: each row's figures with 95% intervals, its gains over the reference row of the
same budget (paired over validation samples and over requests), and the seed's group table with the answer
the measured numbers give.

Reads the copies under the report's `data/`: `<row>/evaluation.json` and `.npz` (the suite's evaluate
stage: each row's final checkpoint on its own blocks and on the same prefixes) and `<row>/speculate/*.json`
(per-request tokens and cycles, per-batch tokens and seconds). The reference rows are the suite's first
group's: its own run and its same-budget continuations; a row is compared with the one of its cumulative
step, and a row that starts from another's checkpoint also with that checkpoint's row.

A row trained with several seeds (`plan.with_seeds`) is one `Entry`: its figures are the seeds' means and
their intervals cover the spread between seeds as well as the samples' (`intervals.seeds_ratio`,
`seeds_difference`; seed `k` of a row paired with seed `k` of its reference), so "told apart from noise"
(bold) means apart from both.
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
# Marks a figure on the prefixes a group picks itself (its stage-2 anchors), not on uniform anchors.
PICKED = "(a')"


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
        return registry.get(self.group.module).model.prefixes is None


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


def _base_name(group: plan.Group) -> str:
    """The plan row a seed row repeats (`plan.with_seeds`); the row's own name for seed 0."""
    return group.name.removesuffix(f"_seed{group.seed_offset}") if group.seed_offset else group.name


@dataclasses.dataclass(frozen=True)
class Entry:
    """One plan row over its training seeds: its runs, seed 0 first (one run without `--seeds`)."""

    runs: tuple[Row, ...]

    @property
    def group(self) -> plan.Group:
        """Seed 0's plan row: the row's name, label and relations."""
        return self.runs[0].group

    @property
    def step(self) -> int:
        return self.runs[0].step

    @property
    def own_blocks_are_uniform(self) -> bool:
        return self.runs[0].own_blocks_are_uniform

    def offsets(self) -> list[int]:
        return [r.group.seed_offset for r in self.runs]

    def _runs(self, offsets: Sequence[int]) -> list[Row]:
        """The runs of the seeds `offsets`, in that order (fewer where some seed has no run)."""
        return [r for o in offsets for r in self.runs if r.group.seed_offset == o]

    def sums(self, kind: str, metric: str, offsets: Sequence[int]) -> tuple[np.ndarray, np.ndarray] | None:
        """`(numerator [S, K], denominator [S, K])` of an offline metric over the seeds `offsets` (the same
        validation samples for each); None where a seed lacks that evaluation."""
        runs = self._runs(offsets)
        if len(runs) != len(offsets) or any(kind not in r.samples for r in runs):
            return None
        keys = runs[0].samples[kind].keys_Kx3
        if any(not np.array_equal(r.samples[kind].keys_Kx3, keys) for r in runs):
            raise ValueError(f"{self.group.name}: its seeds were evaluated on other validation samples")
        parts = [intervals.metric_parts(r.samples[kind])[metric] for r in runs]
        return np.stack([p[0] for p in parts]), np.stack([p[1] for p in parts])

    def mal(self, offsets: Sequence[int]) -> tuple[np.ndarray, np.ndarray] | None:
        """`(tokens [S, R], cycles [S, R])` of the greedy decodes of the seeds `offsets`, the same `R`
        requests each; None where a seed lacks one."""
        runs = self._runs(offsets)
        parts = [(_mal_parts(g) if (g := _greedy(r)) else None) for r in runs]
        if len(runs) != len(offsets) or any(p is None for p in parts) or len({len(p[0]) for p in parts}) != 1:
            return None
        return np.stack([p[0] for p in parts]), np.stack([p[1] for p in parts])


def entries(rows: Sequence[Row]) -> list[Entry]:
    """The rows gathered per plan row over their seeds, in suite order."""
    by_base: dict[str, list[Row]] = {}
    for r in rows:
        by_base.setdefault(_base_name(r.group), []).append(r)
    return [Entry(tuple(sorted(runs, key=lambda r: r.group.seed_offset))) for runs in by_base.values()]


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


def figures_table(found: Sequence[Entry]) -> list[str]:
    """Each entry's tau_prob (own blocks, same prefixes), accept_rate_0 and MAL with 95% intervals (over
    samples or requests, and over seeds where it has several)."""
    head = [
        "row",
        "step",
        "seeds",
        "tau_prob, own blocks",
        "tau_prob, same prefixes",
        "acc@0, own blocks",
        "MAL T=0",
    ]

    def figure(e: Entry, kind: str, metric: str, digits: int = 4) -> str:
        parts = e.sums(kind, metric, e.offsets())
        mark = "" if kind != OWN or e.own_blocks_are_uniform else f" {PICKED}"
        return (fmt(_safe(intervals.seeds_ratio, *parts), digits) if parts else "-") + mark

    body = [
        [
            e.group.label,
            str(e.step),
            str(len(e.runs)),
            figure(e, OWN, "tau_prob"),
            figure(e, SAME, "tau_prob"),
            figure(e, OWN, "accept_rate_0", 3),
            fmt(_safe(intervals.seeds_ratio, *mal), 3) if (mal := e.mal(e.offsets())) else "-",
        ]
        for e in found
    ]
    return markdown(head, body)


@dataclasses.dataclass(frozen=True)
class Gain:
    """An entry against another: paired differences of tau_prob (own blocks when both are the uniform
    anchors, and on the same prefixes), accept_rate_0 and greedy MAL, over the seeds both have (seed `k`
    against seed `k`)."""

    row: Entry
    against: Entry
    kind: str  # "same budget" or "its starting checkpoint"
    seeds: int
    tau_own: Interval | None
    tau_same: Interval | None
    accept0_same: Interval | None
    mal: Interval | None


def _gain(row: Entry, against: Entry, kind: str) -> Gain:
    offsets = [o for o in row.offsets() if o in against.offsets()]

    def difference(kind_: str, metric: str) -> Interval | None:
        ours, theirs = row.sums(kind_, metric, offsets), against.sums(kind_, metric, offsets)
        if ours is None or theirs is None:
            return None
        if not np.array_equal(row.runs[0].samples[kind_].keys_Kx3, against.runs[0].samples[kind_].keys_Kx3):
            raise ValueError(
                f"{row.group.name} and {against.group.name} were evaluated on other validation samples"
            )
        return _safe(intervals.seeds_difference, *ours, *theirs)

    both_uniform = row.own_blocks_are_uniform and against.own_blocks_are_uniform
    a, b = row.mal(offsets), against.mal(offsets)
    mal = _safe(intervals.seeds_difference, *a, *b) if a and b and a[0].shape == b[0].shape else None
    return Gain(
        row,
        against,
        kind,
        len(offsets),
        difference(OWN, "tau_prob") if both_uniform else None,
        difference(SAME, "tau_prob"),
        difference(SAME, "accept_rate_0"),
        mal,
    )


def gains(found: Sequence[Entry], suite_groups: Sequence[plan.Group]) -> list[Gain]:
    """Every non-reference entry against the reference entry of its step; one that starts from another's
    checkpoint also against that entry (its starting point), a continued run against its source."""
    reference = suite_groups[0].module
    refs = {e.step: e for e in found if e.group.module == reference}
    by_name = {e.group.name: e for e in found}
    out = []
    for e in found:
        ref = refs.get(e.step)
        if e.group.module != reference and ref is not None:
            out.append(_gain(e, ref, "same budget"))
        if e.group.starts_from in by_name:
            out.append(_gain(e, by_name[e.group.starts_from], "its starting checkpoint"))
        if e.group.continues in by_name:
            out.append(_gain(e, by_name[e.group.continues], "the same run, fewer steps"))
    return out


def gains_table(found: Sequence[Gain]) -> list[str]:
    head = [
        "row",
        "step",
        "against",
        "seeds",
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
            str(g.seeds),
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
    where += "" if g.seeds == 1 else f", {g.seeds} seeds"
    against = f"{g.against.group.label} step {g.against.step} ({g.kind})"
    figure = f"step {g.row.step}: tau_prob {_figure(x, 4, True)} ({where})"
    if x.excludes_zero:
        return f"{figure} {'above' if x.estimate > 0 else 'below'} {against}: beyond noise"
    return f"{figure} against {against}: not told apart from noise"


def design_table(
    suite_groups: Sequence[plan.Group], found: Sequence[Gain], params: Mapping[str, dict]
) -> list[str]:
    """The seed's group table, each row's cells from the registry (`Experiment.report.design`), plus the
    answer its gains give at this budget."""
    head = ["group", "initialisation", "updates", "adds", "question", "answer at this budget"]
    body = []
    for group in suite_groups:
        design = registry.get(group.module).report.design
        if group.continues or group.seed_offset or design is None:
            continue
        added = params.get(group.name, {}).get("added")
        adds = design.adds + ("" if not added else f" (+{added:,} parameters)")
        answers = [_verdict(g) for g in found if g.row.group.name == group.name]
        answers += [_verdict(g) for g in found if g.row.group.continues == group.name == g.against.group.name]
        answer = "; ".join(answers) or "-"
        body.append([group.label, design.initialisation, design.updates, adds, design.question, answer])
    return markdown(head, body)


def _per_seed(parts: tuple[np.ndarray, np.ndarray] | None) -> np.ndarray | None:
    """Each seed's point figure of `(numerator [S, K], denominator [S, K])`."""
    return None if parts is None else parts[0].sum(-1) / parts[1].sum(-1)


def seeds_table(found: Sequence[Entry], gained: Sequence[Gain]) -> list[str]:
    """Per entry trained with several seeds: each seed's tau_prob on its own blocks and its same-budget gain
    (on the same prefixes where its own blocks are its own picks), their mean, standard deviation and
    range; empty without seeds."""
    seeded = [e for e in found if len(e.runs) > 1]
    if not seeded:
        return []

    def spread(values: np.ndarray | None, signed: bool) -> str:
        if values is None or not len(values):
            return "-"
        sd = float(values.std(ddof=1)) if len(values) > 1 else 0.0
        f = (lambda x: f"{x:+.4f}") if signed else (lambda x: f"{x:.4f}")
        return f"{f(values.mean())} +- {sd:.4f} ({f(values.min())} .. {f(values.max())})"

    body = []
    for e in seeded:
        delta = None
        for g in gained:
            if g.row is e and g.kind == "same budget":
                offsets = [o for o in e.offsets() if o in g.against.offsets()]
                kind = OWN if g.tau_own is not None else SAME
                ours, theirs = (_per_seed(x.sums(kind, "tau_prob", offsets)) for x in (e, g.against))
                delta = None if ours is None or theirs is None else ours - theirs
        tau = _per_seed(e.sums(OWN, "tau_prob", e.offsets()))
        body.append([e.group.label, str(len(e.runs)), spread(tau, False), spread(delta, True)])
    head = ["row", "seeds", "tau_prob, own blocks: mean +- sd (range)", "d tau_prob, same budget: mean +- sd"]
    return markdown(head, body)
