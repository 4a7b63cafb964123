"""The k3-hopper runtime isolation suite: the stack executor's steps under the write-set audit and proof of path.

For each TP size of the config and each decode backend of the data file (`isolation_suite.toml`), one executor of a
small real stack (k3-mini on the CPU, K3's real per-rank shapes on CUDA) runs the suite's cells:

- Write sets. Every step (and every graph capture) runs under the audit (k3_decode.executor.audit): every tensor
  the executor owns — weights, every KDA state slot, every MLA cache page, every step buffer — is compared before
  and after, and any change outside the step's declared write set is a failed check naming the tensor and the
  index range. Weights are never in a write set, so they must stay bit-identical.
- Proof of path. Each cell declares the path it expects (ledger Expectations); the ledger must show it, with no
  unexpected fallback. What really ran is checked twice over, independently of the ledger: the executor's op log
  (each routed call and the stock ops or provider it ran) must agree with every record, and a probe watches every
  provider call for code of the stock packages. On CUDA the kernel names torch.profiler sees in the graph's replays
  must include every kernel its records claim, and specialized kernels' device-side counters (audit builds) must
  match the launches the ledger claims.
- Verify steps. They reach the KDA verify kernels only on a speculative stack (q KDA slots per request, a conv row
  with the speculative columns), so when the data file has a [speculative] table each (TP, backend) also runs the
  same stack built with its speculative tokens ("<run> q<q>"), through its own cells: a prefill, then verify steps
  with varied accepted counts, each under the same audit and proof of path.
- What cannot run here is reported as not run, with the reason: the specialized path while no provider is
  registered (its kernels are not built) or outside its scope (the CPU), CUDA graphs and profiler kernel names on
  the CPU, device counters where no specialized kernel ran.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import tempfile
import time
import tomllib
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import torch

from harness.isolation.runtime import NotRun, ProgressFn, RunEvidence, RuntimeEvidence, StepWrites
from harness.verdicts import Check
from k3_decode.executor import StackConfig, StackExecutor, StepRequest, load_stack, random_input
from k3_decode.executor.attribution import device_events
from k3_decode.executor.audit import (
    METHODS,
    AuditedCapture,
    AuditedStep,
    Method,
    StockCodeProbe,
    audit_capture,
    audit_step,
    op_log_mismatches,
)
from k3_decode.runtime.audit import Change
from k3_decode.runtime.backend import BACKENDS, PROVIDERS, ProviderRegistry
from k3_decode.runtime.errors import StartupError
from k3_decode.runtime.ledger import Expectation, Ledger, count_delta
from k3_decode.runtime.optable import OpTable
from k3_decode.runtime.scopefile import RuntimeScope
from k3_decode.runtime.writeset import WriteSet
from k3_decode.weights import LayerWeights, SyntheticWeights

CellKind = Literal["prefill", "decode", "mixed", "graph", "verify"]
CELL_KINDS: tuple[CellKind, ...] = ("prefill", "decode", "mixed", "graph", "verify")
SPECULATIVE_KINDS: tuple[CellKind, ...] = ("prefill", "verify")  # the steps a speculative stack runs
EXPECTS = ("stock", "selected")
DETAIL_ITEMS = 3  # mismatches named in a check's detail


class SuiteDataError(ValueError):
    """isolation_suite.toml is malformed; the message names the key and the fix."""


@dataclass(frozen=True)
class Cell:
    name: str
    kind: CellKind
    expect: str  # "stock" or "selected" (the backend's path)
    prefill: Mapping[int, int] = field(default_factory=dict)  # request -> context tokens
    decode: tuple[int, ...] = ()  # requests decoding one token
    replays: int = 1  # graph cells: audited replays
    verify: tuple[int, ...] = ()  # verify cells: requests verifying q tokens each
    accepted: tuple[int, ...] = ()  # verify cells: each one's num_accepted (tokens its previous verify accepted)


@dataclass(frozen=True)
class Speculative:
    """The speculative runs: the suite's stack with `num_speculative_tokens`, through its own cells."""

    num_speculative_tokens: int
    cells: tuple[Cell, ...]


