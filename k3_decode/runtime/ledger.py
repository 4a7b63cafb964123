"""The dispatch ledger: every path decision as a record, joined with what really ran.

Records are made when Python decides: on every eager step, and once per CUDA graph at capture, since under FULL
graphs Python does not run at replay. A graph record therefore stands for as many dispatches as its graph was
replayed (effective dispatches = replays x captured records); a graph captured and never replayed ran nothing.

The ground truth that kernels ran comes from outside Python: device-side execution counters (one atomic per launch in
audit builds, reported per kernel name by the executor) and the kernel names a profiler saw. `check_execution` joins
them with the records through a `KernelCatalog` (which kernels one dispatch of an op launches on each path).

Expectations are how a test, eval or perf cell states the path it expects; `check` lists every disagreement.
The JSON form (schema: `ledger.schema.json` beside this module) carries the records, replays, counters,
expectations and a summary that `from_json` re-derives, so an edited summary is caught.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from functools import cache
from importlib import resources
from typing import Any, Literal

import jsonschema

from k3_decode.runtime.optable import PATHS, DispatchPath

Mode = Literal["graph", "eager"]
MODES: tuple[Mode, ...] = ("graph", "eager")
SCHEMA_ID = "https://k3gate.dev/dispatch-ledger/v1"


def graph_key(batch: int, tokens_per_request: int) -> str:
    """The name of the graph captured for a batch descriptor: requests and tokens per request."""
    return f"B{batch}q{tokens_per_request}"


@dataclass(frozen=True)
class DispatchRecord:
    step: int
    layer: int
    op: str
    path: DispatchPath
    reason: str
    batch: int  # requests, padding included
    tokens_per_request: int
    mode: Mode
    rank: int
    graph: str | None = None  # the captured graph this record belongs to (mode "graph" only)

    def __post_init__(self) -> None:
        if self.path not in PATHS:
            raise ValueError(f"dispatch path {self.path!r} is not one of {', '.join(PATHS)}")
        if self.mode not in MODES:
            raise ValueError(f"dispatch mode {self.mode!r} is not one of {', '.join(MODES)}")
        if (self.mode == "graph") != bool(self.graph):
            raise ValueError("a dispatch record names its graph exactly when its mode is 'graph'; fix mode or graph")
        if min(self.step, self.layer, self.rank) < 0 or min(self.batch, self.tokens_per_request) < 1:
            raise ValueError(
                f"dispatch record fields out of range (step {self.step}, layer {self.layer}, rank {self.rank} "
                f">= 0; batch {self.batch}, tokens_per_request {self.tokens_per_request} >= 1)"
            )
        if not self.op or not self.reason:
            raise ValueError("a dispatch record needs an op name and a reason")

    def where(self) -> str:
        return f"rank {self.rank} step {self.step} layer {self.layer} {self.op}"


@dataclass(frozen=True)
class Expectation:
    """The path a test, eval or perf cell (`by`) expects for every dispatch its selectors match (None: any)."""

    path: DispatchPath
    by: str
    op: str | None = None
    layer: int | None = None
    step: int | None = None
    rank: int | None = None

    def __post_init__(self) -> None:
        if self.path not in PATHS:
            raise ValueError(f"expected path {self.path!r} is not one of {', '.join(PATHS)}")
        if not self.by:
            raise ValueError("an expectation names who expects it (by=...: the test, eval or perf cell)")

    def matches(self, record: DispatchRecord) -> bool:
        return all(
            want is None or want == got
            for want, got in (
                (self.op, record.op),
                (self.layer, record.layer),
                (self.step, record.step),
                (self.rank, record.rank),
            )
        )

    def selector(self) -> str:
        what = f"op {self.op}" if self.op is not None else "any op"
        at = [f"{k} {v}" for k, v in (("rank", self.rank), ("step", self.step), ("layer", self.layer)) if v is not None]
        return f"{what} at {' '.join(at)}" if at else what


@dataclass(frozen=True)
class KernelCatalog:
    """Which kernels one dispatch of (op, path) launches, and how often. Specialized entries come from the registered
    providers; stock entries are whatever the stock path declares (its public kernels may have no device counter).
    `verify_launches` holds the (op, path) pairs that launch other kernels on a verify step, and `verify_steps` the
    steps that were verify steps (the executor knows; a record's token count does not tell a verify step from a
    prefill or mixed one): the stock KDA core runs the verify pipeline there, not the fused decode kernel."""

    launches: Mapping[tuple[str, DispatchPath], Mapping[str, int]] = field(default_factory=dict)
    verify_launches: Mapping[tuple[str, DispatchPath], Mapping[str, int]] = field(default_factory=dict)
    verify_steps: frozenset[int] = frozenset()

    @classmethod
    def build(
        cls,
        providers: Iterable[Any],
        stock: Mapping[str, Mapping[str, int]] | None = None,
        stock_verify: Mapping[str, Mapping[str, int]] | None = None,
        verify_steps: Iterable[int] = (),
    ) -> KernelCatalog:
        """`providers`: objects with `op` and `launches` (backend.KernelProvider); `stock`: op -> kernel launches;
        `stock_verify`: the same for the ops whose stock launches differ on a verify step; `verify_steps`: which
        steps were verify steps."""
        table: dict[tuple[str, DispatchPath], Mapping[str, int]] = {
            (p.op, "specialized"): p.launches for p in providers
        }
        table.update({(op, "stock"): launches for op, launches in (stock or {}).items()})
        verify = {(op, "stock"): launches for op, launches in (stock_verify or {}).items()}
        return cls(table, verify, frozenset(verify_steps))

    def launches_of(self, op: str, path: DispatchPath, verify: bool = False) -> Mapping[str, int]:
        """The kernels one dispatch of (op, path) launches, on a verify step or any other."""
        if verify and (op, path) in self.verify_launches:
            return self.verify_launches[(op, path)]
        return self.launches.get((op, path), {})

    def kernels(self, path: DispatchPath | None = None) -> set[str]:
        return {
            k
            for table in (self.launches, self.verify_launches)
            for (_, p), ks in table.items()
            if path in (None, p)
            for k in ks
        }


@dataclass(frozen=True)
class LedgerMark:
    """A point in a ledger's life: how many records it held and how often each graph had been replayed."""

    records: int
    replays: Mapping[str, int]


