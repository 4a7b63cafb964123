"""`k3gate redteam`: deliberately broken inputs that each check of the gate must catch.

A case feeds one stage something broken (a kernel that cheats, a change that leaves the model's folder) and
returns that stage's records; the case is caught when the verdict derived from those records is FAILED.
"""

from __future__ import annotations

import argparse
import importlib
import json
import tempfile
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from harness.errors import UsageError
from harness.verdicts import ExitCode, StageRecords, Verdict, derive_verdict


@dataclass(frozen=True)
class RedTeamCase:
    stage: str
    name: str
    description: str  # the bug or cheat the case models
    run: Callable[[Path], StageRecords]  # given a scratch folder, the stage's records for the broken input
    requires: Callable[[], str | None] = lambda: None  # why the case cannot run on this machine, or None


@dataclass(frozen=True)
class CaseResult:
    case: RedTeamCase
    verdict: Verdict
    reason: str

    @property
    def caught(self) -> bool:
        return self.verdict is Verdict.FAILED


def _registry() -> dict[str, list[str]]:
    raw = tomllib.loads(resources.files("harness").joinpath("redteam.toml").read_text())
    return {stage: entry["modules"] for stage, entry in raw.items()}


def cases(stage: str) -> list[RedTeamCase]:
    registry = _registry()
    if stage not in registry:
        raise UsageError(f"--stage {stage!r} has no red team — choose from {', '.join(sorted(registry))}")
    found = [case for module in registry[stage] for case in importlib.import_module(module).CASES]
    for case in found:
        if case.stage != stage:
            raise RuntimeError(f"red-team case {case.name} belongs to {case.stage}, registered under {stage}")
    return found


def run_case(case: RedTeamCase) -> CaseResult:
    missing = case.requires()
    if missing:
        return CaseResult(case, Verdict.NOT_RUN, missing)
    with tempfile.TemporaryDirectory(prefix="k3gate-redteam-") as tmp:
        try:
            records = case.run(Path(tmp))
        except Exception as exc:  # a crash is not a catch: the check must fail, not fall over
            return CaseResult(case, Verdict.ERROR, f"{type(exc).__name__}: {exc}")
    verdict = derive_verdict(records.to_json())
    return CaseResult(case, verdict.verdict, verdict.reason)


def cmd_redteam(args: argparse.Namespace) -> int:
    from harness.cli import err

    selected = cases(args.stage)
    if not selected:
        err.print(f"redteam {args.stage}: no cases are registered in this build, so nothing is proven")
        return int(ExitCode.INCOMPLETE)
    results = [run_case(c) for c in selected]
    for r in results:
        mark = (
            "[green]caught[/]"
            if r.caught
            else "[yellow]not run[/]"
            if r.verdict is Verdict.NOT_RUN
            else "[red]MISSED[/]"
        )
        err.print(f"  {mark} {r.case.name}: {r.case.description} -> {r.verdict.value}: {r.reason}")
    missed = [r for r in results if not r.caught and r.verdict is not Verdict.NOT_RUN]
    not_run = [r for r in results if r.verdict is Verdict.NOT_RUN]
    if args.json:
        print(
            json.dumps(
                [
                    {"case": r.case.name, "verdict": r.verdict.value, "caught": r.caught, "reason": r.reason}
                    for r in results
                ],
                indent=2,
            )
        )
    if missed:
        err.print(f"[red]{len(missed)} of {len(results)} red-team cases were not caught[/]")
        return int(ExitCode.FAILED)
    if not_run:
        err.print(
            f"[yellow]{len(results) - len(not_run)} red-team cases were caught; {len(not_run)} could not run "
            "on this machine, so the red team is incomplete here[/]"
        )
        return int(ExitCode.INCOMPLETE)
    err.print(f"[green]all {len(results)} red-team cases were caught[/] by the {args.stage} stage")
    return int(ExitCode.PASSED)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("redteam", help="run the deliberately broken cases a stage must catch")
    p.add_argument("--stage", required=True, help="stage whose red team to run (isolation, numerics)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_redteam)
