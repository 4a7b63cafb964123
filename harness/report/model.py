"""What both report formats show, gathered once from a bundle's predicate and records."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.stages import stage_names

ICONS = {"PASSED": "✅", "FAILED": "❌", "NOT_RUN": "⏸️", "ERROR": "💥", "INCOMPLETE": "⚠️"}
# A stage shows a figure by listing the file as evidence and naming it in its metrics' "figures" list
# ({"path", "caption"}); only these types, which every browser shows inline, are embedded.
IMAGE_TYPES = {".png": "image/png", ".svg": "image/svg+xml"}
# A stage shows a dispatch timeline by naming it in its metrics' "timelines" list ({"title", "rows"}), each row the
# fields below (harness/isolation/runtime.py makes them from a dispatch ledger); a long one is cut in the report
# and kept whole in the stage's evidence.
TIMELINE_COLUMNS = ("step", "cell", "mode", "event", "path", "where", "reason", "wrote")
TIMELINE_ROWS = 40


@dataclass
class FigureView:
    path: str  # bundle-relative
    caption: str
    media_type: str
    data: bytes | None  # None when the file is missing from the bundle


@dataclass
class TimelineView:
    title: str
    rows: list[dict[str, Any]]  # at most TIMELINE_ROWS
    left_out: int  # rows not shown


@dataclass
class StageView:
    stage: str
    verdict: str
    reason: str
    required: bool
    failed_checks: list[dict[str, Any]] = field(default_factory=list)
    checks: int = 0
    metrics: dict[str, Any] = field(default_factory=dict)
    evidence: list[str] = field(default_factory=list)
    figures: list[FigureView] = field(default_factory=list)
    # Checks the stage could not run here although it ran (metrics "not_run": [{"name", "reason"}]): never passes.
    not_run_items: list[dict[str, str]] = field(default_factory=list)
    timelines: list[TimelineView] = field(default_factory=list)


@dataclass
class ReportView:
    config: str
    subject: str
    tier: str
    outcome: str
    outcome_reason: str
    commit: str
    dirty: bool
    gpu: str
    started: str
    stages: list[StageView]
    not_selected: list[str]
    bundle_id: str | None
    signer: str | None
    tree: str | None = None  # the files' git tree id (bundles from before it have none)

    @property
    def dirty_note(self) -> str:
        """After the commit: nothing for a clean tree; for a dirty one, the files' tree id, which
        `git rev-parse <commit>^{tree}` matches for the commit holding the same files."""
        if not self.dirty:
            return ""
        return f" (dirty tree; its files are git tree {self.tree})" if self.tree else " (dirty tree)"

    @property
    def not_run(self) -> list[StageView]:
        return [s for s in self.stages if s.verdict in ("NOT_RUN", "ERROR")]


def _records(bundle_dir: Path, stage: str) -> dict[str, Any]:
    path = bundle_dir / "stages" / stage / "records.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _figures(bundle_dir: Path, rec: dict[str, Any]) -> list[FigureView]:
    evidence = set(rec.get("evidence", []))
    out = []
    for fig in rec.get("metrics", {}).get("figures", []):
        path = fig.get("path", "")
        media = IMAGE_TYPES.get(Path(path).suffix.lower())
        if path not in evidence or media is None:
            continue  # only the stage's own evidence, of a type a page can show
        file = bundle_dir / path
        data = file.read_bytes() if file.is_file() else None
        out.append(FigureView(path, str(fig.get("caption", "")), media, data))
    return out


def _not_run_items(metrics: dict[str, Any]) -> list[dict[str, str]]:
    """What exists but did not run: whole implementations (`not_run`) and the cells a partial implementation
    declined (`declined`), each with its reason."""
    items = metrics.get("not_run", [])
    declined = metrics.get("declined", [])
    out = [
        {"name": str(i.get("name", "?")), "reason": str(i.get("reason", "no reason given"))}
        for i in (items if isinstance(items, list) else [])
        if isinstance(i, dict)
    ]
    return out + [
        {"name": f"{i.get('implementation', '?')} {i.get('cell', '?')} (declined)", "reason": str(i.get("reason", ""))}
        for i in (declined if isinstance(declined, list) else [])
        if isinstance(i, dict)
    ]


def _timelines(metrics: dict[str, Any]) -> list[TimelineView]:
    out = []
    for t in metrics.get("timelines", []) if isinstance(metrics.get("timelines"), list) else []:
        rows = [r for r in t.get("rows", []) if isinstance(r, dict)]
        shown = [{c: r.get(c, "") for c in TIMELINE_COLUMNS} for r in rows[:TIMELINE_ROWS]]
        out.append(TimelineView(str(t.get("title", "Timeline")), shown, len(rows) - len(shown)))
    return out


def build(
    predicate: dict[str, Any], bundle_dir: Path, bundle_id: str | None = None, signer: str | None = None
) -> ReportView:
    required = set(predicate["required"])
    stages = []
    for v in predicate["verdicts"]:
        rec = _records(bundle_dir, v["stage"])
        checks = rec.get("checks", [])
        stages.append(
            StageView(
                stage=v["stage"],
                verdict=v["verdict"],
                reason=v["reason"],
                required=v["stage"] in required,
                failed_checks=[c for c in checks if not c.get("passed")],
                checks=len(checks),
                metrics=rec.get("metrics", {}),
                evidence=rec.get("evidence", []),
                figures=_figures(bundle_dir, rec),
                not_run_items=_not_run_items(rec.get("metrics", {})),
                timelines=_timelines(rec.get("metrics", {})),
            )
        )
    env = predicate["environment"]
    gpu = env["gpu"]
    git = predicate["git"]
    return ReportView(
        config=predicate["config"]["name"],
        subject=predicate["subject"].get("subject", "?"),
        tier=predicate["tier"],
        outcome=predicate["outcome"]["outcome"],
        outcome_reason=predicate["outcome"]["reason"],
        commit=(git["commit"] or "not a git checkout")[:12],
        dirty=git["dirty"],
        tree=git.get("tree"),
        gpu=f"{gpu['count']}x {gpu['names'][0]}" if gpu["count"] else "no GPU",
        started=predicate["started"],
        stages=stages,
        not_selected=[s for s in stage_names() if s not in predicate["stages_selected"]],
        bundle_id=bundle_id,
        signer=signer,
    )
