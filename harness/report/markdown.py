"""Markdown report, sized for a pull-request comment."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.report.model import ICONS, TIMELINE_COLUMNS, ReportView, build


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _plain(text: Any) -> str:
    """Text that quotes globs (`**`), which markdown would read as emphasis."""
    return _cell(text).replace("*", r"\*")


def render_view(view: ReportView) -> str:
    lines = [
        f"## k3gate {ICONS.get(view.outcome, '')} {view.outcome}: `{view.config}` ({view.subject}, tier {view.tier})",
        "",
        f"**{view.outcome_reason}**",
        "",
        f"Commit `{view.commit}`{view.dirty_note} · {view.gpu} · started {view.started}",
    ]
    if view.bundle_id:
        lines.append(f"Bundle `{view.bundle_id}` · {view.signer or 'signature not checked'}")
    lines += ["", "| stage | required | verdict | reason |", "|---|---|---|---|"]
    for s in view.stages:
        lines.append(
            f"| {s.stage} | {'yes' if s.required else 'no'} | {ICONS.get(s.verdict, '')} {s.verdict} "
            f"| {_cell(s.reason)} |"
        )
    if view.not_run:
        lines += ["", "### Did not run", ""]
        lines += [f"- **{s.stage}** ({s.verdict}): {s.reason}" for s in view.not_run]
    items = [(s.stage, i) for s in view.stages for i in s.not_run_items]
    if items:
        lines += ["", "### Not run inside stages (never counted as passed)", ""]
        lines += [f"- {stage}: **{_plain(i['name'])}**: {_plain(i['reason'])}" for stage, i in items]
    if view.not_selected:
        lines += ["", f"Not selected for this run (`--stages`): {', '.join(view.not_selected)}."]
    for s in view.stages:
        for t in s.timelines:
            lines += ["", f"### {s.stage}: {_cell(t.title)}", ""]
            lines += ["| " + " | ".join(TIMELINE_COLUMNS) + " |", "|" + "---|" * len(TIMELINE_COLUMNS)]
            lines += ["| " + " | ".join(_cell(r[c]) for c in TIMELINE_COLUMNS) + " |" for r in t.rows]
            if t.left_out:
                lines.append(f"\n{t.left_out} more rows in the stage's evidence (stages/{s.stage}/timeline.json).")
    figures = [(s.stage, f) for s in view.stages for f in s.figures]
    if figures:
        lines += ["", "### Figures", ""]
        # report.md sits in the bundle's report/ folder, next to stages/.
        for stage, f in figures:
            lines += [f"![{stage}: {Path(f.path).name}](../{f.path})", "", f"*{_cell(f.caption)}*", ""]
    failing = [s for s in view.stages if s.failed_checks]
    if failing:
        lines += ["", "### Failed checks", ""]
        for s in failing:
            for c in s.failed_checks:
                detail = f" — {c['detail']}" if c.get("detail") else ""
                lines.append(f"- {s.stage}: {c['name']}: `{c['value']!r}` is not {c['op']} `{c['limit']!r}`{detail}")
    return "\n".join(lines) + "\n"


def render(predicate: dict[str, Any], bundle_dir: Path, bundle_id: str | None = None, signer: str | None = None) -> str:
    return render_view(build(predicate, bundle_dir, bundle_id, signer))