@dataclass(frozen=True)
class SuiteData:
    stacks: Mapping[str, str]
    stack: Mapping[str, Any]  # load_stack overrides
    audit: Mapping[str, Method]  # device kind -> audit method
    stock_packages: tuple[str, ...]
    backends: tuple[str, ...]
    cells: tuple[Cell, ...]
    speculative: Speculative | None = None


def _cell(raw: Any, i: int, table: str = "cells", kinds: tuple[CellKind, ...] = CELL_KINDS) -> Cell:
    where = f"isolation_suite.toml {table}[{i}]"
    if not isinstance(raw, dict):
        raise SuiteDataError(f"{where} must be a table; write [[{table}]] blocks")
    known = {"name", "kind", "expect", "prefill", "decode", "replays", "verify", "accepted"}
    if extra := sorted(set(raw) - known):
        raise SuiteDataError(f"{where}: unknown keys {extra}; use {sorted(known)}")
    kind, expect = raw.get("kind"), raw.get("expect")
    if kind not in kinds:
        raise SuiteDataError(f"{where}: kind {kind!r} is not one of {list(kinds)}")
    if expect not in EXPECTS:
        raise SuiteDataError(f"{where}: expect {expect!r} is not one of {list(EXPECTS)}")
    try:
        prefill = {int(r): int(n) for r, n in raw.get("prefill", {}).items()}
    except (AttributeError, ValueError):
        raise SuiteDataError(f'{where}: prefill must map request ids to token counts, e.g. {{ "0" = 3 }}') from None
    decode = tuple(raw.get("decode", ()))
    verify, accepted = tuple(raw.get("verify", ())), tuple(raw.get("accepted", ()))
    needs = {
        "prefill": (True, False, False),
        "decode": (False, True, False),
        "mixed": (True, True, False),
        "graph": (False, True, False),
        "verify": (False, False, True),
    }[kind]
    if (bool(prefill), bool(decode), bool(verify)) != needs:
        raise SuiteDataError(
            f"{where}: a {kind} cell needs prefill {needs[0]}, decode {needs[1]} and verify {needs[2]}; fix them"
        )
    if len(accepted) != len(verify) or not all(isinstance(a, int) and a >= 1 for a in accepted):
        raise SuiteDataError(f"{where}: accepted must give one count >= 1 per verify request; fix it")
    if kind != "graph" and "replays" in raw:
        raise SuiteDataError(f"{where}: replays applies to graph cells only; drop it")
    replays = raw.get("replays", 1)
    if not isinstance(replays, int) or replays < 1:
        raise SuiteDataError(f"{where}: replays must be an integer >= 1, got {replays!r}")
    return Cell(str(raw.get("name") or f"cell{i}"), kind, expect, prefill, decode, replays, verify, accepted)


def _speculative(raw: Any) -> Speculative | None:
    if raw is None:
        return None
    where = "isolation_suite.toml [speculative]"
    if not isinstance(raw, dict) or sorted(raw) != ["cells", "num_speculative_tokens"]:
        raise SuiteDataError(f"{where} needs exactly num_speculative_tokens and [[speculative.cells]]")
    k = raw["num_speculative_tokens"]
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise SuiteDataError(f"{where}: num_speculative_tokens must be an integer >= 1, got {k!r}")
    cells = tuple(_cell(c, i, "speculative.cells", SPECULATIVE_KINDS) for i, c in enumerate(raw["cells"]))
    if not any(c.kind == "verify" for c in cells):
        raise SuiteDataError(f"{where} has no verify cell; add one (the speculative runs exist to run verify steps)")
    return Speculative(k, cells)


