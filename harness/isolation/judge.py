"""The static isolation judgement of one change (base..head of a repository), and the records it becomes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.isolation import gitdiff
from harness.isolation.classify import PASSING_LABELS, Area, CoChangeBreach, PathVerdict, classify, co_change_breaches
from harness.isolation.hygiene import RULES, Finding, check_source
from harness.isolation.scope import CodeScope
from harness.verdicts import Check, StageRecords

# Said in every static judgement, so no reader takes the static checks for the whole of isolation; the isolation
# stage of a run replaces it with what its runtime half ran (harness/stages/isolation.py).
STATIC_ONLY = (
    "static checks only (diff classification, co-change rules, code hygiene): the runtime write-set audit and "
    "proof of path run in the isolation stage of `k3gate run`, through the subject's runtime isolation suite"
)
DETAIL_ITEMS = 20  # findings named in a check's detail; the evidence file has all of them


@dataclass(frozen=True)
class StaticReport:
    base: str  # commit hashes
    head: str
    scope: CodeScope
    paths: list[PathVerdict]
    breaches: list[CoChangeBreach]
    findings: list[Finding]
    python_checked: list[str]

    @property
    def failing_findings(self) -> list[Finding]:
        return [f for f in self.findings if not f.accepted]

    def to_json(self) -> dict[str, Any]:
        return {
            "base": self.base,
            "head": self.head,
            "scope": self.scope.source,
            "paths": [p.to_json() for p in self.paths],
            "co_change": [b.to_json() for b in self.breaches],
            "python_checked": self.python_checked,
            "findings": [f.to_json() for f in self.findings],
        }


def _python_to_check(paths: list[PathVerdict]) -> list[str]:
    """Changed model files that exist at head and are Python (the new side of a rename, never a deletion)."""
    return sorted({p.path for p in paths if p.area is Area.MODEL and p.side != "from" and p.path.endswith(".py")})


def judge(repo: Path, base: str, head: str, scope: CodeScope) -> StaticReport:
    base_commit = gitdiff.commit(repo, base, "--base")
    head_commit = gitdiff.commit(repo, head, "--head")
    changes = gitdiff.changes(repo, base_commit, head_commit)
    deleted = {c.path for c in changes if not c.exists_at_head}
    paths = classify(changes, scope)
    python = [p for p in _python_to_check(paths) if p not in deleted]
    findings: list[Finding] = []
    for path, blob in gitdiff.show_many(repo, head_commit, python).items():
        findings += check_source(path, blob.decode("utf-8", "replace"), scope)
    return StaticReport(base_commit, head_commit, scope, paths, co_change_breaches(changes, scope), findings, python)


def _listed(items: list[str]) -> str:
    more = f"; and {len(items) - DETAIL_ITEMS} more (see the evidence)" if len(items) > DETAIL_ITEMS else ""
    return "; ".join(items[:DETAIL_ITEMS]) + more


def checks(report: StaticReport) -> list[Check]:
    """One check per changed path, one per co-change rule, and one per hygiene rule (or, where a rule found
    something, one per file, so the verdict's reason names the file and lines)."""
    out: list[Check] = []
    for p in report.paths:
        side = f" ({p.side} a rename)" if p.side else ""
        out.append(Check(f"path {p.path}{side}", p.label, "in", PASSING_LABELS, p.reason))
    if not report.paths:
        out.append(Check("changed paths read from git", 0, ">=", 0, "base and head have the same tree"))
    for rule in report.scope.co_change:
        breach = next((b for b in report.breaches if b.rule is rule), None)
        if breach is None:
            out.append(Check(f"co-change rule: {rule.name}", 0, "==", 0, rule.why))
            continue
        more = f" and {len(breach.forbidden) - 1} more" if len(breach.forbidden) > 1 else ""
        name = f"co-change rule: {rule.name}: {breach.forbidden[0]}{more}"
        out.append(Check(name, len(breach.forbidden), "==", 0, breach.describe()))
    failing = report.failing_findings
    for rule, meaning in RULES.items():
        by_file: dict[str, list[Finding]] = {}
        for f in failing:
            if f.rule == rule:
                by_file.setdefault(f.path, []).append(f)
        if not by_file:
            out.append(Check(f"hygiene {rule}", 0, "==", 0, meaning))
        for path, found in by_file.items():
            lines = ",".join(str(f.line) for f in found)
            out.append(
                Check(f"hygiene {rule} at {path}:{lines}", len(found), "==", 0, _listed([f.message for f in found]))
            )
    return out


def metrics(report: StaticReport) -> dict[str, Any]:
    by_area: dict[str, int] = {}
    for p in report.paths:
        by_area[p.label] = by_area.get(p.label, 0) + 1
    return {
        "base": report.base,
        "head": report.head,
        "scope": report.scope.source,
        "paths_changed": len(report.paths),
        "paths_by_area": dict(sorted(by_area.items())),
        "python_files_checked": len(report.python_checked),
        "findings": {rule: sum(f.rule == rule for f in report.failing_findings) for rule in RULES},
        "declared_findings": sum(bool(f.accepted) for f in report.findings),
        "runtime_audit": STATIC_ONLY,
    }


def to_records(report: StaticReport, stage: str, evidence: list[str] | None = None) -> StageRecords:
    return StageRecords(stage=stage, checks=checks(report), metrics=metrics(report), evidence=list(evidence or []))
