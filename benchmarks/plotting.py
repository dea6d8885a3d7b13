"""One figure shape shared by the benchmarks: a panel per prompt set, a line per method or policy."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tools.prompt_sets import PROMPT_SETS


def panels_by_set(path: Path, rows: list[dict], *, x: str, y: str, series_key: str, series: Sequence[str],
                  highlight: str, xlabel: str, ylabel: str, baseline: float | None = None) -> None:
    """Save a PNG with one panel per prompt set in `rows` (log2 x axis), one line per value of `series_key`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = sorted({r["set"] for r in rows}, key=PROMPT_SETS.index)
    fig, axes = plt.subplots(1, len(sets), figsize=(4.2 * len(sets), 3.6), squeeze=False)
    for ax, set_name in zip(axes[0], sets):
        for name in series:
            points = sorted((r[x], r[y]) for r in rows if r["set"] == set_name and r[series_key] == name)
            if points:
                ax.plot(*zip(*points), marker="o", label=name, linewidth=2 if name == highlight else 1)
        if baseline is not None:
            ax.axhline(baseline, color="grey", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(set_name)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
