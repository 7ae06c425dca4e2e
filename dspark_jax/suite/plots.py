"""PNG figures of the project's reports (matplotlib, headless)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from dspark_jax.training import intervals


def reliability_diagrams(
    path: str | os.PathLike, tables: Mapping[str, Sequence[Mapping[str, list]]], title: str
) -> None:
    """One panel per position: measured vs predicted acceptance per bin, a curve per table name, each point
    labelled with its bin's number of blocks and with a 95% Wilson bar (exact for 0/1 greedy acceptance,
    wide enough for a mean of `n` values in [0, 1]): a line through bins of a handful of blocks reads as
    noise, not as a finding.

    `tables[name][k]` is `calibration.reliability(...)` of position `k` (bins with `count`, mean
    `confidence` and mean `accuracy`); the diagonal is perfect calibration.
    """
    names = list(tables)
    positions = len(tables[names[0]])
    cols = min(positions, 4)
    rows = -(-positions // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.0 * rows), squeeze=False)
    for k, ax in enumerate(axes.flat):
        if k >= positions:
            ax.axis("off")
            continue
        ax.plot([0, 1], [0, 1], color="0.7", lw=1)
        for name in names:
            bins = tables[name][k]
            kept = [
                (c, a, n)
                for c, a, n in zip(bins["confidence"], bins["accuracy"], bins["count"])
                if c is not None
            ]
            if kept:
                xs, ys, ns = map(np.asarray, zip(*kept))
                low, high = intervals.wilson(ys, ns)
                bars = np.stack([ys - low, high - ys]).clip(0, None)
                line = ax.errorbar(xs, ys, yerr=bars, marker="o", ms=3, capsize=2, lw=1, label=name)
                for x, y, n in kept:
                    ax.annotate(
                        str(n),
                        (x, y),
                        fontsize=6,
                        color=line[0].get_color(),
                        xytext=(2, 2),
                        textcoords="offset points",
                    )
        ax.set(xlim=(0, 1), ylim=(0, 1.05), title=f"prefix through proposal {k + 1}")
        if k % cols == 0:
            ax.set_ylabel("measured acceptance")
        if k >= positions - cols:
            ax.set_xlabel("predicted survival")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"{title} (point labels: blocks in the bin; bars: 95%)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def lines(
    path: str | os.PathLike,
    series: Mapping[str, tuple[Sequence[float], ...]],
    *,
    xlabel: str,
    ylabel: str,
    title: str,
) -> None:
    """One line per name over `(xs, ys)`, on one axis; `(xs, ys, lows, highs)` adds a shaded 95% band (a
    point without its interval, None, leaves a gap in the band)."""
    fig, ax = plt.subplots(figsize=(7.0, 4.2))
    for name, (xs, ys, *band) in series.items():
        (line,) = ax.plot(xs, ys, marker="o", ms=3, label=name)
        if band:
            low, high = (np.asarray([np.nan if v is None else v for v in b], np.float64) for b in band)
            ax.fill_between(xs, low, high, color=line.get_color(), alpha=0.15, lw=0)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def grouped_bars(
    path: str | os.PathLike,
    bars: Mapping[str, Mapping[str, float]],
    *,
    xlabel: str,
    ylabel: str,
    title: str,
) -> None:
    """Bars of every name side by side at each category (`bars[name][category]`, categories in first-seen
    order)."""
    categories = list(dict.fromkeys(c for values in bars.values() for c in values))
    width = 0.8 / max(len(bars), 1)
    fig, ax = plt.subplots(figsize=(7.0, 4.2))
    for k, (name, values) in enumerate(bars.items()):
        xs = [i + (k - (len(bars) - 1) / 2) * width for i in range(len(categories))]
        ax.bar(xs, [values.get(c, 0.0) for c in categories], width=width, label=name)
    ax.set_xticks(range(len(categories)), categories)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
