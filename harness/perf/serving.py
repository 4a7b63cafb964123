"""The perf stage for subjects served by vLLM: the sweep's cells as serving benchmark rounds on both arms' servers.

- Arms. Each deployment (TP, DCP) of the sweep starts a baseline and a candidate server (harness/runners/session).
  Where both fit at once (the CPU, or twice the GPUs a server needs) a cell's rounds interleave ABBA through the
  same `time_pair` as the in-process suites; otherwise each arm runs its rounds while it holds the GPUs, and the
  records say that drift between the arms is not cancelled.
- A round is one serving benchmark run (harness/runners/bench.py) of the cell's load: `batch` concurrent streams of
  a `context`-token prompt producing `output_tokens` tokens each, plus back-to-back prefill requests in a mixed
  cell. Its sample is the round's median decode ITL, so the budget judges the same ITL ratio as elsewhere.
- Metrics by axis (never mixed): decode-only ITL, decode tokens/s, interactivity (tokens/s per user, median and
  the P90 a deployment can promise), TTFT, output and input throughput per GPU. The Pareto figure plots
  interactivity against output throughput per GPU.
- Checks: every request produced exactly its tokens (a shorter answer looks faster), both arms' rounds gave finite
  ITLs, the budget on the ITL ratio's upper bound (judged where the numbers mean something: not on the CPU), the
  decode backend each model received, and the candidate's decode steps on the specialized path (the vLLM plugin's
  proof-of-path counts). A check that cannot run (no path probe for this model) makes the stage NOT_RUN, never
  PASSED.
"""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from harness.perf.plan import Cell, PerfConfigError, PerfPlan, Settings, parse
from harness.perf.serving_records import (
    SEQUENTIAL,
    ServingCell,
    ServingSettings,
    records,
    serving_data,
    serving_settings,
)
from harness.perf.stats import MIN_ROUNDS, RatioInterval, ratio_interval
from harness.perf.timing import STOP_BROKEN, STOP_NARROW, STOP_REPEATS, PairTiming, time_pair
from harness.runners import arms, bench, pathproof, session
from harness.runners.findings import Findings
from harness.runners.interpreter import VllmUnavailable, find
from harness.runners.server import ServerError
from harness.stages.base import StageContext
from harness.verdicts import StageRecords

ARMS = (arms.BASELINE, arms.CANDIDATE)


def unsupported(cell: Cell) -> str | None:
    why = serving_data()["unsupported"]
    if cell.routing == "real":
        return str(why["real_routing"])
    if cell.tokens_per_request > 1:
        return str(why["multi_token"])
    return None


def load_for(cell: Cell, serving: ServingSettings) -> bench.Load:
    return bench.Load(
        concurrency=cell.batch,
        prompt_tokens=cell.context,
        output_tokens=serving.output_tokens,
        prefill_tokens=cell.prefill_tokens if cell.workload == "mixed" else None,
        seed=zlib.crc32(cell.id.encode()),
    )


RoundRunner = Callable[[bench.Load, int], bench.BenchRun]  # (load, round index) -> one benchmark round


@dataclass
class BenchArm:
    """One arm of one cell as `time_pair` sees it: a run is one benchmark round, its sample the round's median
    decode ITL. The first `warmup` rounds are kept out of the metrics (they are time_pair's warm-up rounds)."""

    name: str
    load: bench.Load
    round_runner: RoundRunner
    warmup: int
    runs: list[bench.BenchRun] = field(default_factory=list)
    rounds: int = 0

    def run(self, steps: int = 1, lead_in: int = 0) -> float:
        result = self.round_runner(self.load, self.rounds)
        self.rounds += 1
        if self.rounds > self.warmup:
            self.runs.append(result)
        return result.median_itl() * steps


