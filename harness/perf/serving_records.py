"""What a served perf cell is, how it is judged and how the stage records it (harness/perf/serving.py runs it).

Checks per cell: both arms' rounds gave finite decode ITLs; every request of every timed round produced exactly its
tokens without error (a shorter answer would look faster); the budget on the decode ITL ratio's upper bound, where
the numbers mean something (not on the CPU); and the candidate's decode steps on the specialized path (the vLLM
plugin's proof-of-path counts), or the reason that could not be judged, which keeps the stage from passing.
"""

from __future__ import annotations

import json
import math
import tomllib
from dataclasses import asdict, dataclass
from functools import cache
from importlib import resources
from typing import Any

from harness.perf import plot
from harness.perf.checks import interval_text
from harness.perf.pareto import Point, frontiers_json
from harness.perf.plan import Cell, PerfPlan, Region
from harness.perf.timing import ORDER, PairTiming
from harness.runners import arms, bench, pathproof
from harness.runners.findings import Findings
from harness.stages.base import StageContext
from harness.verdicts import Check, StageRecords

PLOT = "pareto.png"
CELLS = "cells.jsonl"
ARMS = (arms.BASELINE, arms.CANDIDATE)
SEQUENTIAL = "one arm after the other (the GPUs hold one server at a time): drift between the arms is not cancelled"
TTFT = "measured: decode requests' time to first token under the round's concurrent start (their prefill)"


@cache
def serving_data() -> dict[str, Any]:
    return tomllib.loads(resources.files("harness.perf").joinpath("serving.toml").read_text())


@dataclass(frozen=True)
class ServingSettings:
    output_tokens: int


def serving_settings(perf: dict[str, Any]) -> ServingSettings:
    raw = perf.get("serving", {})
    return ServingSettings(int(raw.get("output_tokens", serving_data()["defaults"]["output_tokens"])))


@dataclass
class ServingCell:
    cell: Cell
    region: Region
    deployment: str
    mode: str  # "interleaved" or SEQUENTIAL
    timing: PairTiming
    runs: dict[str, list[bench.BenchRun]]
    metrics: dict[str, bench.ServingMetrics]
    paths: dict[str, pathproof.CellPath]


def cell_checks(
    r: ServingCell, serving: ServingSettings, judge_timing: bool, floor: float
) -> tuple[list[Check], list[str]]:
    """(checks, reasons a check could not run) for one measured cell."""
    cid, t = r.cell.id, r.timing
    checks = [Check(f"{cid}: both arms' benchmark rounds gave finite decode ITLs", not t.broken, "==", True, t.broken)]
    for name, runs in r.runs.items():
        problems = [p for run in runs for p in run.problems()]
        checks.append(
            Check(
                f"{cid} {name}: every request produced its {serving.output_tokens} tokens without error",
                len(problems),
                "==",
                0,
                "; ".join(problems[:2]),
            )
        )
    if judge_timing:
        checks.append(
            Check(
                f"{cid}: decode ITL ratio (candidate/baseline) upper bound within the budget of region "
                f"{r.region.name!r}",
                None if t.interval is None else t.interval.high,
                "<=",
                r.region.limit,
                interval_text(t) + ("" if r.mode == "interleaved" else f"; {r.mode}"),
            )
        )
    cannot = []
    cov, why = pathproof.coverage_check(f"{cid} {arms.CANDIDATE}", r.paths[arms.CANDIDATE], floor)
    if cov is not None:
        checks.append(cov)
    if why:
        cannot.append(why)
    return checks, cannot


def points(results: list[ServingCell]) -> dict[str, dict[str, list[Point]]]:
    groups: dict[str, dict[str, list[Point]]] = {}
    for r in results:
        group = groups.setdefault(f"{r.cell.workload}, context {r.cell.context}", {a: [] for a in ARMS})
        for name, m in r.metrics.items():
            if math.isfinite(m.tok_s_per_user_median) and math.isfinite(m.output_tok_s_per_gpu):
                label = f"TP{r.cell.tp} B{r.cell.batch}"
                group[name].append(Point(label, m.tok_s_per_user_median, m.output_tok_s_per_gpu))
    return groups


