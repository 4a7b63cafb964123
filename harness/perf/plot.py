"""The Pareto figure of a perf run, as a PNG, drawn with matplotlib's object API (no pyplot global state)."""

from __future__ import annotations

import math
from pathlib import Path

from harness.perf.pareto import Point, frontier

COLORS = {"baseline": "#57606a", "candidate": "#0969da"}
MARKERS = {"baseline": "o", "candidate": "x"}
COLUMNS = 3


def available() -> str | None:
    """None when figures can be drawn, else why not and the fix."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "matplotlib is not installed, so the Pareto figure cannot be drawn — install k3gate[plots]"
    return None


def _spread(values: list[float]) -> float:
    pos = [v for v in values if v > 0]
    return max(pos) / min(pos) if pos else 1.0


def render(groups: dict[str, dict[str, list[Point]]], title: str, path: Path, note: str = "") -> None:
    """One panel per group: both arms' points, labelled, with each arm's frontier as a line."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not groups:
        raise ValueError("no measured cells to plot")
    n = len(groups)
    cols = min(COLUMNS, n)
    rows = math.ceil(n / cols)
    fig = Figure(figsize=(5.2 * cols, 4.2 * rows + 0.4), dpi=100)
    FigureCanvasAgg(fig)
    for i, (group, arms) in enumerate(sorted(groups.items())):
        ax = fig.add_subplot(rows, cols, i + 1)
        xs, ys = [], []
        for arm, pts in arms.items():
            if not pts:
                continue
            ax.scatter(
                [p.interactivity for p in pts],
                [p.throughput_per_gpu for p in pts],
                c=COLORS[arm],
                marker=MARKERS[arm],
                label=arm,
            )
            front = frontier(pts)
            ax.plot([p.interactivity for p in front], [p.throughput_per_gpu for p in front], c=COLORS[arm], lw=1)
            if arm == "baseline":
                for p in pts:
                    ax.annotate(p.label, (p.interactivity, p.throughput_per_gpu), fontsize=7, alpha=0.8)
            xs += [p.interactivity for p in pts]
            ys += [p.throughput_per_gpu for p in pts]
        # Linear axes start at zero, so a small difference is not drawn as a large one.
        if _spread(xs) > 20:
            ax.set_xscale("log")
        else:
            ax.set_xlim(left=0, right=max(xs) * 1.15)
        if _spread(ys) > 20:
            ax.set_yscale("log")
        else:
            ax.set_ylim(bottom=0, top=max(ys) * 1.15)
        ax.set_title(group, fontsize=10)
        ax.set_xlabel("interactivity (tokens/s per user)")
        ax.set_ylabel("output tokens/s per GPU")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title + (f"\n{note}" if note else ""), fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    path.parent.mkdir(parents=True, exist_ok=True)
    # No Software/date metadata: the same measurements draw the same bytes.
    fig.savefig(path, format="png", metadata={"Software": None})