def sequential_timing(baseline: list[float], candidate: list[float], settings: Settings) -> PairTiming:
    """The pair record of arms timed one after the other: rounds paired by index, with the interval of their
    ratio (its pairing cancels nothing: the record's stop says so)."""
    n = min(len(baseline), len(candidate))
    b, c = tuple(baseline[:n]), tuple(candidate[:n])
    if n < MIN_ROUNDS or any(not (math.isfinite(x) and x > 0) for x in (*b, *c)):
        return PairTiming(b, c, None, False, STOP_BROKEN, settings.warmup, 0.0, "a round gave no finite ITL")
    interval: RatioInterval = ratio_interval(list(b), list(c), settings.ci_level, settings.ci_method)
    narrow = interval.rel_width <= settings.ci_target_rel_width
    stop = f"{STOP_NARROW if narrow else STOP_REPEATS}; {SEQUENTIAL}"
    return PairTiming(b, c, interval, narrow, stop, settings.warmup, 0.0, "", 1, 0, {"fixed_steps": 1})


def _rounds_alone(arm: BenchArm, settings: Settings) -> list[float]:
    """An arm's samples when it runs alone: warm-up, then max(min_repeats, 4) rounds (no pairing to stop on)."""
    for _ in range(settings.warmup):
        arm.run()
    return [arm.run() for _ in range(max(settings.min_repeats, MIN_ROUNDS))]


def _metrics(runs: dict[str, list[bench.BenchRun]], gpus: int) -> dict[str, bench.ServingMetrics]:
    return {name: bench.metrics(r, gpus) for name, r in runs.items() if r}


def measure_interleaved(
    cell: Cell, runners: dict[str, RoundRunner], settings: Settings, serving: ServingSettings
) -> tuple[PairTiming, dict[str, list[bench.BenchRun]]]:
    """A cell's rounds on both arms, interleaved ABBA until the ITL ratio's interval is narrow."""
    load = load_for(cell, serving)
    pair = {name: BenchArm(name, load, runners[name], settings.warmup) for name in ARMS}
    timing = time_pair(pair[arms.BASELINE].run, pair[arms.CANDIDATE].run, settings, steps=1)
    return timing, {name: a.runs for name, a in pair.items()}


# -- the stage -----------------------------------------------------------------------------------------------------


@dataclass
class _Context:
    ctx: StageContext
    stage: str
    plan: PerfPlan
    serving: ServingSettings
    findings: Findings
    results: list[ServingCell] = field(default_factory=list)


def _deployments(cells: tuple[Cell, ...]) -> list[arms.Deployment]:
    return list(dict.fromkeys(arms.Deployment(c.tp, c.dcp) for c in cells))


def _runner(arm: session.RunningArm, pool: list[int]) -> RoundRunner:
    def one(load: bench.Load, round_: int) -> bench.BenchRun:
        result = bench.run(arm.client, load, pool, round_)
        if result.problems():
            arm.alive_or_raise(f"a perf round of {load.concurrency} requests")  # a dead server is an ERROR
        return result

    return one


def _backend(c: _Context, arm: session.RunningArm, dep: arms.Deployment) -> None:
    c.findings.metrics[f"startup_s_{arm.name}_{dep.label()}"] = arm.server.startup_s
    check, why = session.backend_check(arm)
    if check is not None:
        c.findings.checks.append(check)
    if why:
        c.findings.cannot(why)


def _record(
    c: _Context,
    cell: Cell,
    dep: arms.Deployment,
    mode: str,
    timing: PairTiming,
    runs: dict[str, list[bench.BenchRun]],
    paths: dict[str, pathproof.CellPath],
) -> None:
    c.results.append(
        ServingCell(cell, c.plan.region_of(cell), dep.label(), mode, timing, runs, _metrics(runs, cell.tp), paths)
    )


def _interleaved(c: _Context, provider: session.ArmProvider, dep: arms.Deployment, cells: list[Cell]) -> None:
    with provider((arms.BASELINE, arms.CANDIDATE), dep) as running:
        for arm in running.values():
            _backend(c, arm, dep)
        pool = bench.token_pool(running[arms.BASELINE].client)  # one tokenizer, so both arms get the same prompts
        runners = {name: _runner(arm, pool) for name, arm in running.items()}
        for i, cell in enumerate(cells):
            c.ctx.progress(f"{dep.label()}: {cell.id}", i / len(cells))
            before = {name: arm.snapshot() for name, arm in running.items()}
            timing, runs = measure_interleaved(cell, runners, c.plan.settings, c.serving)
            done = time.time()
            paths = {
                name: pathproof.cell_path(before[name], pathproof.settle(arm.path_dir, done), done)
                for name, arm in running.items()
            }
            _record(c, cell, dep, "interleaved", timing, runs, paths)


