from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from harness.perf import plot
from harness.perf.pareto import Point, dominates, frontier

coords = st.tuples(st.integers(1, 50), st.integers(1, 50))


@given(st.lists(coords, min_size=1, max_size=25))
def test_frontier_is_exactly_the_undominated_points(xy):
    pts = [Point(str(i), float(x), float(y)) for i, (x, y) in enumerate(xy)]
    front = frontier(pts)
    assert front, "a non-empty set has a frontier"
    assert not any(dominates(q, p) for p in front for q in pts)
    for p in pts:
        assert p in front or any(dominates(q, p) for q in front)
    assert [p.interactivity for p in front] == sorted(p.interactivity for p in front)


def test_dominance_needs_one_strict_gain():
    a, b = Point("a", 2, 2), Point("b", 2, 2)
    assert not dominates(a, b) and dominates(Point("c", 3, 2), b) and not dominates(Point("d", 3, 1), b)


def test_render_writes_a_png_with_one_panel_per_group(tmp_path):
    groups = {
        "decode, context 17": {
            "baseline": [Point("B1", 30, 30), Point("B4", 15, 60)],
            "candidate": [Point("B1", 31, 31)],
        },
        "mixed, context 17": {"baseline": [Point("B1", 12, 12)], "candidate": []},
    }
    path = tmp_path / "deep" / "p.png"
    plot.render(groups, "title", path, note="numbers mean nothing")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    plot.render(groups, "title", tmp_path / "again.png", note="numbers mean nothing")
    assert (tmp_path / "again.png").read_bytes() == data  # no date or version stamped into the figure
    with pytest.raises(ValueError, match="no measured cells"):
        plot.render({}, "title", tmp_path / "none.png")


def test_matplotlib_is_available_here():
    assert plot.available() is None
