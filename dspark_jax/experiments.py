"""Run an experiment suite and write its report.

  python -m dspark_jax.experiments --suite=seed --preset=demo [--workdir=DIR] [--report_dir=DIR] \
      [--groups=baseline,memory] [--override=KEY=VALUE ...] [--budget=STEPS] [--seeds=N] [--limit=N] \
      [--max_new_tokens=N] [--concurrency=C] [--settings=0:fixed,1:confidence] [--report_only]

The `seed` suite trains the seed's seven groups at the protocol's step budget on one shared cache (a group
that starts from another's checkpoint on top of that group's final checkpoint, and the baseline continued to
that group's cumulative step as a same-budget row), fits each confidence
head's STS calibration, decodes the protocol's prompts speculatively with real target verification at
temperature 0 and 1 with the fixed and the confidence schedule, and writes
`results/<suite>-<preset>/report.md` with the seed's table, the plots and every source file under
`data/`. Rerunning skips finished stages and resumes a half-trained group. `--override=KEY=VALUE`
applies to every group's config that has the key (e.g. `--override=data.cache_dir=/tmp/caches`,
`--override=generate.select_top_k=4`). Demo on 2 CPU cores: caches ~16 min when missing, then ~10-13 min of
training per group and ~1 min per decoding setting.
"""

from __future__ import annotations

import dataclasses
import sys

from absl import flags

from dspark_jax.cli import REPO_ROOT, check_flags, define_path_flag, run
from dspark_jax.suite import plan, report
from dspark_jax.suite.runner import SuiteRun
from dspark_jax.training.loop import Preempted

_SUITE = flags.DEFINE_string("suite", "seed", f"Suite to run: {sorted(plan.suites())}.")
_PRESET = flags.DEFINE_string("preset", "demo", "Config preset of every group (smoke, demo, accel, paper).")
_WORKDIR = define_path_flag("workdir", None, "Suite work directory; default workdirs/suite-<suite>-<preset>.")
_REPORT_DIR = define_path_flag("report_dir", None, "Report directory; default results/<suite>-<preset>.")
_GROUPS = flags.DEFINE_list("groups", [], "Only these groups (and the groups they start from).")
_OVERRIDES = flags.DEFINE_multi_string("override", [], "KEY=VALUE for every group's config that has KEY.")
_BUDGET = flags.DEFINE_integer(
    "budget",
    None,
    "Training steps of every group (train.stop_step; at most half the preset's schedule, for the same-budget "
    "rows); default: the preset's.",
)
_SEEDS = flags.DEFINE_integer(
    "seeds", None, "Train every row this many times with other train.seed values; default: the preset's (1)."
)
_LIMIT = flags.DEFINE_integer("limit", None, "Prompts decoded per setting (0 = all); default: the preset's.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", None, "New tokens per reply; default: the preset's.")
_CONCURRENCY = flags.DEFINE_integer("concurrency", None, "Requests decoded together; default: the preset's.")
_SETTINGS = flags.DEFINE_list(
    "settings", [], "Decoding settings TEMPERATURE:SCHEDULE (fixed, confidence); default: the preset's."
)
_REPORT_ONLY = flags.DEFINE_bool("report_only", False, "Rewrite the report from the work directory only.")
PREEMPTED_STATUS = 75


def main(argv):
    del argv
    check_flags(
        preset=(
            _PRESET.value in plan.PROTOCOLS,
            f"must be one of {sorted(plan.PROTOCOLS)}, got {_PRESET.value!r}",
        ),
        budget=(_BUDGET.value is None or _BUDGET.value >= 1, f"must be >= 1, got {_BUDGET.value}"),
        seeds=(_SEEDS.value is None or _SEEDS.value >= 1, f"must be >= 1, got {_SEEDS.value}"),
        limit=(_LIMIT.value is None or _LIMIT.value >= 0, f"must be >= 0 (0 = all), got {_LIMIT.value}"),
        max_new_tokens=(_MAX_NEW.value is None or _MAX_NEW.value >= 1, f"must be >= 1, got {_MAX_NEW.value}"),
        concurrency=(
            _CONCURRENCY.value is None or _CONCURRENCY.value >= 1,
            f"must be >= 1, got {_CONCURRENCY.value}",
        ),
    )
    settings = plan.parse_settings(_SETTINGS.value)
    name = f"{_SUITE.value}-{_PRESET.value}"
    workdir = _WORKDIR.value or str(REPO_ROOT / "workdirs" / f"suite-{name}")
    report_dir = _REPORT_DIR.value or str(REPO_ROOT / "results" / name)
    protocol = plan.PROTOCOLS[_PRESET.value]
    given = {
        "budget": _BUDGET.value,
        "seeds": _SEEDS.value,
        "limit": _LIMIT.value,
        "max_new_tokens": _MAX_NEW.value,
        "concurrency": _CONCURRENCY.value,
        "settings": settings or None,
    }
    protocol = dataclasses.replace(protocol, **{k: v for k, v in given.items() if v is not None})
    suite = SuiteRun(
        _SUITE.value,
        _PRESET.value,
        workdir,
        names=_GROUPS.value,
        overrides=_OVERRIDES.value,
        protocol=protocol,
    )
    if not _REPORT_ONLY.value:
        report.check_out(report_dir, suite.record["groups"])  # before any work
        try:
            suite.run()
        except Preempted as e:
            print(f"{e} (suite work directory {workdir})", file=sys.stderr)
            sys.exit(PREEMPTED_STATUS)
    path = report.write_report(workdir, report_dir)
    print(f"report: {path}\nwork directory: {workdir}")


if __name__ == "__main__":
    run(main, config_default=None)
