"""The `[perf]` table of a config: sweep cells, regression budgets by region, and how to time them.

The schema (the `perf` property of harness/config/schema.json) fixes the keys and types; the rules it cannot say
are checked here, each as one line naming the key and the fix:
- `[[perf.sweeps]]`: each entry is the Cartesian product of its axes (batches x contexts x tp x dcp x
  tokens_per_request) for one workload: `decode` (pure decode steps) or `mixed` (decode rows plus a prefill chunk
  of `prefill_tokens` in the same step). An axis left out takes the config's own list ([workload], [parallel]); an
  axis given must be a subset of it, so the subject's scope checks of those lists cover every perf cell.
- `routing`: `real` (real prompts drive the MoE routing) or `synthetic` (random inputs; flagged in every record,
  since the experts a batch reads change the bytes it moves). `tokens_per_request` above 1 needs
  `acceptance_rate`: the synthetic chance that a draft token is accepted, flagged the same way.
- `tiers`: the tiers a sweep runs in (all when left out).
- `[[perf.budgets]]`: regions of the sweep (a batch range, optionally a context range, workloads and a range of
  tokens per request), each with the ITL regression it allows and why. Every cell of every tier lies in exactly one
  region, so no cell goes unjudged and no cell is judged twice.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from harness.perf.stats import MIN_ROUNDS

WORKLOADS = ("decode", "mixed")
ROUTINGS = ("synthetic", "real")
TIERS = ("smoke", "standard", "full")
# sweep axis -> (config table, key) it defaults to and must be a subset of
AXES: dict[str, tuple[str, str]] = {
    "batches": ("workload", "batches"),
    "contexts": ("workload", "contexts"),
    "tp": ("parallel", "tp"),
    "dcp": ("parallel", "dcp"),
    "tokens_per_request": ("workload", "tokens_per_request"),
}


class PerfConfigError(ValueError):
    """A `[perf]` table the stage cannot use; the message is one line naming the key and the fix."""


@dataclass(frozen=True)
class Settings:
    """How cells are timed. The defaults are the documented grammar defaults; configs override any of them."""

    baseline_backend: str = "auto"
    candidate_backend: str = "latency_specialized"
    warmup: int = 2  # untimed rounds of both arms before the first timed one
    min_repeats: int = 5  # timed rounds before the interval may stop the cell
    max_repeats: int = 30  # the cap: a cell whose interval is still wide stops here and says so
    max_seconds_per_cell: float = 120.0  # a second cap, on wall time, for slow cells
    ci_level: float = 0.95
    ci_method: str = "bootstrap"  # "bootstrap" (median ratio, paired) or "t" (geometric mean ratio, paired)
    ci_target_rel_width: float = 0.02  # stop once (high - low) / ratio is at most this
    # One timed sample is as many back-to-back steps as it takes to last min_sample_s (calibrated per cell, the
    # same count for both arms, at most max_steps_per_sample), after lead_in_steps untimed ones: a 1 ms graph replay
    # alone is dominated by launch jitter and by the pause before it. Not longer: host-bound eager steps on the H200
    # switched between a fast and a slow host speed every 0.1-3 s, and a sample longer than that puts the two arms
    # of a round in different regimes (200 ms samples gave wider A/A intervals than 50 ms ones).
    min_sample_s: float = 0.02
    lead_in_steps: int = 1
    max_steps_per_sample: int = 1000
    l2_flush: bool = True  # overwrite a buffer larger than the last-level cache before every timed run
    profile_repeats: int = 3  # profiled runs per arm for per-layer time and launches (medians)
    amdahl_tolerance: float = 0.05  # |measured ratio - ratio the per-layer times predict| allowed

    def __post_init__(self) -> None:
        if self.max_repeats < MIN_ROUNDS:
            raise PerfConfigError(
                f"perf.max_repeats: {self.max_repeats} rounds cannot give an interval (it needs {MIN_ROUNDS}, two of "
                f"each order) — raise it to {MIN_ROUNDS} or more"
            )
        if self.max_repeats < self.min_repeats:
            raise PerfConfigError(
                f"perf.max_repeats: {self.max_repeats} is below perf.min_repeats {self.min_repeats} — raise it"
            )


@dataclass(frozen=True)
class Cell:
    """One point of the sweep: what one interleaved baseline/candidate measurement runs."""

    sweep: str
    workload: str  # decode | mixed
    routing: str  # real | synthetic
    tp: int
    dcp: int
    batch: int  # decode requests in the step (concurrency)
    context: int  # tokens of context each decode request holds
    tokens_per_request: int  # q: 1 + draft tokens verified per step
    prefill_tokens: int | None = None  # mixed: the prefill chunk riding in the same step
    acceptance_rate: float | None = None  # q > 1: synthetic chance a draft token is accepted

    @property
    def id(self) -> str:
        return f"{self.sweep}/tp{self.tp}/dcp{self.dcp}/b{self.batch}/ctx{self.context}/q{self.tokens_per_request}"

    @property
    def tokens_per_step(self) -> float:
        """Tokens a request gains per step: the verified token plus the accepted drafts, each draft accepted only if
        every draft before it was (independent acceptance at `acceptance_rate`): 1 + a + a^2 + ... + a^(q-1)."""
        a = self.acceptance_rate or 0.0
        return sum(a**i for i in range(self.tokens_per_request))

    @property
    def synthetic(self) -> tuple[str, ...]:
        """What in this cell is synthetic, for the records' flags."""
        out = []
        if self.routing == "synthetic":
            out.append("routing: random inputs choose the MoE experts, not real prompts")
        if self.tokens_per_request > 1:
            out.append(f"acceptance: a fixed synthetic draft acceptance rate of {self.acceptance_rate}")
        return tuple(out)

    def axes(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class Region:
    """A region of the sweep and the ITL regression it allows (candidate / baseline step time <= 1 + budget)."""

    name: str
    batches: tuple[int, int]  # inclusive
    max_itl_regression: float
    contexts: tuple[int, int] | None = None  # inclusive; None: any
    workloads: tuple[str, ...] | None = None  # None: any
    tokens_per_request: tuple[int, int] | None = None  # inclusive; None: any
    why: str = ""  # why the budget is what it is

    def contains(self, cell: Cell) -> bool:
        lo, hi = self.batches
        if not lo <= cell.batch <= hi:
            return False
        if self.contexts is not None and not self.contexts[0] <= cell.context <= self.contexts[1]:
            return False
        q = self.tokens_per_request
        if q is not None and not q[0] <= cell.tokens_per_request <= q[1]:
            return False
        return self.workloads is None or cell.workload in self.workloads

    @property
    def limit(self) -> float:
        return 1.0 + self.max_itl_regression


@dataclass(frozen=True)
class PerfPlan:
    settings: Settings
    tier: str
    cells: tuple[Cell, ...]  # the cells of `tier`, in sweep order
    regions: tuple[Region, ...]
    all_cells: tuple[Cell, ...] = field(default=(), repr=False)  # every tier's cells (for region coverage)

    def region_of(self, cell: Cell) -> Region:
        found = [r for r in self.regions if r.contains(cell)]
        if len(found) != 1:  # parse() proved exactly one region per cell; a hand-built plan may not have
            raise PerfConfigError(f"perf.budgets: cell {cell.id} lies in {len(found)} regions — make exactly one")
        return found[0]


def _range(value: Sequence[int], where: str) -> tuple[int, int]:
    lo, hi = value
    if lo > hi:
        raise PerfConfigError(f"{where}: [{lo}, {hi}] is empty — write [low, high] with low <= high")
    return lo, hi


def _sweep_cells(i: int, raw: Mapping[str, Any], data: Mapping[str, Any]) -> list[Cell]:
    where = f"perf.sweeps[{i}]"
    name, workload = raw["name"], raw["workload"]
    axes: dict[str, list[int]] = {}
    for axis, (table, key) in AXES.items():
        allowed = list(data[table][key])
        values = list(raw.get(axis, allowed))
        if extra := [v for v in values if v not in allowed]:
            raise PerfConfigError(
                f"{where}.{axis}: {extra[0]} is not in {table}.{key} {allowed} — add it there (so the scope checks "
                "cover it) or drop it here"
            )
        axes[axis] = values
    prefill = raw.get("prefill_tokens")
    if workload == "mixed" and prefill is None:
        raise PerfConfigError(f"{where}: a mixed workload needs prefill_tokens (the chunk in each step) — add it")
    if workload == "decode" and prefill is not None:
        raise PerfConfigError(f"{where}: prefill_tokens is set on a pure decode sweep — drop it or use 'mixed'")
    rate = raw.get("acceptance_rate")
    multi = max(axes["tokens_per_request"]) > 1
    if multi and rate is None:
        raise PerfConfigError(
            f"{where}: tokens_per_request above 1 needs acceptance_rate (the synthetic chance a draft token is "
            "accepted) — add e.g. acceptance_rate = 0.7"
        )
    if not multi and rate is not None:
        raise PerfConfigError(f"{where}: acceptance_rate is set but every tokens_per_request is 1 — drop it")
    return [
        Cell(
            sweep=name,
            workload=workload,
            routing=raw["routing"],
            tp=tp,
            dcp=dcp,
            batch=batch,
            context=context,
            tokens_per_request=q,
            prefill_tokens=prefill,
            acceptance_rate=rate if q > 1 else None,
        )
        for tp, dcp, batch, context, q in itertools.product(
            axes["tp"], axes["dcp"], axes["batches"], axes["contexts"], axes["tokens_per_request"]
        )
    ]


def _regions(raw: Sequence[Mapping[str, Any]]) -> tuple[Region, ...]:
    out, seen = [], set()
    for i, r in enumerate(raw):
        where = f"perf.budgets[{i}]"
        if r["region"] in seen:
            raise PerfConfigError(f"{where}.region: {r['region']!r} is named twice — give each region its own name")
        seen.add(r["region"])
        contexts = r.get("contexts")
        workloads = r.get("workloads")
        q = r.get("tokens_per_request")
        out.append(
            Region(
                name=r["region"],
                batches=_range(r["batches"], f"{where}.batches"),
                max_itl_regression=float(r["max_itl_regression"]),
                contexts=None if contexts is None else _range(contexts, f"{where}.contexts"),
                workloads=None if workloads is None else tuple(workloads),
                tokens_per_request=None if q is None else _range(q, f"{where}.tokens_per_request"),
                why=str(r.get("why", "")),
            )
        )
    return tuple(out)


def _check_coverage(cells: Sequence[Cell], regions: Sequence[Region]) -> None:
    for cell in cells:
        found = [r.name for r in regions if r.contains(cell)]
        if not found:
            raise PerfConfigError(
                f"perf.budgets: cell {cell.id} ({cell.workload}) lies in no region — add a region whose batches "
                f"cover {cell.batch} and contexts cover {cell.context}"
            )
        if len(found) > 1:
            raise PerfConfigError(
                f"perf.budgets: cell {cell.id} lies in regions {', '.join(found)} — make the regions disjoint"
            )


def parse(data: Mapping[str, Any], tier: str) -> PerfPlan:
    """The plan of a schema-valid config for `tier`; raises PerfConfigError (one line) on a rule the schema misses.
    A config without a `[perf]` table raises too: the caller decides whether that is a NOT_RUN."""
    raw = data.get("perf")
    if raw is None:
        raise PerfConfigError(
            f"config {data.get('name', '?')} has no [perf] table — add one (see `k3gate show-config cpu-smoke`)"
        )
    known = {f.name for f in fields(Settings)}
    settings = Settings(**{k: v for k, v in raw.items() if k in known})
    names = [s["name"] for s in raw["sweeps"]]
    if dup := sorted({n for n in names if names.count(n) > 1}):
        raise PerfConfigError(f"perf.sweeps: name {dup[0]!r} is used twice — give each sweep its own name")
    cells_by_tier: dict[str, list[Cell]] = {t: [] for t in TIERS}
    for i, sweep in enumerate(raw["sweeps"]):
        cells = _sweep_cells(i, sweep, data)
        for t in sweep.get("tiers", TIERS):
            cells_by_tier[t].extend(cells)
    regions = _regions(raw["budgets"])
    every = [c for t in TIERS for c in cells_by_tier[t]]
    _check_coverage(every, regions)
    # Grouped by parallel config (stable within it): a subject builds one executor or server per TP and DCP.
    cells = sorted(cells_by_tier[tier], key=lambda c: (c.tp, c.dcp))
    return PerfPlan(settings, tier, tuple(cells), regions, tuple(dict.fromkeys(every)))


def config_issues(data: Mapping[str, Any]) -> list[str]:
    """The one-line problem of a schema-valid config's `[perf]` table, for config loading (empty when it is fine or
    when the config has no `[perf]` table)."""
    if "perf" not in data:
        return []
    try:
        parse(data, data.get("tier", "smoke"))
    except PerfConfigError as exc:
        return [str(exc)]
    return []
