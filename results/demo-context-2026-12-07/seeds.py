"""Draft Memory's main job over training seeds: per seed the final evaluation's tau_prob and the paired gains
of its memory and of the target context (95% intervals over the 256 validation samples), then each gain's
mean over seeds with a t-interval over the per-seed gains (seed-to-seed variation; n - 1 degrees of freedom).

  python results/demo-context-2026-12-07/seeds.py memory-s42_metrics.jsonl memory-s43_metrics.jsonl ...
"""

import json
import sys

import numpy as np
from scipy import stats


def final_eval(path: str) -> dict:
    with open(path) as f:
        lines = [json.loads(line) for line in f]
    return [m for m in lines if "eval/memory_gain" in m][-1]


rows = {path: final_eval(path) for path in sys.argv[1:]}
print("| run | step | tau_prob [95%] | memory gain [95%] | context gain [95%] |")
print("| --- | --- | --- | --- | --- |")
for path, m in rows.items():
    cells = [f"{m['eval/tau_prob']:.4f} [{m['eval/tau_prob_low95']:.4f}, {m['eval/tau_prob_high95']:.4f}]"]
    for name in ("memory", "context"):
        cells.append(
            f"{m[f'eval/{name}_gain']:+.4f} [{m[f'eval/{name}_gain_low95']:+.4f}, "
            f"{m[f'eval/{name}_gain_high95']:+.4f}]"
        )
    print(f"| {path} | {m['step']} | " + " | ".join(cells) + " |")
for name in ("tau_prob", "memory_gain", "context_gain"):
    x = np.array([m[f"eval/{name}"] for m in rows.values()])
    half = stats.t.ppf(0.975, len(x) - 1) * x.std(ddof=1) / np.sqrt(len(x))
    print(f"{name} over {len(x)} seeds: {x.mean():+.4f} [{x.mean() - half:+.4f}, {x.mean() + half:+.4f}]")
