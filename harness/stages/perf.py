"""The perf stage: the config's sweep, baseline and candidate interleaved per cell, judged by region budgets and
plausibility (roofline, Amdahl), with the Pareto figure in the bundle's evidence and the report.

A config with a `[vllm]` table is served by vLLM: its cells are serving benchmark rounds against both arms' servers
(harness/perf/serving.py). Otherwise the subject supplies an in-process suite (`subject.perf_suite(config)`); a
subject without one is NOT_RUN with the reason, as is a sweep cell the suite cannot measure: a run that skipped
part of the sweep it was asked for is incomplete.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from harness.perf import plot
from harness.perf.checks import sweep_checks
from harness.perf.measure import CellResult, measure_cell
from harness.perf.pareto import frontiers_json, points
from harness.perf.plan import PerfConfigError, PerfPlan, parse
from harness.perf.records import cell_full, cell_summary
from harness.perf.suite import Bandwidth, PerfSuite
from harness.stages.base import StageContext
from harness.subjects import load_subject
from harness.verdicts import StageRecords

PLOT = "pareto.png"
CELLS = "cells.jsonl"


def run_sweep(
    suite: PerfSuite, plan: PerfPlan, progress: Callable[[str, float | None], None]
) -> tuple[Bandwidth, list[CellResult]]:
    bandwidth = suite.bandwidth()  # once, in the same run as every timing it bounds
    results = []
    for i, cell in enumerate(plan.cells):
        progress(cell.id, i / len(plan.cells))
        prepared = suite.prepare(cell, plan.settings)
        results.append(measure_cell(prepared, cell, plan.region_of(cell), plan.settings))
    return bandwidth, results


def _caption(suite: PerfSuite) -> str:
    info = suite.info
    what = "Interactivity vs output throughput per GPU, baseline and candidate, per workload and context."
    return " ".join([what, *info.notes])


@dataclass(frozen=True)
class PerfStage:
    name: str = "perf"
    description: str = "Principle 4: performance sweeps with a verdict"
    needs_hardware: bool = True
    provider: Any = None  # served subjects: tests hand in running servers (a harness.runners.session.ArmProvider)
    overrides: Any = None  # served subjects: red-team environment per arm (harness.runners.arms.ArmOverrides)

    def run(self, ctx: StageContext) -> StageRecords:
        config = ctx.config
        if why := plot.available():
            return StageRecords.not_run(self.name, why)
        if "vllm" in config.data:
            from harness.perf import serving  # late: the in-process path needs none of the vLLM runner

            return serving.run_stage(ctx, self.name, self.provider, self.overrides)
        subject = load_subject(config.subject)
        make_suite = getattr(subject, "perf_suite", None)
        if make_suite is None:
            return StageRecords.not_run(self.name, f"subject {config.subject} has no perf suite in this build")
        suite: PerfSuite | None = None
        try:
            suite = make_suite(config)
            if suite is None:
                return StageRecords.not_run(self.name, f"subject {config.subject} has no perf suite in this build")
            plan = parse(config.data, config.tier)
            if not plan.cells:
                return StageRecords.not_run(
                    self.name, f"no [[perf.sweeps]] entry runs in tier {config.tier} — add it to a sweep's tiers"
                )
            blocked = [(c, why) for c in plan.cells if (why := suite.unsupported(c))]
            if blocked:
                cell, why = blocked[0]
                return StageRecords.not_run(
                    self.name,
                    f"{config.subject} cannot measure {len(blocked)} of {len(plan.cells)} perf cells; "
                    f"first: {cell.id}: {why}",
                )
            return self.measure(ctx, suite, plan)
        except PerfConfigError as exc:
            # No table at all: the evidence was never asked for (NOT_RUN); a table that is wrong is an error.
            if "perf" not in config.data:
                return StageRecords.not_run(self.name, str(exc))
            return StageRecords.error(self.name, str(exc))
        finally:
            if suite is not None:
                suite.close()

    def measure(self, ctx: StageContext, suite: PerfSuite, plan: PerfPlan, figure: bool = True) -> StageRecords:
        """The sweep measured and judged: what `run` does once it has a suite and a plan (the red team calls it
        with perturbed suites; `figure` False leaves the Pareto figure out, which no check reads)."""
        bandwidth, results = run_sweep(suite, plan, ctx.progress)
        return self._records(ctx, suite, plan, bandwidth, results, figure)

    def _records(
        self,
        ctx: StageContext,
        suite: PerfSuite,
        plan: PerfPlan,
        bandwidth: Bandwidth,
        results: list[CellResult],
        figure: bool = True,
    ) -> StageRecords:
        cells_path, cells_rel = ctx.evidence_path(self.name, CELLS)
        with cells_path.open("w") as fh:
            for r in results:
                fh.write(json.dumps(cell_full(r, bandwidth), default=str) + "\n")
        evidence = [cells_rel]
        groups = points(results)
        figures = []
        if groups and figure:
            plot_path, plot_rel = ctx.evidence_path(self.name, PLOT)
            info = suite.info
            title = f"{info.subject} on {info.device}: Pareto view of the perf sweep"
            plot.render(groups, title, plot_path, note=info.figure_note)
            evidence.append(plot_rel)
            figures.append({"path": plot_rel, "caption": _caption(suite)})
        info = suite.info
        # Where the numbers mean nothing (the CPU at toy dims) budgets and Amdahl are recorded, not judged.
        checks = sweep_checks(
            results, len(plan.cells), bandwidth, plan.settings.amdahl_tolerance, info.numbers_meaningful
        )
        metrics = {
            "subject": info.subject,
            "device": info.device,
            "numbers_meaningful": info.numbers_meaningful,
            "timing_judged": info.numbers_meaningful,
            "notes": list(info.notes),
            "ttft": info.ttft,
            "tier": plan.tier,
            "settings": asdict(plan.settings),
            "bandwidth": bandwidth.to_json(),
            # Around the whole sweep; every cell's own readings are in cells.jsonl.
            "clocks": {"before": results[0].clocks_before, "after": results[-1].clocks_after} if results else {},
            "regions": [asdict(r) for r in plan.regions],
            "cells": [cell_summary(r) for r in results],
            "pareto_frontiers": frontiers_json(groups),
            "figures": figures,
        }
        return StageRecords(stage=self.name, checks=checks, metrics=metrics, evidence=evidence)