def parse_data(raw: Mapping[str, Any]) -> SuiteData:
    audit = dict(raw.get("audit", {}))
    if bad := {k: v for k, v in audit.items() if v not in METHODS}:
        raise SuiteDataError(f"isolation_suite.toml [audit]: methods {bad} are not among {list(METHODS)}")
    if sorted(audit) != ["cpu", "cuda"]:
        raise SuiteDataError("isolation_suite.toml [audit] must name a method for cpu and for cuda")
    backends = tuple(raw.get("backends", ()))
    if not backends or any(b not in BACKENDS for b in backends):
        raise SuiteDataError(f"isolation_suite.toml backends {list(backends)} must be decode backends of {BACKENDS}")
    kinds = tuple(k for k in CELL_KINDS if k != "verify")  # verify steps run on the speculative stack only
    cells = tuple(_cell(c, i, kinds=kinds) for i, c in enumerate(raw.get("cells", [])))
    if not cells:
        raise SuiteDataError("isolation_suite.toml has no [[cells]]; add at least one")
    return SuiteData(
        stacks=dict(raw["stacks"]),
        stack=dict(raw.get("stack", {})),
        audit=audit,
        stock_packages=tuple(raw["stock_packages"]),
        backends=backends,
        cells=cells,
        speculative=_speculative(raw.get("speculative")),
    )


@cache
def suite_data() -> SuiteData:
    return parse_data(tomllib.loads(resources.files("k3_decode").joinpath("isolation_suite.toml").read_text()))


# -- what a step wrote, in words ----------------------------------------------------------------------------------


def _ranges(values: Sequence[int]) -> str:
    runs: list[list[int]] = []
    for v in sorted(set(values)):
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


def describe_writes(declared: WriteSet, changes: Sequence[Change]) -> str:
    """'KDA slots 1-2 of layers 4-6; MLA cache (page, row) (1, 0) of layer 7; step buffers of eager; nothing else
    changed': the declared write set of a step, and what the audit found outside it."""
    kda_slots: set[int] = set()
    kda_layers: set[int] = set()
    mla_rows: set[tuple[int, int]] = set()
    mla_layers: set[int] = set()
    scratch: set[str] = set()
    for region in declared.regions:
        parts = region.tensor.split(".")
        if parts[0] == "layers" and parts[2] == "kda" and region.index and region.index[0]:
            kda_slots.add(region.index[0][0])
            kda_layers.add(int(parts[1]))
        elif parts[0] == "layers" and parts[2] == "mla" and len(region.index) >= 2:
            page, row = region.index[0], region.index[1]
            if page is not None and row is not None:
                mla_rows.add((page[0], row[0]))
                mla_layers.add(int(parts[1]))
        elif parts[0] == "scratch":
            scratch.add(".".join(parts[1:-1]))
    out = []
    if kda_slots:
        noun = "layer" if len(kda_layers) == 1 else "layers"
        slots = "slot" if len(kda_slots) == 1 else "slots"
        out.append(f"KDA {slots} {_ranges(list(kda_slots))} of {noun} {_ranges(list(kda_layers))}")
    if mla_rows:
        rows = ", ".join(f"({p}, {r})" for p, r in sorted(mla_rows))
        noun = "layer" if len(mla_layers) == 1 else "layers"
        out.append(f"MLA cache (page, row) {rows} of {noun} {_ranges(list(mla_layers))}")
    if scratch:
        out.append(f"step buffers of {', '.join(sorted(scratch))}")
    wrote = "; ".join(out) or "nothing declared"
    if not changes:
        return f"{wrote}; nothing else changed"
    listed = "; ".join(str(c) for c in changes[:DETAIL_ITEMS])
    more = f" and {len(changes) - DETAIL_ITEMS} more" if len(changes) > DETAIL_ITEMS else ""
    return f"{wrote}; ALSO CHANGED outside the write set: {listed}{more}"


def _listed(items: Sequence[str]) -> str:
    more = f"; and {len(items) - DETAIL_ITEMS} more" if len(items) > DETAIL_ITEMS else ""
    return "; ".join(items[:DETAIL_ITEMS]) + more


# -- one run: one executor through every cell ----------------------------------------------------------------------


