"""The k3-hopper perf suite: two decode backends on the stack executor, cell by cell of the perf sweep.

Each arm is its own StackExecutor (its own request state, ledger and CUDA graphs) over the same synthetic weights:
the baseline starts with `perf.baseline_backend` (normally "auto", the stock path) and the candidate with
`perf.candidate_backend`. In this build `latency_specialized` is not built and start-up refuses it, so the
candidate arm runs the stock path too and says so in every record: its ratio is ~1 by construction and exercises
only the plumbing and the verdict logic.

- Timing. A sample is several steps back to back (harness/perf/timing.py chooses how many). On a GPU, a decode
  cell replays the arm's CUDA graph of the stack, as vLLM replays a FULL graph for uniform decode and verify
  batches; mixed steps are not captured, so they run eagerly. A verify cell of q tokens per request runs on a
  speculative stack of its own (q - 1 speculative tokens, the same weights): each step is one verify iteration over
  B x q rows, the KDA layers through the verify kernels, captured as the executor's verify graph of B requests;
  every run reads the state of one accepted token. (Run eagerly, as before, a verify step is bound by the host's
  launches: the H200 perf run timed the candidate's 8.3 ms eager step 11% slower than stock's 7.6 ms while its
  kernels were 5% faster, a Python launch cost no deployment pays.) Both are timed by CUDA events with one host
  sync per sample: an eager step is host-launch bound, and the events see the host's launch time as the gaps it
  leaves on the stream. With the L2 flush on, each step has its own pair of events and the flush is enqueued before
  the start event. CPU steps are timed by the process's CPU time, not the wall clock: other processes on a shared
  machine then cannot stretch one arm's run. Timed steps do not advance any request: a replay rewrites the same cache
  row, and an eager step's context lengths (and a verify step's unconfirmed tokens) are put back after it, so every
  run of a cell does the same work.
- Per-layer time and launches. GPU graph cells: one CUDA graph per layer, timed like the stack (the mean of
  `[profile] graph_replays` replays after an untimed one: single replays of a 0.25 ms layer graph varied by 10-20%
  between profiled runs on the H200, enough to fail the Amdahl check of an A/A run), its launches counted by
  torch.profiler. GPU eager cells: torch.profiler with the executor's per-op ranges (kernels attributed to the
  layer that launched them). CPU: the host clock at each layer boundary (the profiler would cost more than the step
  it measures; the last layer of an iteration also carries the host work after it).
- Bytes. The least HBM traffic of one decode iteration of the cell's decode rows (k3_decode.executor.roofline),
  with the distinct experts those rows route to in a traced step. For mixed and verify steps this is a lower
  bound (their extra tokens add traffic), which keeps a roofline fraction above 1 a measurement error.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import time
import tomllib
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from harness.perf.bandwidth import copy_bandwidth
from harness.perf.plan import Cell, PerfConfigError, Settings, parse
from harness.perf.suite import Bandwidth, PartProfile, PathReport, PreparedCell, StepProfile, SuiteInfo
from k3_decode.executor import StackConfig, StackExecutor, StepRequest, load_stack, random_input
from k3_decode.executor.attribution import device_events, kernels_by_range
from k3_decode.executor.roofline import StepShape, layer_bytes
from k3_decode.runtime.backend import BACKENDS, PROVIDERS, ProviderRegistry, select_backend
from k3_decode.runtime.errors import BackendError
from k3_decode.runtime.ledger import Expectation, count_delta
from k3_decode.runtime.optable import OpTable, load_op_table
from k3_decode.runtime.scopefile import RuntimeScope
from k3_decode.runtime.startup import register_providers
from k3_decode.weights import LayerWeights, SyntheticWeights

STEP_RANGE = "k3perf.step"
TTFT = (
    "not measured: the in-process executor has no request arrival or scheduler, so there is no first token to "
    "wait for; time to first token belongs to the vLLM subject's serving benchmark"
)


@dataclass(frozen=True)
class PerfData:
    stacks: dict[str, str]  # model -> stack of k3_decode/executor/stacks.toml
    flush_bytes: dict[str, int]  # device kind -> bytes
    copy_bytes: dict[str, int]
    graph_profile_replays: int  # replays averaged per layer graph (and the stack's) in one profiled run


@cache
def perf_data() -> PerfData:
    raw = tomllib.loads(resources.files("k3_decode").joinpath("perf.toml").read_text())
    dev = raw["device"]
    return PerfData(
        dict(raw["stacks"]),
        {k: v["flush_bytes"] for k, v in dev.items()},
        {k: v["copy_bytes"] for k, v in dev.items()},
        int(raw["profile"]["graph_replays"]),
    )


@dataclass(frozen=True)
class ArmBackend:
    requested: str  # the config's decode_backend for the arm
    started: str  # what the arm's executor starts with
    expected: str  # the dispatch path its ledger must show
    note: str = ""  # why `started` differs from `requested`


def resolve_backend(
    key: str, requested: str, table: OpTable | None = None, registry: ProviderRegistry = PROVIDERS
) -> ArmBackend:
    """The backend an arm starts with. `latency_specialized` that this build cannot run (its kernels are not built)
    runs the stock path instead, with the reason in `note`; any other refusal is the config's error."""
    if requested not in BACKENDS:
        raise PerfConfigError(f"{key}: {requested!r} is not a decode backend — use one of {', '.join(BACKENDS)}")
    table = table or load_op_table()
    try:
        select_backend({"decode_backend": requested}, table, registry, not_built=register_providers(registry))
    except BackendError as exc:
        if requested == "latency_specialized" and (registry.missing(table) or not table.specialized_ops()):
            return ArmBackend(
                requested,
                "auto",
                "stock",
                f"decode_backend 'latency_specialized' is not built here (start-up refuses it: {exc}), so this arm "
                "runs the stock path",
            )
        raise
    return ArmBackend(requested, requested, "stock" if requested == "auto" else "specialized")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _chrome_trace(prof: Any) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_text())


