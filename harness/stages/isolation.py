"""The isolation stage (principle 1): a static half and a runtime half, one verdict.

Static: does the change stay in the model's area, break no co-change rule, and keep its code from reaching into the
rest of the process? The change judged is base..HEAD of the repository the subject's code scope names: this
repository for a subject whose code lives here, or an external checkout (e.g. vLLM) named by an environment
variable. Only committed changes are judged; uncommitted paths are counted in the metrics so a reviewer sees them.

Runtime: the subject's runtime isolation suite (`subject.isolation_suite(config)`, protocol in
harness/isolation/runtime.py) runs its executor under the write-set audit and the proof-of-path checks, with line
coverage of the specialized modules measured meanwhile (harness/isolation/coverage.py). Its ledgers and the fallback
timeline go into the bundle. A subject without a runtime suite is judged by the static half alone, and the records
say so; a config whose hardware is absent cannot run the runtime half, so the stage cannot pass (it fails if a half
that ran failed, and is otherwise NOT_RUN with the reason).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.isolation import coverage, gitdiff
from harness.isolation.judge import judge, to_records
from harness.isolation.runtime import NotRun, RuntimeSuite, evidence_files, records_parts
from harness.isolation.scope import CodeScope, NoCodeScope, for_subject
from harness.stages.base import StageContext
from harness.subjects import load_subject
from harness.verdicts import Check, StageRecords

BASE_ENV = "K3GATE_BASE"
# Branches whose merge-base with HEAD is where a change starts, tried in order.
BASE_BRANCHES = ("main", "origin/main")
GATE_ROOT = Path(__file__).resolve().parents[1]


class NotRunnable(Exception):
    """The stage cannot judge anything here; the message says why and what would fix it."""


def find_repo(scope: CodeScope) -> Path:
    folder, why_not = scope.repository_path()
    if why_not:
        raise NotRunnable(f"no repository to judge: {why_not}")
    if folder is None:
        top = gitdiff.toplevel(GATE_ROOT)
        if top is None:
            raise NotRunnable("k3gate is not running from a git checkout, so there is no change to judge")
        return top
    top = gitdiff.toplevel(folder) if folder.is_dir() else None
    if top is None:
        raise NotRunnable(f"{scope.repository_env}={folder} is not a git checkout — point it at a clone")
    return top


def find_base(repo: Path) -> tuple[str, str]:
    if chosen := os.environ.get(BASE_ENV):
        try:
            return gitdiff.commit(repo, chosen, BASE_ENV), f"{BASE_ENV}={chosen}"
        except gitdiff.GitError as exc:
            raise NotRunnable(str(exc)) from None
    for branch in BASE_BRANCHES:
        if base := gitdiff.merge_base(repo, "HEAD", branch):
            return base, f"merge-base of HEAD and {branch}"
    raise NotRunnable(f"no branch {' or '.join(BASE_BRANCHES)} to start the change from — set {BASE_ENV} to its base")


def records_for(
    stage: str, repo: Path, base: str, head: str, scope: CodeScope, ctx: StageContext | None = None
) -> StageRecords:
    """Judge base..head against the scope; with a context, also write the full judgement as evidence."""
    report = judge(repo, base, head, scope)
    evidence: list[str] = []
    if ctx is not None:
        path, rel = ctx.evidence_path(stage, "isolation.json")
        path.write_text(json.dumps(report.to_json(), indent=2, sort_keys=True) + "\n")
        evidence.append(rel)
    return to_records(report, stage, evidence)


@dataclass
class RuntimeHalf:
    """What the runtime half contributes to the stage's records."""

    ran: bool  # the suite ran here
    reason: str = ""  # why it did not (absent suite, absent hardware)
    absent: bool = False  # the subject has no runtime suite at all: the stage is the static half alone
    checks: list[Check] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    evidence: list[str] = field(default_factory=list)

    def summary(self) -> str:
        if not self.ran:
            return f"not run: {self.reason}"
        runs = ", ".join(self.metrics.get("runtime", {}).get("runs", {})) or "no executor"
        items = len(self.metrics.get("not_run", []))
        return f"ran {len(self.checks)} checks (runs: {runs}); {items} items not run here (metrics.not_run says why)"


