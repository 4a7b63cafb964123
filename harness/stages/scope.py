"""Principle 2 for vLLM subjects: the serving features keep working on the optimized path.

The candidate arm's server is driven through every cell of evals/features.toml (greedy determinism, seeded
reproducibility, temperature/top-k/top-p sampling against the arm's own logprobs, structured output, a request
at the full max_model_len, stop strings, n > 1, logprobs, streaming), and each cell's decode steps are matched
against the proof-of-path counts the vLLM plugin reports. Subjects without a [vllm] table run in process; their
feature checks are not part of this build, so the stage says NOT_RUN for them.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.runners import arms, out_of_scope, pathproof, session
from harness.runners.features import CELLS, CellContext, CellResult, feature_params
from harness.runners.findings import Findings
from harness.runners.interpreter import VllmUnavailable
from harness.runners.server import ServerError, ServerSpec
from harness.stages.base import StageContext
from harness.subjects import load_subject
from harness.verdicts import StageRecords
from harness.vllm_plugin import PATH_DIR_ENV

STAGE = "scope"


@dataclass(frozen=True)
class ScopeStage:
    name: str = STAGE
    description: str = "Principle 2: feature preservation on the optimized path (vLLM subjects)"
    needs_hardware: bool = True
    overrides: arms.ArmOverrides | None = None  # red-team runs only
    provider: session.ArmProvider | None = None  # tests hand in already-running servers

    def run(self, ctx: StageContext) -> StageRecords:
        vllm = ctx.config.data.get("vllm")
        if vllm is None:
            return StageRecords.not_run(
                STAGE,
                f"subject {ctx.config.subject} runs in process; its scope and feature checks are not available in "
                "this build (the feature-preservation cells drive a vLLM server and need the config's vllm table)",
            )
        stage_dir = ctx.stage_dir(STAGE)
        provider = self.provider
        findings = Findings(STAGE)
        if provider is None:
            try:
                python, model_path = arms.locate(vllm)
            except VllmUnavailable as exc:
                return StageRecords.not_run(STAGE, str(exc))
            findings.metrics.update({"vllm": python.vllm_version, "lm_eval": python.lm_eval_version})
            provider = session.config_provider(vllm, python.path, model_path, stage_dir, self.overrides)
        if note := load_subject(ctx.config.subject).describe().get("note"):
            findings.metrics["subject_note"] = note  # e.g. both arms run the same code (no specialized decode)
        cells_out: dict[str, Any] = {}
        try:
            for dep in arms.deployments(ctx.config.data):
                ctx.progress(f"starting the candidate server ({dep.label()})", None)
                with provider((arms.CANDIDATE,), dep) as running:
                    arm = running[arms.CANDIDATE]
                    findings.metrics[f"startup_s_{dep.label()}"] = arm.server.startup_s
                    cells_out[dep.label()] = _run_cells(ctx, arm, vllm, dep, findings)
                    spec = arm.spec
                for case in vllm.get("out_of_scope", []):
                    ctx.progress(f"{dep.label()}: out-of-scope deployment {case['name']}", None)
                    _out_of_scope(spec, case, dep, stage_dir, findings)
        except ServerError as exc:
            logs = sorted(str(p.relative_to(ctx.bundle_dir)) for p in stage_dir.glob("server-*.log"))
            return StageRecords.error(STAGE, str(exc), logs)
        path, rel = ctx.evidence_path(STAGE, "cells.json")
        path.write_text(json.dumps(cells_out, indent=2, sort_keys=True, default=str) + "\n")
        findings.evidence.append(rel)
        findings.evidence += sorted(str(p.relative_to(ctx.bundle_dir)) for p in stage_dir.glob("server-*.log"))
        return findings.records()


def _out_of_scope(
    spec: ServerSpec, case: dict[str, Any], dep: arms.Deployment, stage_dir: Path, findings: Findings
) -> None:
    slug = "".join(ch if ch.isalnum() else "-" for ch in case["name"])
    path_dir = stage_dir / f"path-out-of-scope-{slug}-{dep.label()}"
    env = dict(spec.env) | {PATH_DIR_ENV: str(path_dir.resolve())}
    check, why = out_of_scope.judge(
        dataclasses.replace(spec, env=tuple(sorted(env.items()))),
        case,
        stage_dir / f"server-out-of-scope-{slug}-{dep.label()}.log",
        path_dir,
    )
    if check is not None:
        findings.checks.append(check)
    if why:
        findings.cannot(why)


def _run_cells(
    ctx: StageContext, arm: session.RunningArm, vllm: dict[str, Any], dep: arms.Deployment, findings: Findings
) -> dict[str, Any]:
    params = feature_params()
    floor = params["coverage"]["floor"]
    cell_ctx = CellContext(arm.client, params, vllm["max_model_len"], bool(arm.spec.logits_processors))
    check, why = session.backend_check(arm)
    if check is not None:
        findings.checks.append(check)
    if why:
        findings.cannot(why)
    out: dict[str, Any] = {}
    for i, cell in enumerate(CELLS):
        ctx.progress(f"{dep.label()}: {cell.__name__}", i / len(CELLS))
        before = arm.snapshot()
        result, failed = session.call_cell(arm, f"{dep.label()} {cell.__name__}", lambda c=cell: c(cell_ctx))
        done = time.time()
        if failed is not None:
            findings.checks.append(failed)
            result = CellResult(cell.__name__)
        assert isinstance(result, CellResult)
        path = pathproof.cell_path(before, pathproof.settle(arm.path_dir, done), done)
        label = f"{dep.label()} {result.name}"
        for c in result.checks:
            findings.checks.append(type(c)(f"{dep.label()} {c.name}", c.value, c.op, c.limit, c.detail))
        for reason in result.not_run:
            findings.cannot(f"{dep.label()} {reason}")
        if failed is None:
            cov, why = pathproof.coverage_check(label, path, floor)
            if cov is not None:
                findings.checks.append(cov)
            if why:
                # One reason per deployment is enough when the model has no probe at all.
                findings.cannot(why if path.probe is not None or path.stale else f"{dep.label()}: {path.probe_note}")
        out[result.name] = {"evidence": result.evidence, "path": path.to_json()}
    return out
