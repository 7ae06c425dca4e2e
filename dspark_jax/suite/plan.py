"""What a suite runs: its groups (config files, who starts from whom) and the inference protocol per preset.

A suite's groups come from the registry (`Experiment.report.suites`, in registration order): the `seed` suite
is the seed's seven groups at one step budget on one shared cache. Every group trains the protocol's `budget`
steps (`train.stop_step`, of the preset's full `train.total_steps` schedule); a group that starts from
another's checkpoint (`Experiment.model.init_from`) trains that many new steps on top of that group's final
checkpoint (its metrics are on the cumulative step axis). For each such pair the suite adds a same-budget
row: the source group's own run continued, from its final checkpoint and on its schedule, to the cumulative
step of the group that starts from it (the seed's "gain over a separately trained baseline at the same
budget"). The suite's first group is its reference: every other row's gains are measured against the
reference row of the same cumulative step.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import sys
from collections.abc import Mapping, Sequence

from dspark_jax import groups as registry
from dspark_jax.errors import UsageError
from dspark_jax.run import config_lib
from dspark_jax.run.config_lib import REPO_ROOT, with_absolute_paths


@dataclasses.dataclass(frozen=True)
class Group:
    """One row of the suite: a name (its work directory), a display name, its experiment group and config
    module (`configs/<module>.py`) and the row whose final checkpoint it starts from (None = from scratch).
    A same-budget row `continues` a row's run to the cumulative step of the row `budget_of`."""

    name: str
    label: str
    module: str
    starts_from: str | None = None
    continues: str | None = None
    budget_of: str | None = None
    seed_offset: int = 0  # `train.seed = seed + seed_offset` (the suite's `--seeds`)


SAME_BUDGET = "{source}_same_budget"
SEED_ROW = "{name}_seed{offset}"


def with_seeds(rows: Sequence[Group], seeds: int) -> tuple[Group, ...]:
    """The rows, then for each `k = 1 .. seeds - 1` every row again with `train.seed = seed + k`: the same
    caches, target and validation batches, another initialisation and training data order; a row that
    starts from or continues another does so from that row of its own seed."""
    rename = lambda name, k: name and SEED_ROW.format(name=name, offset=k)
    out = list(rows)
    for k in range(1, seeds):
        out += [
            dataclasses.replace(
                g,
                name=rename(g.name, k),
                label=f"{g.label}, seed +{k}",
                starts_from=rename(g.starts_from, k),
                continues=rename(g.continues, k),
                budget_of=rename(g.budget_of, k),
                seed_offset=k,
            )
            for g in rows
        ]
    return tuple(out)


def suites() -> dict[str, tuple[Group, ...]]:
    """Every suite of the registered groups: `{suite: its groups in registration order, then one same-budget
    row per group that starts from another}`."""
    out: dict[str, list[Group]] = {}
    for e in registry.registered():
        for suite in e.report.suites:
            out.setdefault(suite, []).append(Group(e.name, e.display_name, e.name, e.model.init_from))
    for members in out.values():
        labels = {g.name: g.label for g in members}
        for g in [g for g in members if g.starts_from in labels]:
            members.append(
                Group(
                    SAME_BUDGET.format(source=g.starts_from),
                    f"{labels[g.starts_from]}, {g.label}'s budget",
                    g.starts_from,
                    continues=g.starts_from,
                    budget_of=g.name,
                )
            )
    return {suite: tuple(members) for suite, members in out.items()}


SCHEDULES = ("fixed", "confidence")
ALL_SETTINGS = tuple((t, schedule) for t in (0.0, 1.0) for schedule in SCHEDULES)


def parse_settings(items: Sequence[str]) -> tuple[tuple[float, str], ...]:
    """Decoding settings from `TEMPERATURE:SCHEDULE` items (`['0:fixed', '1:confidence']`)."""
    settings = []
    for item in items:
        temperature, _, schedule = item.partition(":")
        try:
            value = float(temperature)
        except ValueError:
            value = -1.0
        if value < 0 or schedule not in SCHEDULES:
            raise UsageError(
                f"--settings item {item!r}: expected TEMPERATURE:SCHEDULE with a temperature >= 0 and a "
                f"schedule in {SCHEDULES}, e.g. 0:fixed,1:confidence"
            )
        settings.append((value, schedule))
    return tuple(settings)


@dataclasses.dataclass(frozen=True)
class Protocol:
    """Speculative decoding with real target verification, the same for every group: the first `limit`
    prompts of the packaged GSM8K-256 (0 = all), `max_new_tokens` per reply, `concurrency` requests per
    program, at each `(temperature, schedule)` of `settings`; `time_phases` adds the cycle's latency split
    (draft / select / verify, each phase compiled and timed apart). `budget`: the steps every group trains
    (`train.stop_step`, set by `--budget`, never by an override), at most half the preset's schedule so
    that a same-budget row can continue a run to twice it. `seeds`: every row trained this many times with
    other `train.seed`s (`with_seeds`), the report showing the spread across them."""

    limit: int
    max_new_tokens: int
    budget: int
    seeds: int = 1
    concurrency: int = 1
    settings: tuple[tuple[float, str], ...] = ALL_SETTINGS
    time_phases: bool = True


