"""Eval tau_prob against wall-clock minutes of whole main-job runs, several runs on one plot.

  python benchmarks/demo_curve.py --run=old=results/baseline-demo-2026-11-30 --run=new=WORKDIR \
      [--svg=curve.svg]

Each `--run=LABEL=DIR` names a directory with the run's `metrics.jsonl` and `summary.json`;
`--caches_from=LABEL=DIR` adds the cache minutes of the run in DIR to LABEL's clock (a run that reused
the caches another built: the curve a fresh machine would see). Minutes
count from the start of the `train` command (cache build, compiles and evaluations included): a
run's own `eval/wall_minutes` where it logged them, else rebuilt from its summary and step times
(caches + setup + first step, then each logged step's `train/step_seconds` for the steps since the
last logged one, plus the mean evaluation time per evaluation). Prints one table per run and writes
an SVG with one line per run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd")


def curve(directory: Path) -> list[tuple[float, int, float]]:
    """`(minutes, step, eval tau_prob)` of each evaluation of the run in `directory`."""
    lines = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines() if line]
    evals = [line for line in lines if "eval/tau_prob" in line]
    if all("eval/wall_minutes" in line for line in evals):
        return [(line["eval/wall_minutes"], line["step"], line["eval/tau_prob"]) for line in evals]
    seconds = json.loads((directory / "summary.json").read_text())["seconds"]
    per_eval = seconds["eval"] / max(len(evals), 1)
    clock = seconds["caches"] + seconds["setup"] + seconds["first_step"]
    points, last_step, done_evals = [], 1, 0
    for line in lines:
        if "train/step_seconds" in line:
            clock += line["train/step_seconds"] * (line["step"] - last_step)
            last_step = line["step"]
        if "eval/tau_prob" in line:
            done_evals += 1
            points.append(((clock + done_evals * per_eval) / 60, line["step"], line["eval/tau_prob"]))
    return points


def svg(curves: dict[str, list[tuple[float, int, float]]], width: int = 640, height: int = 400) -> str:
    """A line plot of tau_prob against minutes, one line per run, with axes and a legend."""
    points = [p for c in curves.values() for p in c]
    x_max = max(p[0] for p in points) * 1.05
    y_min, y_max = 1.0, max(p[2] for p in points) * 1.05
    left, bottom, right, top = 60, height - 45, width - 20, 20

    def xy(minutes: float, tau: float) -> str:
        x = left + (right - left) * minutes / x_max
        y = bottom - (bottom - top) * (tau - y_min) / (y_max - y_min)
        return f"{x:.1f},{y:.1f}"

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
        'font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<line x1="{left}" y1="{bottom}" x2="{right}" y2="{bottom}" stroke="black"/>',
        f'<line x1="{left}" y1="{bottom}" x2="{left}" y2="{top}" stroke="black"/>',
        f'<text x="{(left + right) / 2}" y="{height - 8}" text-anchor="middle">minutes since the command '
        "started (caches included)</text>",
        f'<text x="14" y="{(top + bottom) / 2}" transform="rotate(-90 14 {(top + bottom) / 2})" '
        'text-anchor="middle">eval tau_prob (GSM8K)</text>',
    ]
    for minutes in range(0, int(x_max) + 1, 5):
        x, _ = xy(minutes, y_min).split(",")
        out.append(f'<text x="{x}" y="{bottom + 16}" text-anchor="middle">{minutes}</text>')
    ticks = [y_min + k * (y_max - y_min) / 5 for k in range(6)]
    for tau in ticks:
        _, y = xy(0, tau).split(",")
        out.append(f'<text x="{left - 6}" y="{float(y) + 4}" text-anchor="end">{tau:.2f}</text>')
    for k, (label, c) in enumerate(curves.items()):
        colour = COLOURS[k % len(COLOURS)]
        path = " ".join(xy(m, tau) for m, _, tau in c)
        out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"/>')
        out += [
            f'<circle cx="{xy(m, t).split(",")[0]}" cy="{xy(m, t).split(",")[1]}" r="3" fill="{colour}"/>'
            for m, _, t in c
        ]
        out.append(f'<text x="{left + 12}" y="{top + 16 * (k + 1)}" fill="{colour}">{label}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run", action="append", required=True, help="LABEL=DIR (repeat)")
    parser.add_argument(
        "--caches_from",
        action="append",
        default=[],
        help="LABEL=DIR: LABEL's run reused the caches DIR's run built; add DIR's cache minutes to its clock",
    )
    parser.add_argument("--svg", default="", help="write the plot here")
    args = parser.parse_args()
    curves = {}
    for item in args.run:
        label, _, directory = item.partition("=")
        curves[label] = curve(Path(directory))
    for item in args.caches_from:
        label, _, directory = item.partition("=")
        minutes = json.loads((Path(directory) / "summary.json").read_text())["seconds"]["caches"] / 60
        curves[label] = [(m + minutes, step, tau) for m, step, tau in curves[label]]
    for label, c in curves.items():
        print(f"{label}:")
        print(f"  {'minutes':>8s} {'step':>6s} {'tau_prob':>9s}")
        for minutes, step, tau in c:
            print(f"  {minutes:8.1f} {step:6d} {tau:9.4f}")
    if args.svg:
        Path(args.svg).write_text(svg(curves))
        print(f"plot: {args.svg}")


if __name__ == "__main__":
    main()