def runtime_half(stage: str, ctx: StageContext) -> RuntimeHalf:
    """Run the subject's runtime isolation suite, with coverage of its specialized modules, and write the evidence."""
    config = ctx.config
    subject = load_subject(config.subject)
    make = getattr(subject, "isolation_suite", None)
    suite: RuntimeSuite | None = make(config) if make else None
    if suite is None:
        reason = f"subject {config.subject} has no runtime isolation suite in this build; the static half judges alone"
        return RuntimeHalf(False, reason, absent=True, metrics={"not_run": [NotRun("runtime half", reason).to_json()]})
    if missing := ctx.hardware.satisfies(config.hardware["gpu"], config.hardware["gpu_count"]):
        return RuntimeHalf(False, f"config {config.name} {missing}")
    table = getattr(subject, "coverage_scope", lambda: None)()
    scope = coverage.parse(table, f"of subject {config.subject}") if table is not None else None
    ctx.progress("runtime isolation suite", None)
    if scope is None:
        evidence = suite.run(ctx.progress)
        measured = None
    else:
        # Globs are relative to the folder that holds the gate's packages (its repository, or its install).
        with coverage.measure(scope, GATE_ROOT.parent, "the runtime isolation suite") as measured:
            evidence = suite.run(ctx.progress)
    if evidence.unavailable:
        return RuntimeHalf(False, evidence.unavailable)
    checks, metrics = records_parts(evidence)
    written: list[str] = []
    for name, text in evidence_files(evidence).items():
        path, rel = ctx.evidence_path(stage, name)
        path.write_text(text)
        written.append(rel)
    if measured is None:
        metrics["not_run"].append(
            NotRun(coverage.CHECK_NAME, f"subject {config.subject} declares no [isolation.coverage] table").to_json()
        )
    else:
        path, rel = ctx.evidence_path(stage, "coverage.json")
        path.write_text(json.dumps(measured.to_json(), indent=1, sort_keys=True) + "\n")
        written.append(rel)
        metrics["coverage"] = {k: v for k, v in measured.to_json().items() if k != "files"}
        if (check := measured.check()) is not None:
            checks.append(check)
        if (item := measured.not_run_item()) is not None:
            metrics["not_run"].append(item.to_json())
    return RuntimeHalf(True, checks=checks, metrics=metrics, evidence=written)


def combine(stage: str, static: StageRecords, runtime: RuntimeHalf) -> StageRecords:
    """One verdict from both halves: it passes only when every half that exists ran and passed; a failed check of
    either half fails it; otherwise a half that could not run makes it NOT_RUN, naming why."""
    checks = static.checks + runtime.checks
    metrics = {**static.metrics, **runtime.metrics, "runtime_audit": runtime.summary()}
    if static.status != "ran":
        metrics["static"] = {"not_run": static.reason}
    evidence = static.evidence + runtime.evidence
    complete = static.status == "ran" and (runtime.ran or runtime.absent)
    if complete or any(not c.passed for c in checks):
        return StageRecords(stage, "ran", "", checks, metrics, evidence)
    missing = []
    if static.status != "ran":
        missing.append(f"static half: {static.reason}")
    if not (runtime.ran or runtime.absent):
        missing.append(f"runtime half: {runtime.reason}")
    ran = [c for c in checks if c.passed]
    passed = f" (the {len(ran)} checks that ran passed)" if ran else ""
    return StageRecords(stage, "not_run", "; ".join(missing) + passed, checks, metrics, evidence)


@dataclass(frozen=True)
class IsolationStage:
    name: str = "isolation"
    description: str = (
        "Principle 1: blast radius, co-change rules and code hygiene of the change; write sets and proof of path at "
        "run time"
    )
    needs_hardware: bool = False  # the static half runs anywhere; the runtime half checks the config's hardware

    def _static(self, ctx: StageContext) -> StageRecords:
        ctx.progress("finding the change to judge", None)
        try:
            scope = for_subject(ctx.config.subject)
            repo = find_repo(scope)
            base, how = find_base(repo)
        except (NotRunnable, NoCodeScope, gitdiff.GitMissing) as exc:
            return StageRecords.not_run(self.name, str(exc))
        ctx.progress(f"judging {base[:12]}..HEAD", None)
        records = records_for(self.name, repo, base, "HEAD", scope, ctx)
        records.metrics["base_chosen_by"] = how
        records.metrics["uncommitted_paths_not_judged"] = len(gitdiff.uncommitted(repo))
        return records

    def run(self, ctx: StageContext) -> StageRecords:
        return combine(self.name, self._static(ctx), runtime_half(self.name, ctx))