class _Run:
    """One executor (one TP size, one backend) through the cells, collecting checks, not-run items and writes."""

    def __init__(self, name: str, ex: StackExecutor, probe: StockCodeProbe, method: Method, tp: int) -> None:
        self.name, self.ex, self.probe, self.method, self.tp = name, ex, probe, method, tp
        self.checks: list[Check] = []
        self.not_run: list[NotRun] = []
        self.writes: list[StepWrites] = []
        self.cells: dict[int, str] = {}
        self.weight_changes: list[str] = []
        self.weights = {f"layers.{i}.{n}" for i, w in ex.weights.items() for n in w.tensors()}
        self.counts_at_start = ex.device_counts()

    @property
    def specialized(self) -> bool:
        return self.ex.planner.backend == "latency_specialized"

    def _inputs(
        self, cell: Cell, requests: Mapping[int, int], prefill: bool, accepted: Mapping[int, int] | None = None
    ) -> list[StepRequest]:
        seed = zlib.crc32(f"{cell.name}/{self.tp}/{len(self.writes)}".encode()) & 0x7FFFFFFF
        first = self.ex.config.layers[0]
        return [
            StepRequest(
                r,
                random_input(self.ex.dims, first, n, seed + r, self.ex.device),
                prefill=prefill,
                num_accepted=None if accepted is None else accepted[r],
            )
            for r, n in requests.items()
        ]

    def _expectations(self, cell: Cell, step: int) -> list[Expectation]:
        by = f"isolation cell {cell.name} ({self.name})"
        if cell.expect == "stock" or not self.specialized:
            return [Expectation("stock", by=by, step=step)]
        if cell.kind == "graph":
            rows = max(self.ex.config.graph_batches)
        elif cell.kind == "verify":
            rows = len(cell.verify) * self.ex.config.tokens_per_request
        else:
            rows = len(cell.decode)
        limits = self.ex.registry.row_limits(self.ex.config.tp)
        layer_limits = self.ex.registry.layer_row_limits(self.ex.config.tp, self.ex.dims, self.ex.config.layers)
        kept = self.ex.planner.op_stock
        paths = self.ex.planner.table.expected_paths(
            self.ex.dims, self.ex.config.layers, rows, limits, kept, layer_limits
        )
        return [Expectation(path, by=by, op=op, layer=layer, step=step) for (layer, op), path in paths.items()]

    def _audited(self, cell: Cell, audited: AuditedStep | AuditedCapture, step: int, graph: str | None) -> None:
        if isinstance(audited, AuditedCapture):
            what = f"capture of graph {audited.graph}"
        elif graph is not None:
            what = f"replay of graph {graph} at step {audited.result.step}"
        else:
            what = f"step {step}"
        claim = "nothing changed outside the declared write set"
        if audited.changes:
            # A failed check names the first change, so the verdict's reason names the tensor and index range.
            first = str(audited.changes[0]).split(": ", 1)[0]
            more = f" (and {len(audited.changes) - 1} more)" if len(audited.changes) > 1 else ""
            claim = f"{first}{more} changed outside the declared write set"
        self.checks.append(
            Check(f"{self.name} {cell.name} {what}: {claim}", len(audited.changes), "==", 0, audited.summary())
        )
        self.weight_changes += [str(c) for c in audited.changes if c.tensor in self.weights]
        if isinstance(audited, AuditedStep):
            self.writes.append(StepWrites(step, graph, cell.name, describe_writes(audited.declared, audited.changes)))

    def _expect(self, cell: Cell, steps: Sequence[int]) -> None:
        expectations = [e for s in steps for e in self._expectations(cell, s)]
        self.ex.ledger.expect(*expectations)
        mismatches = self.ex.ledger.check(expectations)
        path = "stock" if cell.expect == "stock" or not self.specialized else "specialized (where the op table says)"
        self.checks.append(
            Check(
                f"{self.name} {cell.name}: the dispatch ledger shows the expected {path} path",
                len(mismatches),
                "==",
                0,
                _listed(mismatches),
            )
        )

    def eager(self, cell: Cell) -> None:
        requests = self._inputs(cell, cell.prefill, prefill=True) + self._inputs(
            cell, dict.fromkeys(cell.decode, 1), prefill=False
        )
        if cell.verify:
            q = self.ex.config.tokens_per_request
            accepted = dict(zip(cell.verify, cell.accepted, strict=True))  # parse_data checked the lengths
            requests += self._inputs(cell, dict.fromkeys(cell.verify, q), False, accepted)
        audited = audit_step(self.ex, requests, method=self.method)
        step = audited.result.step
        self.cells[step] = cell.name
        self._audited(cell, audited, step, None)
        self._expect(cell, [step])

    def graph(self, cell: Cell, profile: bool) -> None:
        """Capture under the audit, then audited replays; with `profile`, the kernel names seen in those replays
        checked against the launches the graph's records claim."""
        captured = audit_capture(self.ex, max(self.ex.config.graph_batches), method=self.method)
        name = captured.graph
        records = self.ex.ledger.records()
        steps = sorted({r.step for r in records if r.graph == name})
        warm = sorted({r.step for r in records if r.graph is None and r.step == steps[0] - 1})  # its eager warm-up
        for s in warm + steps:
            self.cells[s] = cell.name
        self._audited(cell, captured, steps[0], name)
        before = self.ex.device_counts()
        with _profiled(profile) as kernels:
            for _ in range(cell.replays):
                requests = self._inputs(cell, dict.fromkeys(cell.decode, 1), prefill=False)
                audited = audit_step(self.ex, requests, mode="graph", method=self.method)
                self._audited(cell, audited, steps[0], name)
        self._expect(cell, warm + steps)
        if profile:
            self._kernel_names(cell, name, kernels, count_delta(before, self.ex.device_counts()), cell.replays)

    def _kernel_names(
        self, cell: Cell, graph: str, kernels: Mapping[str, int], counts: Mapping[str, int] | None, replays: int
    ) -> None:
        """The graph's records, replayed as often as profiled, against the kernel names the profiler saw (and the
        device counters' launches in the same window, where the providers report them)."""
        window = Ledger()
        window.record(*[r for r in self.ex.ledger.records() if r.graph == graph])
        window.replayed(graph, replays)
        window.report_profiler_kernels(kernels)
        if counts is not None:
            window.report_device_counts(counts)
        mismatches = window.check_execution(self.ex.kernel_catalog())
        self.checks.append(
            Check(
                f"{self.name} {cell.name}: the kernels graph {graph}'s records claim ran in its {replays} replays "
                "(torch.profiler kernel names" + (", device counters)" if counts is not None else ")"),
                len(mismatches),
                "==",
                0,
                # The window holds the audit's own hashing kernels too; the join checks presence, not counts.
                _listed(mismatches) or f"{sum(kernels.values())} kernel launches seen, the audit's hashing included",
            )
        )

    def _counters(self) -> None:
        """CUDA: the specialized kernels' device-side counters over the whole run against the ledger's claims."""
        counts = count_delta(self.counts_at_start, self.ex.device_counts())
        specialized = self.ex.ledger.summary()["dispatches"]["by_path"]["specialized"]
        if counts is None and not specialized:
            self.not_run.append(
                NotRun(
                    "device-side execution counters",
                    "no specialized kernel ran in this run, and the stock path's public kernels carry no counters",
                )
            )
            return
        whole = Ledger.from_json(self.ex.ledger.to_json())
        if counts is not None:
            whole.report_device_counts(counts)
        mismatches = whole.check_execution(self.ex.kernel_catalog())
        self.checks.append(
            Check(
                f"{self.name}: device-side execution counters match the launches the ledger claims",
                len(mismatches),
                "==",
                0,
                _listed(mismatches),
            )
        )

    def finish(self) -> None:
        ex = self.ex
        if ex.device.type == "cuda":
            self._counters()
        self.checks.append(
            Check(
                f"{self.name}: weights bit-identical after every step",
                len(self.weight_changes),
                "==",
                0,
                _listed(self.weight_changes) or f"{len(self.weights)} weight tensors compared around every step",
            )
        )
        op_log = op_log_mismatches(ex)
        claim = "every op the executor ran is the path its ledger records (op log)"
        if op_log:
            claim = f"the op log disagrees with the ledger, first at {op_log[0].split(':', 1)[0]}"
        self.checks.append(
            Check(
                f"{self.name}: {claim}",
                len(op_log),
                "==",
                0,
                _listed(op_log) or f"{len(ex.op_log)} logged calls joined with {len(ex.ledger.records())} records",
            )
        )
        if self.probe.watched:
            found = self.probe.mismatches()
            claim = f"no stock code ran inside the {self.probe.watched} specialized provider calls"
            if found:
                claim = f"stock code ran inside specialized provider calls, first at {found[0].split(':', 1)[0]}"
            self.checks.append(Check(f"{self.name}: {claim}", len(found), "==", 0, _listed(found)))
        problems: list[str] = []
        try:
            Ledger.from_json(json.loads(ex.ledger.dumps()))
        except ValueError as exc:
            problems.append(str(exc))
        self.checks.append(
            Check(f"{self.name}: dispatch ledger valid (schema, summary)", len(problems), "==", 0, _listed(problems))
        )

    def evidence(self) -> RunEvidence:
        return RunEvidence(self.name, self.ex.ledger.to_json(), list(self.writes), dict(self.cells))