class Ledger:
    def __init__(self) -> None:
        self._records: list[DispatchRecord] = []
        self._replays: dict[str, int] = {}
        self._expectations: list[Expectation] = []
        self.device_counts: dict[str, int] | None = None
        self.profiler_kernels: dict[str, int] | None = None

    # -- recording -------------------------------------------------------------------------------------------

    def record(self, *records: DispatchRecord) -> None:
        for rec in records:
            if rec.graph is not None and self._replays.get(rec.graph, 0) > 0:
                raise ValueError(
                    f"graph {rec.graph} was already replayed, so its captured records are final; "
                    "capture a new graph under a new name instead of adding records to it"
                )
            self._records.append(rec)

    def records(self) -> tuple[DispatchRecord, ...]:
        return tuple(self._records)

    def replayed(self, graph: str, times: int = 1) -> None:
        """Count `times` replays of a captured graph (the executor calls this on every replay)."""
        if times < 1:
            raise ValueError(f"replay count must be >= 1, got {times}")
        if not any(r.graph == graph for r in self._records):
            raise ValueError(
                f"graph {graph} replayed but nothing was recorded at its capture; record the capture first"
            )
        self._replays[graph] = self._replays.get(graph, 0) + times

    def replays(self) -> dict[str, int]:
        return dict(self._replays)

    def executions(self, record: DispatchRecord) -> int:
        """How many dispatches a record stands for: 1 when eager, its graph's replay count when captured."""
        return 1 if record.graph is None else self._replays.get(record.graph, 0)

    def mark(self) -> LedgerMark:
        return LedgerMark(len(self._records), dict(self._replays))

    def since(self, mark: LedgerMark) -> Ledger:
        """What ran after `mark`, as a ledger of its own: the records made since (eager steps and captures), and the
        captured records of earlier graphs replayed since, each graph with only the replays made since. Several
        cells that share one executor are judged each on its own dispatches this way; expectations, counters and
        profiler names are not carried over (what was reported belongs to the whole run)."""
        window = Ledger()
        fresh = self._records[mark.records :]
        replayed = {g for g, n in self._replays.items() if n > mark.replays.get(g, 0)}
        window._records = [r for r in self._records[: mark.records] if r.graph in replayed] + fresh
        graphs = {r.graph for r in window._records if r.graph is not None}
        for graph in sorted(graphs):
            if (new := self._replays.get(graph, 0) - mark.replays.get(graph, 0)) > 0:
                window._replays[graph] = new
        return window

    def report_device_counts(self, counts: Mapping[str, int]) -> None:
        """Launch counts per kernel name read from the device-side counters (audit builds) after the run."""
        self.device_counts = _counts(counts, "device counts")

    def report_profiler_kernels(self, counts: Mapping[str, int]) -> None:
        """Kernel names as a profiler reported them (possibly mangled), with their launch counts."""
        self.profiler_kernels = _counts(counts, "profiler kernels")

    # -- summaries -------------------------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """Decisions (one per record) and dispatches (records weighted by executions), by path, op and reason."""
        decisions, dispatches = _Tally(), _Tally()
        captured: Counter[str] = Counter()
        for rec in self._records:
            decisions.add(rec, 1)
            dispatches.add(rec, self.executions(rec))
            if rec.graph is not None:
                captured[rec.graph] += 1
        graphs = {g: {"captured": n, "replays": self._replays.get(g, 0)} for g, n in sorted(captured.items())}
        return {"decisions": decisions.as_dict(), "dispatches": dispatches.as_dict(), "graphs": graphs}

    # -- expectations ----------------------------------------------------------------------------------------

    def expect(self, *expectations: Expectation) -> None:
        self._expectations.extend(expectations)

    def expectations(self) -> tuple[Expectation, ...]:
        return tuple(self._expectations)

    def check(self, expected: Iterable[Expectation] | None = None) -> list[str]:
        """Every disagreement between the expectations (the declared ones by default) and what was dispatched.

        Only records that executed count: a graph that was captured but never replayed ran nothing, and an
        expectation that matches nothing executed is itself a mismatch, so a test cannot pass by not running.
        """
        out: list[str] = []
        for exp in self._expectations if expected is None else expected:
            ran = [r for r in self._records if exp.matches(r) and self.executions(r) > 0]
            if not ran:
                captured_only = any(exp.matches(r) for r in self._records)
                why = "was recorded only in graphs that were never replayed" if captured_only else "was recorded"
                out.append(f"no dispatch of {exp.selector()} {why}, but {exp.by} expected {exp.path}")
                continue
            for rec in ran:
                if rec.path != exp.path:
                    graph = f" [graph {rec.graph}, {self.executions(rec)} replays]" if rec.graph else ""
                    out.append(
                        f"{rec.where()} ran {rec.path} (reason: {rec.reason}){graph} "
                        f"but {exp.path} was expected by {exp.by}"
                    )
        return out

    # -- the join with device counters and profiler names ----------------------------------------------------

    def expected_launches(self, catalog: KernelCatalog) -> dict[str, list[tuple[str, int]]]:
        """Per kernel, the launches the records claim, split by where they come from (eager, or one graph)."""
        per_source: Counter[tuple[str, str, DispatchPath, bool]] = Counter()
        for rec in self._records:
            per_source[(rec.graph or "", rec.op, rec.path, rec.step in catalog.verify_steps)] += 1
        out: dict[str, list[tuple[str, int]]] = defaultdict(list)
        for (graph, op, path, verify), n in sorted(per_source.items()):
            runs = self._replays.get(graph, 0) if graph else 1
            what = f"{path} {op}" + (" verify" if verify else "")
            for kernel, per in catalog.launches_of(op, path, verify).items():
                if graph:
                    source = f"graph {graph}: {runs} replays x {n} {what} dispatches"
                else:
                    source = f"eager: {n} {what} dispatches"
                out[kernel].append((source + (f" x {per} launches" if per > 1 else ""), runs * n * per))
        for kernel in catalog.kernels():
            out.setdefault(kernel, [])
        return dict(out)

    def check_execution(self, catalog: KernelCatalog) -> list[str]:
        """Mismatches between the launches the records claim and the device counters and profiler names.

        Device counters must match exactly for every specialized kernel (audit builds count each launch) and for
        every kernel the counters report; a counted kernel no catalog entry launches is a mismatch too. Profiler
        names (often mangled) are matched by substring and checked for presence only, as a profiler window may
        cover part of the run.
        """
        claims = self.expected_launches(catalog)
        total = {k: sum(n for _, n in src) for k, src in claims.items()}

        def claim_text(kernel: str) -> str:
            parts = "; ".join(s for s, n in claims[kernel] if n) or "no dispatch launches it"
            return f"the ledger claims {total[kernel]} launches ({parts})"

        out: list[str] = []
        specialized = catalog.kernels("specialized")
        if self.device_counts is None:
            if claimed := sorted(k for k in specialized if total.get(k, 0) > 0):
                out.append(
                    f"no device execution counters were reported, so the specialized kernels {', '.join(claimed)} "
                    "cannot be shown to have run; run an audit build that reports them"
                )
        else:
            for kernel in sorted(set(self.device_counts) | specialized):
                want, got = total.get(kernel), self.device_counts.get(kernel)
                if want is None:
                    out.append(
                        f"kernel {kernel}: the device counters show {got} launches but no op in the catalog "
                        "launches it (an undeclared launch)"
                    )
                elif got is None:
                    if want > 0:
                        out.append(
                            f"kernel {kernel}: {claim_text(kernel)} but the device counters have no entry for it"
                        )
                elif got != want:
                    out.append(f"kernel {kernel}: {claim_text(kernel)} but the device counters show {got}")
        if self.profiler_kernels is not None:
            for kernel in sorted(total):
                seen = sum(n for name, n in self.profiler_kernels.items() if kernel in name)
                if total[kernel] > 0 and seen == 0:
                    out.append(f"kernel {kernel}: {claim_text(kernel)} but the profiler saw no kernel named like it")
                elif total[kernel] == 0 and seen > 0:
                    out.append(
                        f"kernel {kernel}: the profiler saw {seen} launches of kernels named like it but the ledger "
                        "claims none"
                    )
        return out

    # -- JSON ------------------------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "$schema": SCHEMA_ID,
            "records": [asdict(r) for r in self._records],
            "replays": dict(sorted(self._replays.items())),
            "expectations": [asdict(e) for e in self._expectations],
            "device_counts": self.device_counts,
            "profiler_kernels": self.profiler_kernels,
            "summary": self.summary(),
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Ledger:
        """Rebuild a ledger, validating the schema and re-deriving the summary from the records."""
        if problems := schema_problems(data):
            raise ValueError(f"dispatch ledger does not match ledger.schema.json: {problems[0]}")
        ledger = cls()
        ledger._records = [DispatchRecord(**r) for r in data["records"]]
        ledger._replays = dict(data["replays"])
        ledger._expectations = [Expectation(**e) for e in data["expectations"]]
        if data["device_counts"] is not None:
            ledger.report_device_counts(data["device_counts"])
        if data["profiler_kernels"] is not None:
            ledger.report_profiler_kernels(data["profiler_kernels"])
        if stray := sorted(set(ledger._replays) - {r.graph for r in ledger._records}):
            raise ValueError(f"dispatch ledger replays graphs {stray} that no record was captured in")
        if ledger.summary() != data["summary"]:
            raise ValueError("dispatch ledger summary does not match its records (edited?); regenerate the ledger")
        return ledger


