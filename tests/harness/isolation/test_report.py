"""What the isolation stage puts in a bundle shows in both report formats: the checks it could not run (with their
reasons, apart from the verdict) and the fallback timeline, cut when long."""

from __future__ import annotations

import json

from harness.report import markdown, page
from harness.report.model import TIMELINE_ROWS, build

ROW = {
    "step": 1,
    "cell": "decode",
    "mode": "eager",
    "event": "specialized path chosen",
    "path": "specialized",
    "where": "layers 4-6: kda",
    "reason": "pure decode, batch 2 prepared | provider x",
    "wrote": "KDA slots 1-2 of layers 4-6; nothing else changed",
}
NOT_RUN = {"name": "line coverage (k3_decode/kernels/**/*.py)", "reason": "no file matches k3_decode/kernels/**/*.py"}


def _bundle(tmp_path, rows):
    folder = tmp_path / "stages" / "isolation"
    folder.mkdir(parents=True)
    metrics = {"not_run": [NOT_RUN], "timelines": [{"title": "Fallback timeline: tp1 auto", "rows": rows}]}
    records = {"stage": "isolation", "status": "ran", "checks": [], "metrics": metrics, "evidence": []}
    (folder / "records.json").write_text(json.dumps(records))
    return {
        "required": ["isolation"],
        "verdicts": [{"stage": "isolation", "verdict": "PASSED", "reason": "all 9 checks passed"}],
        "environment": {"gpu": {"count": 0, "names": []}},
        "git": {"commit": "abc", "dirty": False},
        "config": {"name": "cpu-smoke"},
        "subject": {"subject": "k3-hopper"},
        "tier": "smoke",
        "outcome": {"outcome": "PASSED", "reason": "ok"},
        "started": "now",
        "stages_selected": ["isolation"],
    }


def test_not_run_items_and_the_timeline_show_in_markdown(tmp_path):
    md = markdown.render(_bundle(tmp_path, [ROW]), tmp_path)
    assert "### Not run inside stages (never counted as passed)" in md
    # Globs stay literal: markdown would read `**` as emphasis.
    assert (
        r"- isolation: **line coverage (k3_decode/kernels/\*\*/\*.py)**: no file matches k3_decode/kernels/\*\*" in md
    )
    assert "### isolation: Fallback timeline: tp1 auto" in md
    assert "| step | cell | mode | event | path | where | reason | wrote |" in md
    assert (
        "| 1 | decode | eager | specialized path chosen | specialized | layers 4-6: kda | pure decode, batch 2 "
        r"prepared \| provider x |" in md
    )


def test_not_run_items_and_the_timeline_show_in_html(tmp_path):
    html = page.render(_bundle(tmp_path, [ROW]), tmp_path)
    assert "<h2>Not run inside stages (never counted as passed)</h2>" in html
    assert "<b>line coverage (k3_decode/kernels/**/*.py)</b>" in html
    assert "<h3>isolation: Fallback timeline: tp1 auto</h3>" in html and "<td>specialized path chosen</td>" in html


def test_a_long_timeline_is_cut_and_points_to_the_evidence(tmp_path):
    rows = [dict(ROW, step=i) for i in range(TIMELINE_ROWS + 5)]
    view = build(_bundle(tmp_path, rows), tmp_path)
    (timeline,) = view.stages[0].timelines
    assert len(timeline.rows) == TIMELINE_ROWS and timeline.left_out == 5
    md = markdown.render(_bundle(tmp_path / "b", rows), tmp_path / "b")
    assert "5 more rows in the stage's evidence (stages/isolation/timeline.json)." in md


def test_a_stage_without_them_shows_neither(tmp_path):
    folder = tmp_path / "stages" / "isolation"
    predicate = _bundle(tmp_path, [ROW])
    (folder / "records.json").write_text(
        json.dumps({"stage": "isolation", "status": "ran", "checks": [], "metrics": {}, "evidence": []})
    )
    md = markdown.render(predicate, tmp_path)
    assert "Not run inside stages" not in md and "Fallback timeline" not in md


def test_cells_a_partial_implementation_declined_show_as_not_run_with_their_reason(tmp_path):
    bundle = _bundle(tmp_path, [ROW])
    records_file = tmp_path / "stages" / "isolation" / "records.json"
    records = json.loads(records_file.read_text())
    cell = {"implementation": "specialized", "cell": "kda_o_proj/tp8/b32", "reason": "serves 1..16 rows"}
    records["metrics"]["declined"] = [cell]
    records_file.write_text(json.dumps(records))
    md = markdown.render(bundle, tmp_path)
    assert "- isolation: **specialized kda_o_proj/tp8/b32 (declined)**: serves 1..16 rows" in md


def test_a_dirty_run_names_the_git_tree_of_its_files(tmp_path):
    bundle = _bundle(tmp_path, [ROW])
    bundle["git"] = {"commit": "abc", "dirty": True, "tree": "7955e1629b2a26322d83178fbafe5c6ae9a13486"}
    assert "(dirty tree; its files are git tree 7955e1629b2a26322d83178fbafe5c6ae9a13486)" in markdown.render(
        bundle, tmp_path
    )
    bundle["git"] = {"commit": "abc", "dirty": True}  # a bundle from before the tree id
    assert "Commit `abc` (dirty tree) ·" in markdown.render(bundle, tmp_path / "old")