def _profiler(device: torch.device) -> Any:
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    return torch.profiler.profile(activities=acts if device.type == "cuda" else acts[:1])


def _seed(cell: Cell) -> int:
    """The same inputs for both arms of a cell (so they route alike), different ones for different cells."""
    return zlib.crc32(cell.id.encode()) & 0x7FFFFFFF


class K3Arm:
    """One arm of one cell: its executor set up for the cell's requests and context."""

    def __init__(
        self,
        name: str,
        backend: ArmBackend,
        ex: StackExecutor,
        cell: Cell,
        graph: bool,
        flush: torch.Tensor | None,
        part_bytes: dict[int, int],
        kernels: Counter[str],  # profiler kernel names of this cell's profiles (filled by profile())
    ) -> None:
        self.name, self.arm_backend, self.ex, self.cell = name, backend, ex, cell
        self.backend = backend.requested if not backend.note else f"{backend.requested} (ran {backend.started})"
        self.device, self.dims = ex.device, ex.dims
        # See the module doc: GPU work is not this process's CPU time, CPU work is (and a neighbour's load is not).
        self.clock = time.perf_counter if self.device.type == "cuda" else time.process_time
        self.flush_buffer, self.part_bytes, self.kernels = flush, part_bytes, kernels
        seed = _seed(cell)
        decode = list(range(cell.batch))
        ex.state.fill_synthetic(decode, cell.context, seed=seed)
        first = ex.config.layers[0]
        q = cell.tokens_per_request
        entry = random_input(self.dims, first, cell.batch * q, seed, self.device)
        # On the cell's speculative stack a verify step says how many tokens the previous one accepted: one, since
        # every run starts where fill_synthetic put the request (_restore), as the first verify after a prefill.
        accepted = 1 if ex.config.tokens_per_request > 1 else None
        self.requests = [StepRequest(r, entry.rows(slice(r * q, (r + 1) * q)), num_accepted=accepted) for r in decode]
        if cell.workload == "mixed":
            assert cell.prefill_tokens is not None  # the plan requires it for mixed sweeps
            ex.state.fill_synthetic([cell.batch], 0, seed=seed + 1)  # a new prompt: its first chunk
            chunk = random_input(self.dims, first, cell.prefill_tokens, seed + 1, self.device)
            self.requests.append(StepRequest(cell.batch, chunk, prefill=True))
        self.contexts = {r.request: ex.state.context_lens[r.request] for r in self.requests}
        # The executor serves several cells: each arm judges only what ran after this point (its ledger window and
        # the device counters' launches during its own work, see _own_launches).
        self._since = ex.ledger.mark()
        self._device_counts: dict[str, int] | None = None
        self.graph: str | None = None
        self.layer_graphs: dict[int, str] = {}
        self._launches: dict[int, float] | None = None
        with self._own_launches():
            self._capture(graph, cell, decode, seed)

    def _capture(self, graph: bool, cell: Cell, decode: list[int], seed: int) -> None:
        ex = self.ex
        if graph:
            self.graph = ex.capture(cell.batch)
            ex.load_graph_inputs(self.graph, self.requests)
            q = cell.tokens_per_request  # a verify graph's requests carry q rows each and their accepted count
            accepted = self.requests[0].num_accepted if self.requests else None
            for layer in ex.config.layers:
                name_ = ex.capture(cell.batch, (layer,))
                x = random_input(self.dims, layer, cell.batch * q, seed + 2 + layer, self.device)
                rows = [StepRequest(r, x.rows(slice(r * q, (r + 1) * q)), num_accepted=accepted) for r in decode]
                ex.load_graph_inputs(name_, rows)
                self.layer_graphs[layer] = name_

    # -- helpers --------------------------------------------------------------------------------------------

    def _restore(self) -> None:
        """Put the context lengths back (and forget a verify step's unconfirmed tokens): the next run does the same
        work (see the module doc)."""
        for r, n in self.contexts.items():
            self.ex.state.context_lens[r] = n
            self.ex.state.unconfirmed[r] = 0

    def _flush(self) -> None:
        if self.flush_buffer is not None:
            self.flush_buffer.zero_()

    def _time_graph(self, name: str, steps: int = 1, lead_in: int = 0) -> float:
        """Seconds of `steps` replays after `lead_in` untimed ones, one host sync at the end. With an L2 flush each
        replay has its own pair of events and the flush is enqueued before the start event, outside the timed
        region; without one a single pair spans all timed replays."""
        pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        per_replay = self.flush_buffer is not None

        def before(i: int) -> None:
            self._flush()
            if i >= lead_in and (per_replay or i == lead_in):
                pairs.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
                pairs[-1][0].record()

        def after(i: int) -> None:
            if i >= lead_in and (per_replay or i == lead_in + steps - 1):
                pairs[-1][1].record()

        self.ex.replay(name, lead_in + steps, before, after)
        pairs[-1][1].synchronize()
        return sum(start.elapsed_time(end) for start, end in pairs) / 1e3

    def _mark(self) -> Any:
        """A point on the timeline: a recorded CUDA event on a GPU, the process's CPU clock on the CPU."""
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return self.clock()

    def _between(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1e3 if self.device.type == "cuda" else end - start

    def _eager_step(self) -> None:
        try:
            self.ex.step(self.requests)
        finally:
            self._restore()

    def _time_eager(self, steps: int, lead_in: int) -> float:
        """Seconds of `steps` eager steps after `lead_in` untimed ones, with no host sync between steps (on a GPU,
        CUDA events around them see the host's launch time as the gaps it leaves). The L2 flush, where on, goes
        before every step with a pair of marks per step, so it stays outside the timed region."""
        per_step = self.flush_buffer is not None
        spans: list[tuple[Any, Any]] = []
        start: Any = None
        for i in range(lead_in + steps):
            self._flush()
            timed = i >= lead_in
            if timed and (per_step or i == lead_in):
                start = self._mark()
            self._eager_step()
            if timed and (per_step or i == lead_in + steps - 1):
                spans.append((start, self._mark()))
        _sync(self.device)
        return sum(self._between(a, b) for a, b in spans)

    def _part_name(self, layer: int) -> str:
        return f"layer {layer} {self.dims.layer_kind(layer)}+{self.dims.mlp_kind(layer)}"

    def _declared(self, entries: list[Any], layer: int) -> int:
        return sum(e.record.launches for e in entries if e.layer == layer)

    # -- the Arm protocol -----------------------------------------------------------------------------------

    def run(self, steps: int = 1, lead_in: int = 0) -> float:
        with self._own_launches():
            if self.graph is not None:
                return self._time_graph(self.graph, steps, lead_in)
            return self._time_eager(steps, lead_in)

    def profile(self) -> StepProfile:
        with self._own_launches():
            if self.graph is not None:
                return self._profile_graphs()
            if self.device.type == "cuda":
                return self._profile_eager_cuda()
            return self._profile_eager_host()

    @contextlib.contextmanager
    def _own_launches(self) -> Iterator[None]:
        """Add the device counters' launches during this block to the arm's own. The providers' counters are per
        kernel and process, and the two arms of a cell are interleaved, so a reading since the arm began would also
        hold the other arm's launches (the first H200 run judged every stock arm on the candidate's kernels)."""
        before = self.ex.device_counts()
        try:
            yield
        finally:
            if (delta := count_delta(before, self.ex.device_counts())) is not None:
                own = self._device_counts or {}
                self._device_counts = {k: own.get(k, 0) + delta.get(k, 0) for k in own.keys() | delta.keys()}

    def path(self) -> PathReport:
        by = f"perf {self.name} arm, cell {self.cell.id}"
        exp = self.arm_backend.expected
        if exp == "specialized" and self.cell.workload != "mixed":
            expected = self._specialized_expectations(by)
        else:  # a prefill in the batch routes a mixed step to stock on either backend
            expected = [Expectation("stock", by=by)]
        window = self.ex.ledger.since(self._since)
        mismatches = window.check(expected)
        if self.kernels:
            window.report_profiler_kernels(self.kernels)
        if self._device_counts is not None:
            window.report_device_counts(self._device_counts)
        mismatches += window.check_execution(self.ex.kernel_catalog())
        return PathReport(exp, tuple(mismatches))

    def _specialized_expectations(self, by: str) -> list[Expectation]:
        """Per dispatch of this cell's steps, the path the data says a pure-decode or verify step of the cell's rows
        takes: the op table's, stock above a provider's row limit (not the planner's own decisions)."""
        table, dims, prepared = self.ex.planner.table, self.dims, self.ex.planner.prepared
        q = self.cell.tokens_per_request
        rows = self.cell.batch * q
        if (q > 1 and q != prepared.q) or rows not in prepared.rows:  # the deployment prepared no kernels for it
            return [Expectation("stock", by=by)]
        limits = self.ex.registry.row_limits(self.ex.config.tp)
        layer_limits = self.ex.registry.layer_row_limits(self.ex.config.tp, dims, self.ex.config.layers)
        paths = table.expected_paths(dims, self.ex.config.layers, rows, limits, self.ex.planner.op_stock, layer_limits)
        keys = sorted({(r.step, r.layer, r.op) for r in self.ex.ledger.since(self._since).records()})
        return [Expectation(paths[(layer, op)], by=by, op=op, layer=layer, step=s) for s, layer, op in keys]

    # -- profiles -------------------------------------------------------------------------------------------

    def _graph_launches(self) -> dict[int, float]:
        """Kernels, memsets and copies per replay of each layer's graph, seen by torch.profiler (once per cell)."""
        if self._launches is None:
            self._launches = {}
            for layer, name in self.layer_graphs.items():
                with _profiler(self.device) as prof:
                    self.ex.replay(name, 2)
                    _sync(self.device)
                events = device_events(_chrome_trace(prof))
                self.kernels.update(e.name for e in events if e.category == "kernel")
                self._launches[layer] = len(events) / 2
        return self._launches

    def _profile_graphs(self) -> StepProfile:
        launches = self._graph_launches()
        replays = perf_data().graph_profile_replays
        parts = []
        for layer, name in self.layer_graphs.items():
            entries = [e for e in self.ex.op_log if e.graph == name]
            parts.append(
                PartProfile(
                    self._part_name(layer),
                    self._time_graph(name, replays, lead_in=1) / replays,
                    launches[layer],
                    self._declared(entries, layer),
                    self.part_bytes[layer],
                )
            )
        assert self.graph is not None
        total = self._time_graph(self.graph, replays, lead_in=1) / replays
        method = f"one CUDA graph per layer and one of the stack, CUDA events, mean of {replays} replays after one"
        return StepProfile(tuple(parts), total, method)

    def _profile_eager_cuda(self) -> StepProfile:
        logged = len(self.ex.op_log)
        self._flush()
        self.ex.runner.ranges = True
        try:
            with _profiler(self.device) as prof:
                with torch.profiler.record_function(STEP_RANGE):
                    self.ex.step(self.requests)
                _sync(self.device)
        finally:
            self.ex.runner.ranges = False
            self._restore()
        trace = _chrome_trace(prof)
        ranges, _ = kernels_by_range(trace)
        spans = [
            float(e["dur"])
            for e in trace["traceEvents"]
            if e.get("cat") == "user_annotation" and e["name"] == STEP_RANGE
        ]
        if len(spans) != 1:
            raise RuntimeError(f"the profile holds {len(spans)} {STEP_RANGE} ranges, not 1; the step was not profiled")
        total_us = spans[0]
        entries = self.ex.op_log[logged:]
        parts = []
        for layer in self.ex.config.layers:
            events = [e for rk in ranges if rk.layer == layer for e in rk.events]
            self.kernels.update(e.name for e in events if e.category == "kernel")
            parts.append(
                PartProfile(
                    self._part_name(layer),
                    sum(e.dur_us for e in events) / 1e6,
                    float(len(events)),
                    self._declared(entries, layer),
                    self.part_bytes[layer],
                )
            )
        return StepProfile(tuple(parts), total_us / 1e6, "torch.profiler: device time of each layer's kernels")

    @contextlib.contextmanager
    def _layer_clock(self, stamps: list[tuple[int, float]]) -> Iterator[None]:
        """Stamp the host clock as each layer starts, chained before the executor's own layer hook."""
        runner = self.ex.runner
        own = runner.on_layer

        def stamp(layer: int) -> None:
            stamps.append((layer, self.clock()))
            if own is not None:
                own(layer)

        runner.on_layer = stamp
        try:
            yield
        finally:
            runner.on_layer = own

    def _profile_eager_host(self) -> StepProfile:
        logged = len(self.ex.op_log)
        stamps: list[tuple[int, float]] = []
        self._flush()
        t0 = self.clock()
        try:
            with self._layer_clock(stamps):
                self.ex.step(self.requests)
            t1 = self.clock()
        finally:
            self._restore()
        spent: Counter[int] = Counter()
        for (layer, start), end in zip(stamps, [s for _, s in stamps[1:]] + [t1], strict=True):
            spent[layer] += end - start
        entries = self.ex.op_log[logged:]
        parts = tuple(
            PartProfile(self._part_name(i), spent[i], None, self._declared(entries, i), self.part_bytes[i])
            for i in self.ex.config.layers
        )
        return StepProfile(parts, t1 - t0, "process CPU time at layer boundaries (CPU eager)")


@dataclass
class _Stack:
    """Both arms' executors for one TP size and tokens per request, over one set of weights."""

    tp: int
    q: int  # 1: decode and mixed cells; q > 1: a speculative stack of q - 1 tokens for the verify cells of that q
    config: StackConfig
    arms: dict[str, StackExecutor]


class K3PerfSuite:
    def __init__(
        self,
        subject: str,
        model: str,
        cells: tuple[Cell, ...],
        settings: Settings,
        device: str,
        distributed: bool = False,
        *,
        registry: ProviderRegistry = PROVIDERS,
        scope: RuntimeScope | None = None,
        table: OpTable | None = None,
    ) -> None:
        """`registry`, `scope`, `table`: the runtime's defaults (the shipped providers, scope file and op table)
        unless a test starts a private deployment (as StackExecutor.start takes them)."""
        data = perf_data()
        if model not in data.stacks:
            raise PerfConfigError(f"model: k3_decode/perf.toml names no perf stack for {model!r} — add one")
        self.model, self.cells, self.settings, self.distributed = model, cells, settings, distributed
        self.device = torch.device(device)
        self.stack_name = data.stacks[model]
        table = table or load_op_table()
        self._runtime = {"registry": registry, "scope": scope, "table": table}
        self.backends = {
            "baseline": resolve_backend("perf.baseline_backend", settings.baseline_backend, table, registry),
            "candidate": resolve_backend("perf.candidate_backend", settings.candidate_backend, table, registry),
        }
        self._stack: _Stack | None = None
        self._weights: tuple[int, dict[int, LayerWeights]] | None = None  # (TP, the layers its stacks share)
        self._flush: torch.Tensor | None = None
        self.info = self._info(subject, cells)

    def _info(self, subject: str, cells: tuple[Cell, ...]) -> SuiteInfo:
        """What the report must say about every cell: what was timed, where, and how far the numbers go."""
        # Any TP the model shards to describes the stack's layers (a tier may have no cells).
        probe = load_stack(self.stack_name, cells[0].tp if cells else 1)
        layers, dims, model = probe.layers, probe.dims, self.model
        kinds = ", ".join(f"{dims.layer_kind(i)}+{dims.mlp_kind(i)}" for i in layers)
        notes = [
            f"Timed: one rank's shard of {model} layers {layers[0]}-{layers[-1]} (stack {self.stack_name}: {kinds}) "
            "per GPU; TP all-reduces are the identity here, and per-GPU figures are of this stack, not of the whole "
            "model.",
            "Roofline bytes are one decode iteration of each cell's decode rows: a lower bound for mixed and verify "
            "steps.",
        ]
        short = []
        meaningful = self.device.type == "cuda"
        if not meaningful:
            notes.insert(
                0,
                f"CPU eager timing at {model} dims: the numbers mean nothing about any GPU; this run exercises the "
                "perf plumbing and the verdict logic only.",
            )
            short.append(f"CPU eager timing at {model} dims: the numbers mean nothing (see the notes)")
        cand = self.backends["candidate"]
        if cand.note and cand.started == self.backends["baseline"].started:
            notes.append(
                f"Candidate: {cand.note}, the same path as the baseline: the ratio is ~1 by construction and only "
                "exercises the plumbing."
            )
            short.append("both arms run the stock path (ratio ~1 by construction)")
        name = torch.cuda.get_device_name(self.device) if meaningful and torch.cuda.is_available() else "cpu"
        return SuiteInfo(subject, name, meaningful, tuple(notes), TTFT, "; ".join(short))

    @classmethod
    def from_config(cls, subject: str, config: Any) -> K3PerfSuite:
        plan = parse(config.data, config.tier)
        device = "cpu" if config.hardware["gpu"] == "none" else "cuda"
        distributed = config.data["parallel"].get("mode") == "distributed"
        return cls(subject, config.data.get("model", "k3"), plan.cells, plan.settings, device, distributed)

    # -- the PerfSuite protocol -----------------------------------------------------------------------------

    def unsupported(self, cell: Cell) -> str | None:
        if self.distributed:
            return (
                "the perf suite times one rank's shard on one GPU; timing real tensor parallelism (its all-reduces) "
                "is not built — use a per-rank-shapes config such as h200"
            )
        if cell.dcp != 1:
            return "the stack executor runs DCP=1 only — set dcp = [1] in this sweep"
        if cell.routing == "real":
            return (
                "k3-hopper runs seeded synthetic weights, so no real prompt can drive its MoE routing — use "
                "routing = 'synthetic'"
            )
        return None

    def bandwidth(self) -> Bandwidth:
        return copy_bandwidth(self.device, perf_data().copy_bytes[self.device.type])

    def prepare(self, cell: Cell, settings: Settings) -> PreparedCell:
        stack = self._stack_for(cell.tp, self._q(cell))
        graph = self._graph(cell)
        flush = self._flush_buffer() if settings.l2_flush else None
        part_bytes = self._part_bytes(stack.arms["baseline"], cell)
        arms = {
            name: K3Arm(name, self.backends[name], ex, cell, graph, flush, part_bytes, Counter())
            for name, ex in stack.arms.items()
        }
        notes = tuple(b.note for b in self.backends.values() if b.note)
        mode = "cuda-graph replay" if graph else f"eager ({self.device.type})"
        return PreparedCell(arms["baseline"], arms["candidate"], sum(part_bytes.values()), mode, notes)

    def close(self) -> None:
        self._release_stack()
        self._flush = None

    def _release_stack(self) -> None:
        self._stack = None
        self._weights = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # -- building -------------------------------------------------------------------------------------------

    def _graph(self, cell: Cell) -> bool:
        return self.device.type == "cuda" and cell.workload == "decode"

    def _flush_buffer(self) -> torch.Tensor:
        if self._flush is None:
            nbytes = perf_data().flush_bytes[self.device.type]
            self._flush = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._flush

    @staticmethod
    def _q(cell: Cell) -> int:
        """The tokens per request of the stack a cell runs on: its q for a verify cell, else 1."""
        return cell.tokens_per_request if cell.workload == "decode" else 1

    def _stack_for(self, tp: int, q: int = 1) -> _Stack:
        if self._stack is not None and (self._stack.tp, self._stack.q) == (tp, q):
            return self._stack
        weights = self._weights[1] if self._weights is not None and self._weights[0] == tp else None
        self._release_stack()  # one stack's executors at a time: give the last one's memory back first
        cells = [c for c in self.cells if c.tp == tp and self._q(c) == q]
        # A speculative stack's graphs are verify graphs of b requests (b x q rows); its prepared sizes are those.
        graph_batches = sorted({c.batch for c in cells if self._graph(c) or q > 1}) or [1]
        max_requests = max([c.batch + int(c.workload == "mixed") for c in cells] + graph_batches)
        # Room for the cell's tokens (and the traced step's) past its context, and for a prefill chunk.
        max_context = max(max(c.context + c.tokens_per_request + 1, (c.prefill_tokens or 0) + 1) for c in cells)
        config = load_stack(
            self.stack_name,
            tp,
            max_requests=max_requests,
            max_context=max_context,
            graph_batches=graph_batches,
            num_speculative_tokens=q - 1,
        )
        if weights is None:  # the verify cells' stacks of a TP size share its decode stack's weights
            gen = SyntheticWeights(config.dims, tp, config.rank, seed=config.seed, device=self.device)
            weights = {i: gen.layer(i) for i in config.layers}
        self._weights = (tp, weights)
        arms = {
            name: StackExecutor.start(
                config,
                {"decode_backend": b.started},
                device=self.device,
                weights=weights,
                log=lambda line: None,
                **self._runtime,
            )
            for name, b in self.backends.items()
        }
        self._stack = _Stack(tp, q, config, arms)
        return self._stack

    def _part_bytes(self, ex: StackExecutor, cell: Cell) -> dict[int, int]:
        """Least bytes per layer of one decode iteration of the cell's decode rows, with the distinct experts they
        route to in a traced step (run on `ex` at the cell's context, which is put back afterwards). On a verify
        cell's speculative stack the traced step is a verify step: its B x q rows route to the experts it reads."""
        seed = _seed(cell)
        rows = list(range(cell.batch))
        ex.state.fill_synthetic(rows, cell.context, seed=seed)
        q = ex.config.tokens_per_request
        x = random_input(ex.dims, ex.config.layers[0], cell.batch * q, seed, ex.device)
        accepted = 1 if q > 1 else None
        try:
            traced = ex.step(
                [StepRequest(r, x.rows(slice(r * q, (r + 1) * q)), num_accepted=accepted) for r in rows], trace=True
            )
        finally:
            for r in rows:
                ex.state.context_lens[r] = cell.context
                ex.state.unconfirmed[r] = 0
        assert traced.trace is not None
        unique = {t.layer: int(t.expert_ids.unique().numel()) for t in traced.trace if t.expert_ids is not None}
        seq_lens = (cell.context + 1,) * cell.batch
        return {
            layer: sum(
                layer_bytes(ex.dims, cell.tp, layer, StepShape(cell.batch, seq_lens, 1, unique.get(layer))).values()
            )
            for layer in ex.config.layers
        }