class _profiled:
    """torch.profiler over CUDA activity while the block runs, when `on`; the mapping it yields is filled with the
    kernel names it saw (and their launches) when the block ends."""

    def __init__(self, on: bool) -> None:
        self.on = on
        self.kernels: dict[str, int] = {}
        self._prof: Any = None

    def __enter__(self) -> dict[str, int]:
        if self.on:
            self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            self._prof.__enter__()
        return self.kernels

    def __exit__(self, *exc: Any) -> None:
        if self._prof is None:
            return
        torch.cuda.synchronize()
        self._prof.__exit__(*exc)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "trace.json"
            self._prof.export_chrome_trace(str(path))
            trace = json.loads(path.read_text())
        for e in device_events(trace):
            if e.category == "kernel":
                self.kernels[e.name] = self.kernels.get(e.name, 0) + 1


# -- the suite -------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _timed(into: dict[str, Any], key: str) -> Iterator[None]:
    """Adds the wall-clock seconds of the block to `into[key]` (rounded to milliseconds), even when it raises."""
    start = time.perf_counter()
    try:
        yield
    finally:
        into[key] = round(into.get(key, 0.0) + time.perf_counter() - start, 3)


def _merge(items: Sequence[tuple[str, NotRun]]) -> list[NotRun]:
    """One not-run item per (what, reason), naming every run it holds for."""
    runs: dict[tuple[str, str], list[str]] = {}
    for run, item in items:
        runs.setdefault((item.name, item.reason), []).append(run)
    return [NotRun(f"{', '.join(names)}: {what}", reason) for (what, reason), names in runs.items()]


