"""Principle 3b: model evals on the optimized path, paired against the baseline arm.

Both arms serve the same weights; the real lm-eval runs the k3gate task YAMLs (evals/) against each arm's chat
endpoint at every configured concurrency (small-batch cells), keeping `--log_samples`. Each task gets a paired
non-inferiority decision with the margin from evals/evals.toml, and a teacher-forced comparison judges the
per-step decode distributions of the two arms on identical token sequences, long context included (its limits
and their reasons go into the metrics). The candidate's decode steps are matched against the plugin's
proof-of-path counts.

Full datasets (datasets = "dir") come from the first of: $K3GATE_EVAL_DATA, the config's vllm.evals.dataset_dir,
and the cache folder $XDG_CACHE_HOME/k3gate/eval-data (~/.cache/k3gate/eval-data without XDG_CACHE_HOME).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from evals.tasks import k3gate_utils
from harness.runners import arms, eval_tasks, lmeval, paired, pathproof, session, teacher_forcing
from harness.runners.eval_tasks import TaskSpec
from harness.runners.findings import Findings
from harness.runners.interpreter import VllmUnavailable, find
from harness.runners.server import ServerError
from harness.stages.base import StageContext
from harness.subjects import load_subject
from harness.verdicts import StageRecords

STAGE = "evals"
DATA_ENV = "K3GATE_EVAL_DATA"  # a folder with <dataset_file> per task; overrides [vllm.evals] dataset_dir
FORCING_SEED = 97


def cache_dir() -> Path:
    """Where datasets are looked for when neither K3GATE_EVAL_DATA nor vllm.evals.dataset_dir names a folder."""
    root = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(root) if os.path.isabs(root) else Path.home() / ".cache"  # the XDG spec ignores a relative path
    return base / "k3gate" / "eval-data"


def dataset_folder(configured: str | None) -> tuple[Path, str]:
    """The folder the full datasets are read from, and what named it."""
    if env := os.environ.get(DATA_ENV):
        return Path(env), DATA_ENV
    if configured:
        return Path(configured), "vllm.evals.dataset_dir"
    return cache_dir(), "the cache folder"


@dataclass
class ArmData:
    runs: dict[int, lmeval.LmEvalRun] = field(default_factory=dict)
    forced: list[teacher_forcing.Forced] = field(default_factory=list)
    paths: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True)
class Plan:
    python: str
    specs: list[TaskSpec]
    rows: dict[str, list[dict[str, Any]]]
    source: str  # "fixtures" or "dir"
    concurrency: list[int]
    max_gen_toks: int | None
    limit: int | None
    forcing_prompts: int
    forcing_tokens: int
    max_model_len: int


@dataclass(frozen=True)
class EvalsStage:
    name: str = STAGE
    description: str = "Principle 3b: model evals on the optimized path, paired against baseline"
    needs_hardware: bool = True
    overrides: arms.ArmOverrides | None = None  # red-team runs only
    provider: session.ArmProvider | None = None  # tests hand in already-running servers

    def run(self, ctx: StageContext) -> StageRecords:
        vllm = ctx.config.data.get("vllm")
        if vllm is None:
            return StageRecords.not_run(
                STAGE,
                f"subject {ctx.config.subject} runs in process: model evals need a vLLM server (a vllm table)",
            )
        findings = Findings(STAGE)
        stage_dir = ctx.stage_dir(STAGE)
        try:
            python = find()
        except VllmUnavailable as exc:
            return StageRecords.not_run(STAGE, str(exc))
        plan, problem = _plan(vllm, python.path)
        if plan is None:
            return StageRecords.not_run(STAGE, problem)
        tf = eval_tasks.evals_data()["teacher_forcing"]
        findings.metrics.update(
            {
                "vllm": python.vllm_version,
                "lm_eval": python.lm_eval_version,
                "datasets": plan.source,
                "tasks": [s.name for s in plan.specs],
                "concurrency": plan.concurrency,
                # Each limit with the reason for its number (CPU-calibrated placeholders today): read a PASS with it.
                "teacher_forcing_limits": teacher_forcing.limits_record(tf),
            }
        )
        if plan.source != "fixtures":
            # What named the folder, not its path: the bundle is shared, the user's folder layout is theirs.
            findings.metrics["dataset_source"] = dataset_folder(vllm.get("evals", {}).get("dataset_dir"))[1]
        if note := load_subject(ctx.config.subject).describe().get("note"):
            findings.metrics["subject_note"] = note
        provider = self.provider
        if provider is None:
            model_path = arms.resolve_model(vllm["model"], python.path)
            provider = session.config_provider(vllm, python.path, model_path, stage_dir, self.overrides)
        decisions: dict[str, Any] = {}
        try:
            for dep in arms.deployments(ctx.config.data):
                hw = ctx.config.hardware
                # Both arms at once when they fit side by side (CPU, or twice the GPUs); else one after the other.
                together = hw["gpu"] == "none" or hw["gpu_count"] >= 2 * dep.tp
                data = _measure_deployment(ctx, provider, dep, together, plan, stage_dir, findings, tf)
                decisions[dep.label()] = _decide(dep, data, plan, findings, tf)
        except ServerError as exc:
            return StageRecords.error(STAGE, str(exc), _logs(ctx, stage_dir))
        except lmeval.LmEvalFailed as exc:
            return StageRecords.error(STAGE, str(exc), _logs(ctx, stage_dir))
        path, rel = ctx.evidence_path(STAGE, "decisions.json")
        path.write_text(json.dumps(decisions, indent=2, sort_keys=True, default=str) + "\n")
        findings.evidence += [rel, *_logs(ctx, stage_dir), *_samples(ctx, stage_dir)]
        return findings.records()


def _logs(ctx: StageContext, stage_dir: Path) -> list[str]:
    return sorted(str(p.relative_to(ctx.bundle_dir)) for p in [*stage_dir.rglob("*.log")])


def _samples(ctx: StageContext, stage_dir: Path) -> list[str]:
    found = [*stage_dir.rglob("samples_*.jsonl"), *stage_dir.rglob("results_*.json"), *stage_dir.glob("tasks/*")]
    found += [*stage_dir.glob("forced-*.json")]
    return sorted(str(p.relative_to(ctx.bundle_dir)) for p in found if p.is_file())


def _plan(vllm: dict[str, Any], python: str) -> tuple[Plan | None, str]:
    ev = vllm.get("evals", {})
    specs_all = eval_tasks.task_specs()
    specs = [specs_all[name] for name in ev.get("tasks", list(specs_all))]
    source = ev.get("datasets", "dir")
    rows: dict[str, list[dict[str, Any]]] = {}
    if source == "fixtures":
        rows = {s.name: eval_tasks.fixture_rows(s) for s in specs}
    else:
        folder, named_by = dataset_folder(ev.get("dataset_dir"))
        missing = [s.dataset_file for s in specs if not (folder / s.dataset_file).is_file()]
        if missing:
            configured = ev.get("dataset_dir")
            return None, (
                f"eval datasets missing in {folder} (named by {named_by}): {', '.join(missing)} — the stage reads "
                f"the first folder named by {DATA_ENV} ({os.environ.get(DATA_ENV) or 'not set'}), "
                f"vllm.evals.dataset_dir ({configured or 'not set'}) or the cache folder {cache_dir()}; put each "
                "task's test split there as JSON lines (or set datasets = 'fixtures' for a plumbing run)"
            )
        rows = {s.name: eval_tasks.select_rows(s, eval_tasks.read_rows(folder / s.dataset_file)) for s in specs}
    tf = eval_tasks.evals_data()["teacher_forcing"]
    plan = Plan(
        python=python,
        specs=specs,
        rows=rows,
        source=source,
        concurrency=list(ev.get("concurrency", [1])),
        max_gen_toks=ev.get("max_gen_toks"),
        limit=ev.get("limit"),
        forcing_prompts=ev.get("teacher_forcing_prompts", tf["prompts"]),
        forcing_tokens=ev.get("teacher_forcing_tokens", tf["tokens_per_prompt"]),
        max_model_len=vllm["max_model_len"],
    )
    return plan, ""


def _forcing_prompts(plan: Plan) -> list[str]:
    """Prompts for the teacher-forced comparison: rows round-robin over tasks, long-context (MRCR) first."""
    order = sorted(plan.specs, key=lambda s: s.name != "mrcr_v2")
    queues = [[k3gate_utils.forcing_prompt(s.name, r) for r in plan.rows[s.name]] for s in order]
    out: list[str] = []
    while len(out) < plan.forcing_prompts and any(queues):
        for q in queues:
            if q and len(out) < plan.forcing_prompts:
                out.append(q.pop(0))
    return out


def _measure_deployment(
    ctx: StageContext,
    provider: session.ArmProvider,
    dep: arms.Deployment,
    together: bool,
    plan: Plan,
    stage_dir: Path,
    findings: Findings,
    tf: dict[str, Any],
) -> dict[str, ArmData]:
    groups = [(arms.BASELINE, arms.CANDIDATE)] if together else [(arms.BASELINE,), (arms.CANDIDATE,)]
    data: dict[str, ArmData] = {}
    targets: list[list[int]] = []
    prompts: list[str] = []
    for group in groups:
        ctx.progress(f"{dep.label()}: starting {' and '.join(group)}", None)
        with provider(group, dep) as running:
            for name in (arms.BASELINE, arms.CANDIDATE):
                if name not in running:
                    continue
                arm = running[name]
                findings.metrics[f"startup_s_{name}_{dep.label()}"] = arm.server.startup_s
                if name == arms.BASELINE:
                    _fit_rows(arm, plan, findings)
                    for spec in plan.specs:
                        eval_tasks.write_task(spec, plan.rows[spec.name], stage_dir / "tasks")
                    prompts = [p for p in _forcing_prompts(plan) if _fits(arm, p, plan)]
                    targets = teacher_forcing.sample_targets(
                        arm.client, prompts, plan.forcing_tokens, tf["temperature"], FORCING_SEED
                    )
                data[name] = _measure_arm(ctx, arm, dep, plan, stage_dir, findings, prompts, targets, tf)
    return data


def _generation_budget(spec: TaskSpec, plan: Plan) -> int:
    if plan.max_gen_toks:
        return plan.max_gen_toks
    found = re.search(r"max_gen_toks:\s*(\d+)", (eval_tasks.evals_root() / spec.yaml).read_text())
    return int(found.group(1)) if found else 256


def _fit_rows(arm: session.RunningArm, plan: Plan, findings: Findings) -> None:
    """Keep the rows whose prompt and generation budget fit max_model_len (and the task's max_prompt_tokens).

    A long-context task (MRCR) holds rows far longer than a deployment serves; sending them would only produce
    HTTP 400s. The rows dropped are counted in the metrics, and the kept ones are what the paired decision and
    its minimum item count see.
    """
    for spec in plan.specs:
        budget = _generation_budget(spec, plan)
        limit = plan.max_model_len - budget - 64  # 64: chat-template tokens around the prompt
        if spec.max_prompt_tokens:
            limit = min(limit, spec.max_prompt_tokens)
        kept = []
        for row in plan.rows[spec.name]:
            text = k3gate_utils.forcing_prompt(spec.name, row)
            # A token rarely spans more than 16 characters: a text that long cannot fit, skip the round trip.
            if len(text) <= 16 * limit and len(arm.client.tokenize(text)) <= limit:
                kept.append(row)
        if dropped := len(plan.rows[spec.name]) - len(kept):
            findings.metrics[f"{spec.name}_rows_dropped_too_long"] = dropped
        plan.rows[spec.name] = kept


def _fits(arm: session.RunningArm, prompt: str, plan: Plan) -> bool:
    return len(arm.client.tokenize(prompt)) + plan.forcing_tokens + 64 <= plan.max_model_len


def _measure_arm(
    ctx: StageContext,
    arm: session.RunningArm,
    dep: arms.Deployment,
    plan: Plan,
    stage_dir: Path,
    findings: Findings,
    prompts: list[str],
    targets: list[list[int]],
    tf: dict[str, Any],
) -> ArmData:
    out = ArmData()
    check, why = session.backend_check(arm)
    if check is not None:
        findings.checks.append(check)
    if why:
        findings.cannot(why)
    floor = eval_tasks.evals_data()["coverage"]["floor"]
    for c in plan.concurrency:
        ctx.progress(f"{dep.label()}: lm-eval on {arm.name}, concurrency {c}", None)
        before = arm.snapshot()
        try:
            out.runs[c] = lmeval.run(
                arm.name,
                plan.python,
                arm.server.base_url,
                arm.spec.served_model_name,
                plan.specs,
                stage_dir / "tasks",
                stage_dir / "lm_eval" / dep.label() / arm.name / f"c{c}",
                c,
                plan.max_gen_toks,
                plan.limit,
            )
        except lmeval.LmEvalFailed:
            arm.alive_or_raise(f"lm-eval at concurrency {c}")
            raise
        _path(arm, before, f"{dep.label()} lm-eval c={c}", out, findings, floor)
    if not arm.spec.logits_processors:
        findings.cannot("teacher-forced comparison: the servers run without the forcing logits processor")
        return out
    ctx.progress(f"{dep.label()}: teacher-forced decode on {arm.name}", None)
    before = arm.snapshot()
    out.forced = [
        teacher_forcing.force(arm.client, i, p, t, tf["top_k"])
        for i, (p, t) in enumerate(zip(prompts, targets, strict=True))
    ]
    _path(arm, before, f"{dep.label()} teacher forcing", out, findings, floor)
    dump = stage_dir / f"forced-{arm.name}-{dep.label()}.json"
    dump.write_text(json.dumps([f.to_json() for f in out.forced]) + "\n")
    return out


def _path(
    arm: session.RunningArm, before: dict[str, Any], label: str, out: ArmData, findings: Findings, floor: float
) -> None:
    import time

    done = time.time()
    path = pathproof.cell_path(before, pathproof.settle(arm.path_dir, done), done)
    out.paths[label] = path.to_json()
    if arm.name != arms.CANDIDATE:
        return  # the baseline's path is recorded, not judged
    cov, why = pathproof.coverage_check(f"{label}", path, floor)
    if cov is not None:
        findings.checks.append(cov)
    if why:
        findings.cannot(why if path.probe is not None or path.stale else f"candidate: {path.probe_note}")


def _decide(
    dep: arms.Deployment, data: dict[str, ArmData], plan: Plan, findings: Findings, tf: dict[str, Any]
) -> dict[str, Any]:
    decision = eval_tasks.evals_data()["decision"]
    base, cand = data[arms.BASELINE], data[arms.CANDIDATE]
    out: dict[str, Any] = {"paths": {arms.BASELINE: base.paths, arms.CANDIDATE: cand.paths}, "tasks": {}}
    for c in plan.concurrency:
        for spec in plan.specs:
            b = lmeval.items(base.runs[c].samples[spec.name], spec)
            k = lmeval.items(cand.runs[c].samples[spec.name], spec)
            result = paired.compare(spec, b, k, decision)
            expected = len(plan.rows[spec.name]) if plan.source == "fixtures" else spec.min_items
            if plan.limit:
                expected = min(expected, plan.limit)
            findings.checks += paired.checks(result, f"{dep.label()} {spec.name} c={c}", expected)
            out["tasks"][f"{spec.name} c={c}"] = result.to_json()
            findings.metrics[f"{dep.label()} {spec.name} c={c}"] = {
                "baseline": result.baseline_mean,
                "candidate": result.candidate_mean,
                "n": result.n,
            }
    if base.forced or cand.forced:
        comparison = teacher_forcing.compare(base.forced, cand.forced)
        findings.checks += teacher_forcing.checks(comparison, f"{dep.label()} teacher-forced decode", tf)
        out["teacher_forcing"] = comparison.to_json()
    return out