def _sequential(c: _Context, provider: session.ArmProvider, dep: arms.Deployment, cells: list[Cell]) -> None:
    samples: dict[str, dict[str, list[float]]] = {}
    runs: dict[str, dict[str, list[bench.BenchRun]]] = {}
    paths: dict[str, dict[str, pathproof.CellPath]] = {}
    pool: list[int] | None = None
    for name in ARMS:
        c.ctx.progress(f"{dep.label()}: starting the {name} server", None)
        with provider((name,), dep) as running:
            arm = running[name]
            _backend(c, arm, dep)
            pool = pool or bench.token_pool(arm.client)
            for cell in cells:
                c.ctx.progress(f"{dep.label()}: {cell.id} on the {name} arm", None)
                before = arm.snapshot()
                bench_arm = BenchArm(name, load_for(cell, c.serving), _runner(arm, pool), c.plan.settings.warmup)
                samples.setdefault(cell.id, {})[name] = _rounds_alone(bench_arm, c.plan.settings)
                done = time.time()
                runs.setdefault(cell.id, {})[name] = bench_arm.runs
                after = pathproof.settle(arm.path_dir, done)
                paths.setdefault(cell.id, {})[name] = pathproof.cell_path(before, after, done)
    for cell in cells:
        s = samples[cell.id]
        timing = sequential_timing(s[arms.BASELINE], s[arms.CANDIDATE], c.plan.settings)
        _record(c, cell, dep, SEQUENTIAL, timing, runs[cell.id], paths[cell.id])


def run_stage(
    ctx: StageContext,
    stage: str,
    provider: session.ArmProvider | None = None,
    overrides: arms.ArmOverrides | None = None,
) -> StageRecords:
    config = ctx.config
    vllm = config.data["vllm"]
    try:
        plan = parse(config.data, config.tier)
    except PerfConfigError as exc:
        return (
            StageRecords.not_run(stage, str(exc)) if "perf" not in config.data else StageRecords.error(stage, str(exc))
        )
    if not plan.cells:
        return StageRecords.not_run(
            stage, f"no [[perf.sweeps]] entry runs in tier {config.tier} — add it to a sweep's tiers"
        )
    blocked = [(cell, why) for cell in plan.cells if (why := unsupported(cell))]
    if blocked:
        cell, why = blocked[0]
        return StageRecords.not_run(
            stage,
            f"{config.subject} cannot measure {len(blocked)} of {len(plan.cells)} perf cells; first: {cell.id}: {why}",
        )
    stage_dir = ctx.stage_dir(stage)
    version = "unknown: the caller provided running arms"
    if provider is None:
        try:
            python = find()
        except VllmUnavailable as exc:
            return StageRecords.not_run(stage, str(exc))
        version = python.vllm_version
        model_path = arms.resolve_model(vllm["model"], python.path)
        provider = session.config_provider(vllm, python.path, model_path, stage_dir, overrides)
    serving = serving_settings(config.data["perf"])
    c = _Context(ctx, stage, plan, serving, Findings(stage))
    hw = config.hardware
    try:
        for dep in _deployments(plan.cells):
            cells = [cell for cell in plan.cells if (cell.tp, cell.dcp) == (dep.tp, dep.dcp)]
            together = hw["gpu"] == "none" or hw["gpu_count"] >= 2 * dep.tp
            (_interleaved if together else _sequential)(c, provider, dep, cells)
    except (ServerError, bench.BenchError) as exc:
        return StageRecords.error(stage, str(exc), _logs(ctx, stage_dir))
    return records(ctx, stage, plan, serving, c.findings, c.results, version, _logs(ctx, stage_dir))


def _logs(ctx: StageContext, stage_dir: Path) -> list[str]:
    return sorted(str(p.relative_to(ctx.bundle_dir)) for p in stage_dir.glob("server-*.log"))