def count_delta(before: Mapping[str, int] | None, after: Mapping[str, int] | None) -> dict[str, int] | None:
    """Device-counter launches between two readings (`after` None: no counters to report)."""
    if after is None:
        return None
    return {k: n - (before or {}).get(k, 0) for k, n in after.items()}


class _Tally:
    def __init__(self) -> None:
        self.total = 0
        self.by_path: Counter[str] = Counter()
        self.by_op: defaultdict[str, Counter[str]] = defaultdict(Counter)
        self.by_reason: Counter[str] = Counter()

    def add(self, rec: DispatchRecord, n: int) -> None:
        self.total += n
        self.by_path[rec.path] += n
        self.by_op[rec.op][rec.path] += n
        self.by_reason[rec.reason] += n

    def as_dict(self) -> dict[str, Any]:
        return {
            "total": self.total,
            "by_path": {p: self.by_path[p] for p in PATHS},
            "by_op": {op: {p: c[p] for p in PATHS} for op, c in sorted(self.by_op.items())},
            "by_reason": {r: n for r, n in sorted(self.by_reason.items()) if n},
        }


def _counts(counts: Mapping[str, int], what: str) -> dict[str, int]:
    bad = {k: v for k, v in counts.items() if not (isinstance(k, str) and k and isinstance(v, int) and v >= 0)}
    if bad:
        raise ValueError(f"{what} must map kernel names to launch counts >= 0; bad entries {bad}")
    return dict(counts)


@cache
def ledger_schema() -> dict[str, Any]:
    return json.loads(resources.files(__package__).joinpath("ledger.schema.json").read_text())


def schema_problems(data: Any) -> list[str]:
    """Schema violations as one-liners `path: message`; empty when valid."""
    validator = jsonschema.Draft202012Validator(ledger_schema())
    out = []
    for err in sorted(validator.iter_errors(data), key=lambda e: list(map(str, e.absolute_path))):
        where = "/".join(str(p) for p in err.absolute_path) or "(top level)"
        out.append(f"{where}: {err.message}")
    return out