class K3IsolationSuite:
    def __init__(
        self,
        subject: str,
        model: str,
        tps: Sequence[int],
        device: str,
        *,
        registry: ProviderRegistry = PROVIDERS,
        table: OpTable | None = None,
        scope: RuntimeScope | None = None,
        backends: Sequence[str] | None = None,
        data: SuiteData | None = None,
        distributed: bool = False,
    ) -> None:
        """`registry`, `table`, `scope`: the shipped runtime unless a red-team case starts a private deployment.
        `distributed`: the config asks for real tensor parallelism, which this suite does not audit (it says so)."""
        self.data = data or suite_data()
        if model not in self.data.stacks:
            raise SuiteDataError(f"isolation_suite.toml [stacks] names no stack for model {model!r}; add one")
        self.subject, self.model, self.tps = subject, model, tuple(tps)
        self.device = torch.device(device)
        self.registry, self.table, self.scope = registry, table, scope
        self.backends = tuple(backends or self.data.backends)
        self.method = self.data.audit[self.device.type]
        self.distributed = distributed

    @classmethod
    def from_config(cls, subject: str, config: Any) -> K3IsolationSuite:
        device = "cpu" if config.hardware["gpu"] == "none" else "cuda"
        distributed = config.data["parallel"].get("mode") == "distributed"
        return cls(
            subject, config.data.get("model", "k3"), config.data["parallel"]["tp"], device, distributed=distributed
        )

    def _config(self, tp: int) -> StackConfig:
        return load_stack(self.data.stacks[self.model], tp, **self.data.stack)

    def _weights(self, config: StackConfig) -> dict[int, LayerWeights]:
        gen = SyntheticWeights(config.dims, config.tp, config.rank, seed=config.seed, device=self.device)
        return {i: gen.layer(i) for i in config.layers}

    def run(self, progress: ProgressFn) -> RuntimeEvidence:
        if self.device.type == "cuda" and not torch.cuda.is_available():
            return RuntimeEvidence([], [], [], unavailable="the config runs on CUDA but torch sees no CUDA device here")
        checks: list[Check] = []
        not_run: list[tuple[str, NotRun]] = []
        runs: list[RunEvidence] = []
        total = len(self.tps) * len(self.backends)
        # Where the stage's time goes (seconds, wall clock under the coverage trace): building each TP's weights,
        # and per run its start-up (compiles), each cell and the closing checks; at real shapes on a GPU the stage
        # takes minutes, and this says which part to make faster.
        seconds: dict[str, Any] = {}
        for t, tp in enumerate(self.tps):
            config = self._config(tp)
            with _timed(seconds, f"weights tp{tp}"):
                weights = self._weights(config)
            for b, backend in enumerate(self.backends):
                name = f"tp{tp} {backend}"
                progress(name, (t * len(self.backends) + b) / total)
                plans = [(name, config, self.data.cells)]
                if (spec := self.data.speculative) is not None:
                    q = 1 + spec.num_speculative_tokens
                    verify_config = dataclasses.replace(config, num_speculative_tokens=spec.num_speculative_tokens)
                    plans.append((f"{name} q{q}", verify_config, spec.cells))
                for run_name, run_config, cells in plans:
                    times = seconds[run_name] = {"cells": {}}
                    with _timed(times, "start"):
                        run = self._start(run_name, run_config, weights, backend, not_run)
                    if run is None:
                        continue
                    for cell in cells:
                        with _timed(times["cells"], cell.name):
                            self._cell(run, cell, not_run)
                    with _timed(times, "finish"):
                        run.finish()
                    checks += run.checks
                    not_run += [(run_name, item) for item in run.not_run]
                    runs.append(run.evidence())
        if self.distributed:
            not_run.append(
                (
                    "every run",
                    NotRun(
                        "the audit across tensor-parallel ranks",
                        "this suite audits one rank's shard on one device (rank 0 at the config's TP shapes); "
                        "auditing every rank of the distributed executor (k3_decode.distributed) is not built",
                    ),
                )
            )
        if self.device.type != "cuda":
            not_run.append(
                (
                    "every run",
                    NotRun(
                        "device-side execution counters and profiler kernel names",
                        "the CPU has neither; there the proof of path is the ledger, the op log and the stock-code "
                        "probe",
                    ),
                )
            )
        metrics = {
            "subject": self.subject,
            "device": str(self.device),
            "stack": self.data.stacks[self.model],
            "tp": list(self.tps),
            "backends": list(self.backends),
            "audit_method": self.method,
            "cells": [c.name for c in self.data.cells],
            "speculative_cells": [c.name for c in self.data.speculative.cells] if self.data.speculative else [],
            "providers": sorted(f"{p.op}: {p.name}" for p in self.registry),
            "seconds": seconds,
        }
        return RuntimeEvidence(checks, _merge(not_run), runs, metrics)

    def _start(
        self,
        name: str,
        config: StackConfig,
        weights: Mapping[int, LayerWeights],
        backend: str,
        not_run: list[tuple[str, NotRun]],
    ) -> _Run | None:
        probe = StockCodeProbe(self.data.stock_packages)
        try:
            ex = StackExecutor.start(
                config,
                {"decode_backend": backend},
                device=self.device,
                weights=weights,
                registry=self.registry,
                scope=self.scope,
                table=self.table,
                provider_guard=probe.watch,
                log=lambda line: None,
            )
        except StartupError as exc:
            not_run.append((name, NotRun("every cell", f"start-up refuses decode_backend {backend!r} here: {exc}")))
            return None
        return _Run(name, ex, probe, self.method, config.tp)

    def _cell(self, run: _Run, cell: Cell, not_run: list[tuple[str, NotRun]]) -> None:
        if cell.kind != "graph":
            run.eager(cell)
            return
        if self.device.type != "cuda":
            not_run.append(
                (run.name, NotRun(f"{cell.name} cell", "CUDA graphs need a CUDA device; this run is on the CPU"))
            )
            return
        run.graph(cell, profile=True)


__all__ = ["Cell", "K3IsolationSuite", "SuiteData", "SuiteDataError", "describe_writes", "parse_data", "suite_data"]
