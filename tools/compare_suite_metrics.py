"""Offline metrics of two suite reports, value by value (timings aside): equal to the last digit?

  python tools/compare_suite_metrics.py OLD_REPORT_DIR NEW_REPORT_DIR

Each directory is a report written by `python -m dspark_jax.experiments` (its `data/<group>/metrics.jsonl`).
"""

import json
import sys
from pathlib import Path

TIMING = ("seconds", "_ms", "per_second", "wall", "eta")


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def main(old: Path, new: Path) -> int:
    total = differ = 0
    groups = [
        p.name
        for p in old.iterdir()
        if (p / "metrics.jsonl").exists() and (new / p.name / "metrics.jsonl").exists()
    ]
    for group in sorted(groups):
        a, b = rows(old / group / "metrics.jsonl"), rows(new / group / "metrics.jsonl")
        if len(a) != len(b):
            print(f"{group}: {len(a)} rows vs {len(b)}")
            differ += 1
            continue
        values = differing = 0
        for x, y in zip(a, b):
            for key in sorted(set(x) | set(y)):
                if any(t in key for t in TIMING):
                    continue
                values += 1
                if x.get(key) != y.get(key):
                    differing += 1
                    if differing <= 3:
                        print(f"  {group} step {x.get('step')} {key}: {x.get(key)!r} != {y.get(key)!r}")
        print(f"{group}: {values} values, {differing} differ")
        total, differ = total + values, differ + differing
    print(f"all: {total} values compared, {differ} differ")
    return int(differ > 0)


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]) / "data", Path(sys.argv[2]) / "data"))