def cell_full(r: ServingCell) -> dict[str, Any]:
    return {
        "cell": r.cell.id,
        "axes": r.cell.axes(),
        "region": r.region.name,
        "budget_limit": r.region.limit,
        "deployment": r.deployment,
        "mode": r.mode,
        "timing": r.timing.to_json(),
        "arms": {
            name: {
                "metrics": r.metrics[name].to_json() if name in r.metrics else None,
                "path": r.paths[name].to_json() if name in r.paths else None,
                "rounds": [
                    {
                        "median_itl_s": run.median_itl(),
                        "wall_s": run.ended - run.started,
                        "problems": run.problems(),
                        "requests": bench.request_summary(run),
                    }
                    for run in runs
                ],
            }
            for name, runs in r.runs.items()
        },
    }


def cell_summary(r: ServingCell) -> dict[str, Any]:
    i = r.timing.interval
    return {
        "cell": r.cell.id,
        "workload": r.cell.workload,
        "region": r.region.name,
        "mode": r.mode,
        "itl_ratio": None if i is None else {"ratio": i.ratio, "low": i.low, "high": i.high, "rounds": i.n},
        "interval_narrow": r.timing.converged,
        "metrics": {name: m.to_json() for name, m in r.metrics.items()},
        "flags": [f"synthetic {s}" for s in r.cell.synthetic],
    }


def describe(meaningful: bool, output_tokens: int) -> list[str]:
    notes = [
        f"Each round: the cell's batch of concurrent streamed completions with random-token prompts of the cell's "
        f"context, {output_tokens} output tokens each (ignore_eos); mixed cells add back-to-back prefill requests.",
        "Interactivity P90: the decode rate 90% of requests got at least. Per GPU: per TP rank.",
    ]
    if not meaningful:
        notes.insert(
            0,
            "vLLM on the CPU with a small generated model: the numbers mean nothing about any GPU; this run exercises "
            "the serving benchmark and the verdict logic only (budgets are recorded, not judged).",
        )
    return notes


def records(
    ctx: StageContext,
    stage: str,
    plan: PerfPlan,
    serving: ServingSettings,
    findings: Findings,
    results: list[ServingCell],
    vllm_version: str,
    logs: list[str],
) -> StageRecords:
    """The stage's records: each cell's checks added to `findings`, the cells' evidence and figure, the metrics."""
    meaningful = ctx.config.hardware["gpu"] != "none"
    floor = float(serving_data()["coverage"]["floor"])
    for r in results:
        checks, cannot = cell_checks(r, serving, meaningful, floor)
        findings.checks += checks
        for why in cannot:
            findings.cannot(why)
    cells_path, cells_rel = ctx.evidence_path(stage, CELLS)
    with cells_path.open("w") as fh:
        for r in results:
            fh.write(json.dumps(cell_full(r), default=str) + "\n")
    findings.evidence.append(cells_rel)
    groups = points(results)
    notes = describe(meaningful, serving.output_tokens)
    figures = []
    if any(points for g in groups.values() for points in g.values()):
        plot_path, plot_rel = ctx.evidence_path(stage, PLOT)
        short = "vLLM on the CPU: the numbers mean nothing (see the notes)" if not meaningful else ""
        plot.render(groups, f"{ctx.config.subject}: Pareto view of the serving sweep", plot_path, note=short)
        findings.evidence.append(plot_rel)
        figures.append({"path": plot_rel, "caption": " ".join(["Interactivity vs output throughput per GPU.", *notes])})
    findings.evidence += logs
    findings.metrics.update(
        {
            "subject": ctx.config.subject,
            "device": "cpu" if not meaningful else f"{ctx.config.hardware['gpu_count']}x {ctx.config.hardware['gpu']}",
            "vllm": vllm_version,
            "numbers_meaningful": meaningful,
            "timing_judged": meaningful,
            "notes": notes,
            "ttft": TTFT,
            "order": ORDER,
            "tier": plan.tier,
            "settings": asdict(plan.settings),
            "serving": asdict(serving),
            "regions": [asdict(r) for r in plan.regions],
            "cells": [cell_summary(r) for r in results],
            "pareto_frontiers": frontiers_json(groups),
            "figures": figures,
        }
    )
    return findings.records()
