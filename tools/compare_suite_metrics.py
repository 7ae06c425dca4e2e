"""Offline metrics of two suite reports compared value by value (timings aside): are they equal to the last digit?

  python tools/compare_suite_metrics.py OLD_REPORT_DIR NEW_REPORT_DIR

Each directory is a report written by `python -m dspark_jax.experiments` (its `data/<group>/metrics.jsonl`).
"""

import json
import sys
from pathlib import Path

old, new = Path(sys.argv[1]) / "data", Path(sys.argv[2]) / "data"
TIMING = ("seconds", "_ms", "per_second", "wall", "eta")
total = differ = 0
for group in sorted(p.name for p in old.iterdir() if p.is_dir() and (p / "metrics.jsonl").exists()):
    a = [json.loads(l) for l in (old / group / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(l) for l in (new / group / "metrics.jsonl").read_text().splitlines()]
    assert len(a) == len(b), (group, len(a), len(b))
    n = d = 0
    for x, y in zip(a, b):
        for k in sorted(set(x) | set(y)):
            if any(t in k for t in TIMING):
                continue
            n += 1
            if x.get(k) != y.get(k):
                d += 1
                if d <= 3:
                    print(f"  {group} step {x.get('step')} {k}: {x.get(k)!r} != {y.get(k)!r}")
    print(f"{group}: {n} values, {d} differ")
    total += n
    differ += d
print(f"all: {total} values compared, {differ} differ")
