"""The isolation stage (principle 1), static part: does the change stay in the model's area, break no co-change
rule, and keep its code from reaching into the rest of the process?

The change judged is base..HEAD of the repository the subject's code scope names: this repository for a subject
whose code lives here, or an external checkout (e.g. vLLM) named by an environment variable. Only committed
changes are judged; uncommitted paths are counted in the metrics so a reviewer sees them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from harness.isolation import gitdiff
from harness.isolation.judge import RUNTIME_NOT_BUILT, judge, to_records
from harness.isolation.scope import CodeScope, NoCodeScope, for_subject
from harness.stages.base import StageContext
from harness.verdicts import StageRecords

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


@dataclass(frozen=True)
class IsolationStage:
    name: str = "isolation"
    description: str = "Principle 1 (static): blast radius of the change, co-change rules, code hygiene"
    needs_hardware: bool = False

    def run(self, ctx: StageContext) -> StageRecords:
        ctx.progress("finding the change to judge", None)
        try:
            scope = for_subject(ctx.config.subject)
            repo = find_repo(scope)
            base, how = find_base(repo)
        except (NotRunnable, NoCodeScope, gitdiff.GitMissing) as exc:
            return StageRecords(self.name, "not_run", str(exc), metrics={"runtime_audit": RUNTIME_NOT_BUILT})
        ctx.progress(f"judging {base[:12]}..HEAD", None)
        records = records_for(self.name, repo, base, "HEAD", scope, ctx)
        records.metrics["base_chosen_by"] = how
        records.metrics["uncommitted_paths_not_judged"] = len(gitdiff.uncommitted(repo))
        return records
