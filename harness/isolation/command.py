"""`k3gate isolation`: judge one change (base..head of a git repository) against a code scope, outside a run."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from rich.markup import escape

from harness.isolation import gitdiff, scope
from harness.isolation.judge import StaticReport, judge, to_records
from harness.verdicts import OUTCOME_EXIT, StageRecords, derive_outcome, derive_verdict

STAGE = "isolation"


def _print_report(report: StaticReport, verdict_line: str, verbose: bool) -> None:
    from harness.cli import err

    passing = [p for p in report.paths if p.ok]
    failing = [p for p in report.paths if not p.ok]
    err.print(f"isolation {report.base[:12]}..{report.head[:12]} against the scope {report.scope.source}")
    counts = ", ".join(f"{n} {label}" for label, n in sorted(Counter(p.label for p in passing).items()))
    err.print(f"  {len(report.paths)} changed paths; within the scope: {counts or 'none'}")
    for p in failing:
        side = f" ({p.side} a rename)" if p.side else ""
        err.print(f"  [red]FAIL[/] {escape(p.path)}{side} ({p.label}): {escape(p.reason)}")
    for breach in report.breaches:
        err.print(f"  [red]FAIL[/] co-change rule {escape(breach.rule.name)!r}: {escape(breach.describe())}")
    err.print(f"  {len(report.python_checked)} model Python files checked for hygiene")
    declared = [f for f in report.findings if f.accepted]
    for finding in report.findings if verbose else report.failing_findings:
        mark = "[green]declared[/]" if finding.accepted else "[red]FAIL[/]"
        err.print(f"  {mark} {escape(finding.text())}")
    if declared and not verbose:
        err.print(
            f"  {len(declared)} findings are declared in the scope (env switches, registrations); --verbose lists them"
        )
    err.print(verdict_line)


def cmd_isolation(args: argparse.Namespace) -> int:
    from harness.cli import VERDICT_STYLE, err

    code_scope = scope.load_file(Path(args.scope)) if args.scope else scope.for_subject(args.subject)
    try:
        report = judge(gitdiff.require_repo(Path(args.repo)), args.base, args.head, code_scope)
        records = to_records(report, STAGE)
    except gitdiff.GitMissing as exc:
        report, records = None, StageRecords.not_run(STAGE, str(exc))
    verdict = derive_verdict(records.to_json())
    style = VERDICT_STYLE[verdict.verdict.value]
    line = f"[bold {style}]{verdict.verdict.value}[/]: {escape(verdict.reason)}"
    if report is not None:
        _print_report(report, line, args.verbose)
    else:
        err.print(line)
    if args.json:
        print(json.dumps({"verdict": verdict.to_json(), "records": records.to_json(), **_detail(report)}, indent=2))
    # The same outcome rule as `k3gate run`: FAILED is 1, a check that could not run is incomplete (3).
    return int(OUTCOME_EXIT[derive_outcome([verdict], [STAGE]).outcome])


def _detail(report: StaticReport | None) -> dict[str, object]:
    return {"judgement": report.to_json()} if report is not None else {}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "isolation",
        help="judge a change (git base..head) against a code scope: blast radius, co-change rules, code hygiene",
    )
    p.add_argument("--repo", default=".", help="git checkout holding the change (default: the current folder)")
    p.add_argument("--base", required=True, help="revision the change starts from (branch, tag or commit)")
    p.add_argument("--head", default="HEAD", help="revision the change ends at (default: HEAD)")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--subject", help="judge with this subject's code scope (see harness/subjects.toml)")
    which.add_argument("--scope", help="judge with the [isolation] table of this TOML scope file")
    p.add_argument("--json", action="store_true", help="print the verdict, records and judgement on stdout")
    p.add_argument("--verbose", action="store_true", help="also list the findings the scope declares")
    p.set_defaults(fn=cmd_isolation)