PROTOCOLS = {
    # Both temperatures and both schedules, in two runs per group instead of four; no latency split.
    "smoke": Protocol(
        limit=2,
        max_new_tokens=8,
        budget=3,
        settings=((0.0, "fixed"), (1.0, "confidence")),
        time_phases=False,
    ),
    # Three training seeds a row: a difference is told apart from noise only beyond the spread between
    # seeds (one run's sample interval misses it: two equal Baseline runs once differed "beyond noise").
    "demo": Protocol(limit=16, max_new_tokens=96, budget=150, seeds=3),
    "accel": Protocol(limit=64, max_new_tokens=256, budget=1000, seeds=3, concurrency=8),
    "paper": Protocol(limit=0, max_new_tokens=256, budget=2604, concurrency=8),  # the seed's one epoch
}


def groups(suite: str, names: Sequence[str] = ()) -> tuple[Group, ...]:
    """The suite's groups, or the named subset with every group they start from (in suite order)."""
    known = suites()
    if suite not in known:
        raise UsageError(f"--suite={suite!r} is not a suite; choose one of {sorted(known)}")
    members = {g.name: g for g in known[suite]}
    unknown = [n for n in names if n not in members]
    if unknown:
        raise UsageError(f"--groups: {unknown[0]!r} is not in suite {suite!r}; choose from {list(members)}")
    wanted = set(names or members)
    for name in list(wanted):
        if members[name].continues:
            wanted |= {members[name].continues, members[name].budget_of}
    for name in list(wanted):
        while members[name].starts_from:
            name = members[name].starts_from
            wanted.add(name)
    wanted |= {g.name for g in members.values() if g.budget_of in wanted}
    return tuple(g for g in known[suite] if g.name in wanted)


def command_line(record: Mapping) -> str:
    """The `python -m dspark_jax.experiments` command of a suite record (`suite.json`): every flag whose value
    differs from the preset's default, so a report names the budget and protocol it was run at."""
    suite, preset, protocol = record["suite"], record["preset"], record["protocol"]
    default = PROTOCOLS[preset]
    flags = [f"--suite={suite}", f"--preset={preset}"]
    rows = suites()[suite]
    if [g for g in record["groups"] if g in {r.name for r in rows}] != [g.name for g in rows]:
        asked = [g.name for g in rows if g.name in record["groups"] and not g.continues]  # the rest follows
        flags.append("--groups=" + ",".join(asked))
    flags += [f"--override={o}" for o in record["overrides"]]
    for name in ("budget", "seeds", "limit", "max_new_tokens", "concurrency"):
        if protocol.get(name, getattr(default, name)) != getattr(default, name):  # older records: no budget
            flags.append(f"--{name}={protocol[name]}")
    settings = tuple((float(t), s) for t, s in protocol["settings"])
    if settings != default.settings:
        flags.append("--settings=" + ",".join(f"{t:g}:{s}" for t, s in settings))
    return " ".join(["python -m dspark_jax.experiments", *flags])


def _value(text: str, current):
    """`text` parsed as the type of the config's current value (strings stay strings)."""
    if isinstance(current, str):
        return text
    if isinstance(current, bool):
        if text.lower() not in ("true", "false"):
            raise ValueError(f"expected true or false, got {text!r}")
        return text.lower() == "true"
    value = ast.literal_eval(text)
    return float(value) if isinstance(current, float) else value


def group_config(group: Group, preset: str, overrides: Sequence[str] = ()):
    """`configs/<module>.py:<preset>` with `KEY=VALUE` overrides applied (paths made absolute), validated."""
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    config = importlib.import_module(f"configs.{group.module}").get_config(preset)
    with config.unlocked():
        for item in overrides:
            key, _, text = item.partition("=")
            section, _, name = key.rpartition(".")
            node = config
            try:
                for part in filter(None, section.split(".")):
                    node = node[part]
                current = node[name]
            except (KeyError, AttributeError):
                continue  # a key of another group's config (a section only that group has)
            try:
                node[name] = _value(text, current)
            except (ValueError, SyntaxError, TypeError) as e:
                raise UsageError(f"--override {item!r}: {e}") from None
    config = with_absolute_paths(config)
    config_lib.validate(config)
    return config


def check_overrides(suite_groups: Sequence[Group], preset: str, overrides: Sequence[str]) -> None:
    """Every override names a key of at least one group's config, and is KEY=VALUE; the step budget is the
    protocol's (`--budget`), not an override."""
    for item in overrides:
        key, sep, _ = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--override {item!r}: expected KEY=VALUE (e.g. data.cache_dir=/tmp/caches)")
        if key == "train.stop_step":
            raise UsageError(f"--override {item!r}: the suite's step budget is --budget=N, for every group")
    configs = [group_config(g, preset) for g in suite_groups]
    for item in overrides:
        key = item.partition("=")[0]
        if not any(key in config_lib.flatten(c.to_dict()) for c in configs):
            raise UsageError(f"--override {item!r}: {key} is not a key of any group's config")
