"""A stage's image evidence shows in both report formats: linked from markdown, inline (base64) in HTML."""

from __future__ import annotations

import base64
import json

from harness.report import markdown, page
from harness.report.model import build

PNG = b"\x89PNG\r\n\x1a\n" + b"fake image bytes"


def _bundle(tmp_path, figures, evidence, write=True):
    folder = tmp_path / "stages" / "perf"
    folder.mkdir(parents=True)
    if write:
        (folder / "pareto.png").write_bytes(PNG)
    records = {"stage": "perf", "status": "ran", "checks": [], "metrics": {"figures": figures}, "evidence": evidence}
    (folder / "records.json").write_text(json.dumps(records))
    return {
        "required": ["perf"],
        "verdicts": [{"stage": "perf", "verdict": "PASSED", "reason": "all 1 checks passed"}],
        "environment": {"gpu": {"count": 0, "names": []}},
        "git": {"commit": "abc", "dirty": False},
        "config": {"name": "cpu-smoke"},
        "subject": {"subject": "k3-hopper"},
        "tier": "smoke",
        "outcome": {"outcome": "PASSED", "reason": "ok"},
        "started": "now",
        "stages_selected": ["perf"],
    }


FIG = {"path": "stages/perf/pareto.png", "caption": "Pareto view; CPU numbers mean nothing"}


def test_figures_are_linked_in_markdown_and_inlined_in_html(tmp_path):
    predicate = _bundle(tmp_path, [FIG], ["stages/perf/pareto.png"])
    md = markdown.render(predicate, tmp_path)
    assert "![perf: pareto.png](../stages/perf/pareto.png)" in md and "*Pareto view; CPU numbers mean nothing*" in md
    html = page.render(predicate, tmp_path)
    assert f"src='data:image/png;base64,{base64.b64encode(PNG).decode()}'" in html
    assert "<figcaption>Pareto view; CPU numbers mean nothing</figcaption>" in html


def test_only_the_stages_own_image_evidence_is_shown(tmp_path):
    not_evidence = _bundle(tmp_path / "a", [FIG], [])
    assert build(not_evidence, tmp_path / "a").stages[0].figures == []
    not_image = _bundle(
        tmp_path / "b", [{"path": "stages/perf/cells.jsonl", "caption": "x"}], ["stages/perf/cells.jsonl"]
    )
    assert build(not_image, tmp_path / "b").stages[0].figures == []


def test_a_missing_figure_file_is_said_not_hidden(tmp_path):
    predicate = _bundle(tmp_path, [FIG], ["stages/perf/pareto.png"], write=False)
    html = page.render(predicate, tmp_path)
    assert "figure stages/perf/pareto.png is missing from the bundle" in html and "data:image" not in html
