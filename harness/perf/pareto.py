"""Interactivity (tokens/s per user) against output throughput per GPU: the points of each arm and their frontier.

A deployment picks one point; a change helps if it moves the frontier out. Points are grouped by workload and
context (a frontier across contexts would compare different jobs); batch, TP and tokens per request are the
choices the frontier is drawn over.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from harness.perf.measure import ARMS, CellResult


@dataclass(frozen=True)
class Point:
    label: str
    interactivity: float  # tokens/s per user
    throughput_per_gpu: float  # output tokens/s per GPU


def dominates(a: Point, b: Point) -> bool:
    """a is at least as good as b on both axes and better on one."""
    at_least = a.interactivity >= b.interactivity and a.throughput_per_gpu >= b.throughput_per_gpu
    return at_least and (a.interactivity > b.interactivity or a.throughput_per_gpu > b.throughput_per_gpu)


def frontier(points: Iterable[Point]) -> list[Point]:
    """The points no other point dominates, by rising interactivity."""
    pts = list(points)
    return sorted((p for p in pts if not any(dominates(q, p) for q in pts)), key=lambda p: p.interactivity)


def group_key(result: CellResult) -> str:
    return f"{result.cell.workload}, context {result.cell.context}"


def points(results: Iterable[CellResult]) -> dict[str, dict[str, list[Point]]]:
    """group -> arm -> points, for the cells whose timing gave metrics."""
    out: dict[str, dict[str, list[Point]]] = defaultdict(lambda: {arm: [] for arm in ARMS})
    for r in results:
        if not r.axes:
            continue
        c = r.cell
        label = f"TP{c.tp} B{c.batch}" + (f" q{c.tokens_per_request}" if c.tokens_per_request > 1 else "")
        for arm in ARMS:
            m = r.axes[arm]
            out[group_key(r)][arm].append(Point(label, m.tok_s_per_user, m.output_tok_s_per_gpu))
    return dict(out)


def frontiers_json(groups: dict[str, dict[str, list[Point]]]) -> dict[str, dict[str, list[dict[str, object]]]]:
    return {g: {arm: [asdict(p) for p in frontier(pts)] for arm, pts in arms.items()} for g, arms in groups.items()}
