"""The stack executor: decode steps for many requests through N real-shape layers, stock or specialized per op.

What one instance holds (one rank's shard on one device; the TP all-reduces are the identity, see config.py):
seeded synthetic weights of its layers, a KDA state slot and MLA pages for each of max_requests requests, eager
step buffers, and one captured CUDA graph per prepared batch size (static inputs, tables and output; a step copies
its inputs in and replays).

Every step is planned by the runtime's Planner and recorded in the dispatch ledger: eager steps when they run,
graph steps once at capture (with the eager warm-up before it), then counted at every replay. The layer runner
(forward.py) calls the stock op objects; the executor hands it routed views of them (`RoutedOps`), so each call
the plan sends to the specialized path goes to the op's registered provider instead, through the callables the
provider bound at start (`ExecutableProvider.bind`). A specialized decision with no provider is refused before
anything runs (the specialized kernels are not built; the runtime refuses `latency_specialized` at start-up for
that reason too). Every call, stock or provider, lands in the op log with the runtime ops it carried, so what ran
can be joined with what the ledger records (executor/audit.py). Prefill and mixed steps run eagerly, token by
token through the decode kernels (correct, not fast).

Verify steps (a stack with num_speculative_tokens k > 0, q = 1 + k tokens per request). Every live request carries
exactly q tokens (its last sampled token and k drafts) and the whole step is ONE iteration over B * q rows in
request-major order: AttnRes, projections and MLPs take them as rows, the KDA layers run the runner's `kda_verify`
call on [B, q] views (stock kda_verify, or the op's provider), and each MLA row (b, t) is a decode row of its own at
position ctx + t (seq_len ctx + t + 1, the cache slot of that position). That is a causal verify because the MLA
step inserts every row's cache entry before any row attends (k3_decode/stock/mla.py: one insert launch, then the
split-KV attention; the CPU path writes all rows, then attends), and the seq_len keeps row t from seeing t' > t.

Acceptance. Each request of a verify step gives `num_accepted` a (1..q): how many tokens of its previous verify
step were accepted. The MLA context then advances by a (the rejected rows past it are rewritten by this step) and
the KDA layers read the state after the last accepted token, slot[b, a - 1] of the request's q slots, with the conv
taps that end at it (k3_decode/reference/kda.py). A prefill writes the request's first slot, slot[b, 0], which is
where a verify that accepted one token leaves the state, so the first verify after a prefill passes num_accepted 1
and reads slot[b, 0] and the prefill's whole context; any other count there is refused. The q tokens of the last
verify stay unconfirmed until the next verify step reports them (RequestState.unconfirmed).

A speculative stack runs prefill steps (eagerly) and uniform verify steps (eagerly, or as a replay of a captured
verify graph): a decode step of fewer tokens and a step mixing prefill with verify requests are one-line errors. A
stack without speculative tokens keeps running multi-token steps token by token.

Verify graphs. On a speculative stack `capture(B)` captures one verify iteration of B requests, B * q rows (named
B<B>q<q>), and a verify step of n <= B live requests replays the smallest such graph, its last B - n requests NULL
padding (every slot of their q-slot rows NULL, seq_len 0, no cache slot), which writes no request state: the KDA
verify (stock and the KDA step provider) gives NULL requests zeros and touches no slot, the MLA insert skips
negative cache slots and a row of seq_len 0 attends nothing. What a replay reads per step is what the step copies
into the graph's buffers before it: the entry state, the [B, q] KDA slot table, the accepted counts (the KDA verify
reads them on the device: the stock conv kernel and the fla recurrence through its num_accepted_tokens pointer, the
provider as a kernel operand), and the MLA block table, seq lens and cache slots (device tensors the insert and the
split-KV kernels read). What the capture baked in is host values that do not vary per step: the row count, q, the
layers and the MLA split count, chosen for the graph's rows at max_context (stock/mla.py: the split bounds follow
each row's seq_len on the device, so any context up to max_context runs under that count). An eager verify step
chooses its split count from its own longest context instead, so the two agree bit for bit where both counts are
equal (and the rows are, since cuBLAS picks its kernels by row count). The executor checks every per-step value on
the host before the copy (`_is_verify`, state.verify_tables): validation inside the stock ops reads device tensors
and is off (StockAttentionOps(validate=False)), and would be skipped under capture anyway. A graph's records are
made once at capture, so their note cannot hold a replay's accepted counts; each step's counts are in its
StepResult's plan (plan.step.num_accepted).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
from torch import Tensor

from k3_decode.config import ModelDims
from k3_decode.executor.config import StackConfig
from k3_decode.executor.forward import ElidedRowParallel, LayerRunner, StepBuffers
from k3_decode.executor.inputs import StackInput
from k3_decode.executor.memory import DeviceBudget, MemoryPlan, plan_memory
from k3_decode.executor.opmap import StockOpMap, load_op_map
from k3_decode.executor.state import RequestState
from k3_decode.reference.decoder import LayerTrace
from k3_decode.runtime.backend import PROVIDERS, KernelProvider, ProviderRegistry
from k3_decode.runtime.ledger import DispatchRecord, KernelCatalog, Ledger, Mode, graph_key
from k3_decode.runtime.optable import OpTable
from k3_decode.runtime.plan import Planner, StepInput, StepPlan
from k3_decode.runtime.scope import Deployment, local_device
from k3_decode.runtime.scopefile import RuntimeScope
from k3_decode.runtime.startup import GatherVerdicts, start
from k3_decode.runtime.writeset import WriteSet, declare_step, kda_state_name, mla_cache_name, scratch_name
from k3_decode.stock import OpRecord, StockAttentionOps
from k3_decode.stock.dispatch import Implementation
from k3_decode.stock.moe import StockMoeOps
from k3_decode.weights import LayerWeights, MoeWeights, SyntheticWeights


class StepRoutingError(ValueError):
    """The plan routed a step somewhere this executor cannot run it."""


Side = Literal["attention", "moe"]

# Which runtime ops (k3_decode/runtime/ops.toml) each call of the layer runner (forward.py) carries, per layer part,
# and which of the runner's op objects it is a method of. This describes forward.py's code, so it lives beside the
# code that routes those calls; the op-log join (executor/audit.py) checks it against ops.toml on every audited step.
# A provider replaces whole calls: MLA's in_proj, mla and o_proj are one call (mla_attention), so none of them can
# be specialized alone until forward.py splits that call.
RUNNER_CALLS: dict[str, tuple[Side, dict[str, tuple[str, ...]]]] = {
    "kda": (
        "attention",
        {
            "attn_res_before": ("attn_res",),
            "kda_in_proj": ("in_proj",),
            "kda_decode": ("kda",),
            "kda_verify": ("kda",),  # verify steps: [B, q] views (forward.py)
            "kda_o_proj": ("o_proj",),
            "attn_res_after": ("o_proj",),
        },
    ),
    "mla": (
        "attention",
        {
            "attn_res_before": ("attn_res",),
            "mla_attention": ("in_proj", "mla", "o_proj"),
            "attn_res_after": ("o_proj",),
        },
    ),
    "dense": ("moe", {"dense": ("dense_mlp",)}),
    "moe": (
        "moe",
        {call: ("moe",) for call in ("route", "latent_down", "experts", "shared", "latent_tail")},
    ),
}


# Runner calls made in place of another on verify steps: a provider's launches are logged on whichever of the two a
# step makes (a verify step makes kda_verify and no kda_decode), not only on the op's first call.
REPLACES: dict[str, str] = {"kda_verify": "kda_decode"}
# Runner calls that take a verify iteration's rows as [B, q]: their op-log record says B requests of q tokens.
VERIFY_CALLS = frozenset({"kda_verify"})


@dataclass(frozen=True)
class ProviderTarget:
    """What a specialized provider binds its kernels to: one rank's shard of a model on one device.

    `combines_partials()`: whether the layer runner combines row-parallel partials across ranks (a TP all-reduce
    between o_proj and the AttnRes after attention, k3_decode.distributed) rather than using this rank's as they
    are (forward.ELIDED). A provider that fuses past o_proj asks it at call time: the TP executor sets its
    combines after the providers are bound."""

    dims: ModelDims
    tp: int
    rank: int
    device: torch.device
    combines_partials: Callable[[], bool] = lambda: False


class ExecutableProvider(KernelProvider, Protocol):
    """A provider the executor can call: besides its op, name and launches (runtime.backend.KernelProvider), it
    binds to a target and returns, for each runner call of its op (RUNNER_CALLS), a callable with the stock
    method's signature and return value. A provider may also report device-side launch counts (audit builds)."""

    def bind(self, target: ProviderTarget) -> Mapping[str, Callable[..., Any]]: ...


ProviderGuard = Callable[["OpLogEntry"], AbstractContextManager[Any]]


@dataclass(frozen=True)
class StepRequest:
    """One request's part of a step: the entry state of its n tokens; prefill marks them as context.

    `num_accepted`: on a verify step of a speculative stack (required there, refused elsewhere), how many tokens of
    the request's previous verify step were accepted, 1..q; 1 for the first verify after a prefill."""

    request: int
    inputs: StackInput
    prefill: bool = False
    num_accepted: int | None = None


@dataclass(frozen=True)
class StepResult:
    step: int
    plan: StepPlan
    outputs: dict[int, Tensor]  # request -> [n, hidden] BF16: the last layer's MLP output of each of its tokens
    graph: str | None  # the replayed graph, None for an eager step
    # per layer, rows in request order (request-major (b, t) rows for a verify step); eager one-iteration steps
    trace: tuple[LayerTrace, ...] | None


@dataclass(frozen=True)
class OpLogEntry:
    """One op call, with where it ran (graph: recorded at capture): a stock op as the stock ops reported it, or a
    provider call as the executor made it. `ops`: the runtime ops of the runner call it ran under (empty for a call
    made outside the layer runner)."""

    step: int
    layer: int
    graph: str | None
    record: OpRecord
    ops: tuple[str, ...] = ()
    source: Literal["stock", "provider"] = "stock"


@dataclass(frozen=True)
class _Bound:
    provider: KernelProvider
    fn: Callable[..., Any]
    launches: int  # launches logged for this call: the op's launches on its first runner call, 0 on the others


class RoutedOps:
    """A stock op object as the layer runner sees it: every call RUNNER_CALLS names goes through the executor's
    router (stock or a provider, as the step's plan says); any other attribute is the stock object's own."""

    def __init__(self, executor: StackExecutor, side: Side) -> None:
        self._executor, self._side = executor, side

    def __getattr__(self, name: str) -> Any:
        if name in self._executor._routed_calls[self._side]:
            return lambda *args, **kwargs: self._executor._route(self._side, name, args, kwargs)
        return getattr(self._executor._stock(self._side), name)


class Replayable(Protocol):
    def replay(self) -> None: ...


class GraphRuntime(Protocol):
    """Where the executor's graphs come from: `warm_up(run)` runs one iteration before its capture (the kernels'
    first-call compilation and autotuning must not happen under capture), `capture(run)` records one and returns
    the graph and the output tensor every replay rewrites. `run` is the whole iteration, routed by its plan."""

    def warm_up(self, run: Callable[[], Tensor]) -> None: ...

    def capture(self, run: Callable[[], Tensor]) -> tuple[Replayable, Tensor]: ...


class CudaGraphs:
    """FULL CUDA graphs on one device, all in one memory pool (one graph replays at a time)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pool: Any = None

    def warm_up(self, run: Callable[[], Tensor]) -> None:
        # On a side stream, as torch.cuda.graphs recommends before capture, so no pending work of the current stream
        # is interleaved with the warm-up's lazy initialization.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)

    def capture(self, run: Callable[[], Tensor]) -> tuple[Replayable, Tensor]:
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool):
            output = run()
        return graph, output


@dataclass
class CapturedGraph:
    name: str
    batch: int  # requests; a verify graph runs batch * tokens_per_request rows
    layers: tuple[int, ...]
    buffers: StepBuffers
    graph: Replayable  # torch.cuda.CUDAGraph on a CUDA device
    output: Tensor  # [batch * tokens_per_request, hidden], rewritten by every replay
    num_splits: int
    path: str  # the path the capture-time plan chose
    tokens_per_request: int = 1  # q > 1: a verify graph of a speculative stack


class StackExecutor:
    def __init__(
        self,
        config: StackConfig,
        planner: Planner,
        *,
        device: torch.device | str = "cpu",
        implementation: Implementation | None = None,
        budget: DeviceBudget | None = None,
        registry: ProviderRegistry = PROVIDERS,
        weights: Mapping[int, LayerWeights] | None = None,
        log: Callable[[str], None] = print,
        provider_guard: ProviderGuard | None = None,
    ) -> None:
        """`weights`: this config's layers already generated (SyntheticWeights of the same dims, TP, rank and seed),
        to share them between executors; None generates them on `device`. `provider_guard`: a context manager
        entered around every provider call (the isolation audit watches what code runs inside it)."""
        self.config, self.planner, self.registry = config, planner, registry
        self.dims = config.dims
        self.device = torch.device(device)
        if tuple(planner.layers) != config.layers or planner.dims.name != self.dims.name:
            raise ValueError(
                f"the planner covers {planner.dims.name} layers {list(planner.layers)}, the stack "
                f"{self.dims.name} layers {list(config.layers)}; build it with runtime.planner(dims, layers)"
            )
        self.memory: MemoryPlan = plan_memory(config, budget)
        log(self.memory.render())
        self.memory.check()
        if self.device.type == "cuda":
            plan_memory(config, DeviceBudget.current_cuda(self.device)).check()
        self.opmap: StockOpMap = load_op_map(planner.table)
        self._part = {
            (layer, op): part.part for layer in config.layers for part, op in planner.table.layer_ops(self.dims, layer)
        }
        if weights is None:
            gen = SyntheticWeights(self.dims, config.tp, config.rank, seed=config.seed, device=self.device)
            weights = {i: gen.layer(i) for i in config.layers}
        if sorted(weights) != list(config.layers) or any(weights[i].layer != i for i in config.layers):
            raise ValueError(
                f"weights cover layers {sorted(weights)}, the stack {list(config.layers)}; pass one per layer"
            )
        self.weights: dict[int, LayerWeights] = dict(weights)
        self.state = RequestState(config, self.device)
        self.ledger = Ledger()
        self.op_log: list[OpLogEntry] = []
        self._where: tuple[int, int, str | None] = (0, -1, None)  # step, layer, graph of the op being logged
        self._tag: tuple[str, ...] = ()  # runtime ops of the runner call running now
        self._active: StepPlan | None = None  # the plan of the layers running now (None: no planned step)
        self._rows = 0  # rows of the iteration running now
        self._q = 1  # tokens per request of the iteration running now (q > 1: a verify iteration)
        self._verify_steps: dict[int, int] = {}  # step -> q of the verify steps run (the op-log join reads it)
        self.provider_guard = provider_guard
        # The executor builds every slot table from its own request state (state.py checks them on the host), so the
        # stock ops' per-call slot checks, which synchronize with the device, are left off.
        self.attention = StockAttentionOps(
            self.dims, config.tp, self.device, implementation, validate=False, listener=self._on_op
        )
        self.moe = StockMoeOps(self.dims, config.tp, self.device, implementation, listener=self._on_op)
        for w in self.weights.values():
            if isinstance(w.mlp, MoeWeights):
                self.moe.check_weights(w.mlp)
        self._routed_calls: dict[Side, frozenset[str]] = {
            side: frozenset(c for s, calls in RUNNER_CALLS.values() if s == side for c in calls)
            for side in ("attention", "moe")
        }
        self._bound: dict[tuple[str, str], _Bound] = self._bind_providers()
        # The runner gets routed views of the stock ops (typed as the stock objects it calls them as).
        routed_attention: Any = RoutedOps(self, "attention")
        routed_moe: Any = RoutedOps(self, "moe")
        self.runner = LayerRunner(
            self.dims, self.weights, self.state, routed_attention, routed_moe, config.k_scale, config.q_scale
        )
        self.runner.on_layer = self._on_layer
        q = config.tokens_per_request
        self.eager = StepBuffers.allocate(
            "eager",
            self.dims,
            config.layers,
            config.max_requests * q,  # a verify iteration runs q rows per request
            config.pages_per_request,
            self.device,
            verify=q > 1,
        )
        self.graphs: dict[str, CapturedGraph] = {}
        # None refuses capture; CPU tests put a stand-in here to run the graph steps' host side without CUDA.
        self.graph_runtime: GraphRuntime | None = CudaGraphs(self.device) if self.device.type == "cuda" else None
        self._step = 0

    @classmethod
    def start(
        cls,
        config: StackConfig,
        additional_config: Mapping[str, Any] | None = None,
        *,
        device: torch.device | str | None = None,
        gather: GatherVerdicts | None = None,
        registry: ProviderRegistry = PROVIDERS,
        scope: RuntimeScope | None = None,
        table: OpTable | None = None,
        tp_all_reduce: bool = False,
        **kwargs: Any,
    ) -> StackExecutor:
        """Start-up through the runtime (backend, scope checks), then build. Raises the runtime's one-line errors.

        `gather`: every TP rank's scope verdict (k3_decode.distributed), so the ranks agree before anything is built.
        `tp_all_reduce`: the caller will combine row-parallel partials across ranks (k3_decode.distributed sets the
        runner's all-reduces); the plan then keeps stock the ops whose provider cannot serve that.
        `registry`, `scope`, `table`: the runtime's defaults (the shipped providers, scope file and op table) unless
        a test or red-team case starts a private deployment.
        """
        kind, capability = local_device()
        device = torch.device(device or kind)
        if device.type != kind:
            kind, capability = device.type, None  # a CPU executor on a machine that has a GPU
        dims = config.dims
        deployment = Deployment(
            model=dims.name,
            device=kind,
            capability=capability,
            tp=config.tp,
            dcp=1,
            max_batch=max(config.graph_batches),
            num_speculative_tokens=config.num_speculative_tokens,
            # The executor feeds its own draft tokens, uniform by construction ("synthetic" in the scope file).
            spec_method="synthetic" if config.num_speculative_tokens else None,
            mla_cache_dtype=dims.mla.cache_dtype,
            kda_conv_state_dtype=dims.kda.conv_state_dtype,
            kda_recurrent_state_dtype=dims.kda.recurrent_state_dtype,
            cudagraph_mode="full_decode_only" if kind == "cuda" else "none",
            # In rows, as vLLM counts them: a request is q rows of a verify step.
            capture_sizes=tuple(sorted(b * config.tokens_per_request for b in config.graph_batches)),
            tp_all_reduce=tp_all_reduce,
        )
        runtime = start(additional_config, deployment, gather=gather, scope=scope, table=table, registry=registry)
        return cls(config, runtime.planner(dims, config.layers), device=device, registry=runtime.registry, **kwargs)

    # -- what the executor owns ---------------------------------------------------------------------------------

    def owned_tensors(self) -> dict[str, Tensor]:
        """Every tensor the executor keeps across steps, by the names write sets and the audit use."""
        out: dict[str, Tensor] = {}
        for layer, w in self.weights.items():
            out.update({f"layers.{layer}.{name}": t for name, t in w.tensors().items()})
        for layer, cache in self.state.kda.items():
            out[kda_state_name(layer, "conv")] = cache.conv
            out[kda_state_name(layer, "recurrent")] = cache.recurrent
        for layer, cache in self.state.mla.items():
            out[mla_cache_name(layer)] = cache
        out["state.block_table"] = self.state.block_table
        for buffers in [self.eager, *(g.buffers for g in self.graphs.values())]:
            out.update({scratch_name(f"{buffers.name}.{k}"): t for k, t in buffers.tensors().items()})
        return out

    def kernel_catalog(self) -> KernelCatalog:
        """Which kernels each dispatch launches: registered specialized providers and the stock ops of ops.toml."""
        return KernelCatalog.build(
            self.registry, self.opmap.stock_launches(), self.opmap.stock_launches(verify=True), self._verify_steps
        )

    def device_counts(self) -> dict[str, int] | None:
        """Launches per kernel the registered providers read from their device-side counters (per process, since
        start), or None when no provider reports any (the stock path's public kernels carry no counters)."""
        counts: dict[str, int] = {}
        for provider in self.registry:
            read = getattr(provider, "device_counts", None)
            if read is not None:
                counts.update(read())
        return counts or None

    # -- ledger plumbing ----------------------------------------------------------------------------------------

    def _on_layer(self, layer: int) -> None:
        step, _, graph = self._where
        self._where = (step, layer, graph)

    def _on_op(self, record: OpRecord) -> None:
        step, layer, graph = self._where
        self.op_log.append(OpLogEntry(step, layer, graph, record, self._tag))

    # -- specialized providers ----------------------------------------------------------------------------------

    def _stock(self, side: Side) -> Any:
        return self.attention if side == "attention" else self.moe

    def _combines_partials(self) -> bool:
        return not isinstance(self.runner.row_parallel, ElidedRowParallel)

    def _bind_providers(self) -> dict[tuple[str, str], _Bound]:
        """Bind every registered provider of an op the table specializes, when the backend can route to it.

        Each must bind exactly the runner calls of its op (RUNNER_CALLS) in the parts where the op is specialized;
        an op whose call carries other ops too cannot be taken alone. Ops without a provider stay unbound: a plan
        that routes to one is refused per step (`_plan`), as the kernels are not built."""
        if self.planner.backend != "latency_specialized":
            return {}
        table = self.planner.table
        target = ProviderTarget(self.dims, self.config.tp, self.config.rank, self.device, self._combines_partials)
        bound: dict[tuple[str, str], _Bound] = {}
        for provider in self.registry:
            calls: list[str] = []
            for part, ops in table.parts.items():
                if provider.op not in ops.specialized:
                    continue
                for call, carried in RUNNER_CALLS[part][1].items():
                    if provider.op not in carried:
                        continue
                    if len(carried) > 1:
                        raise StepRoutingError(
                            f"op {provider.op!r} is specialized in [{part}] of the op table, but the layer runner "
                            f"makes it in one call ({call}) with {', '.join(o for o in carried if o != provider.op)}; "
                            "split that call in executor/forward.py or keep the op stock"
                        )
                    if call not in calls:
                        calls.append(call)
            if not calls:
                continue
            bind = getattr(provider, "bind", None)
            if bind is None:
                raise StepRoutingError(
                    f"provider {provider.name!r} of op {provider.op!r} has no bind(target), so the executor cannot "
                    f"call it; give it bind() returning callables for {', '.join(calls)}"
                )
            fns = dict(bind(target))
            if sorted(fns) != sorted(calls):
                raise StepRoutingError(
                    f"provider {provider.name!r} binds {sorted(fns)} but op {provider.op!r} runs as the runner calls "
                    f"{sorted(calls)}; bind exactly those"
                )
            launches = sum(provider.launches.values())
            first = next((c for c in calls if c not in REPLACES), calls[0])
            for call in calls:
                counted = REPLACES.get(call, call) == first  # the op's first call of a step, decode or verify
                bound[(provider.op, call)] = _Bound(provider, fns[call], launches if counted else 0)
        return bound

    @contextlib.contextmanager
    def _running(self, plan: StepPlan, rows: int, q: int = 1) -> Iterator[None]:
        """The plan, rows and tokens per request the runner's calls are routed by while one iteration runs."""
        self._active, self._rows, self._q = plan, rows, q
        try:
            yield
        finally:
            self._active, self._rows, self._q = None, 0, 1

    def _route(self, side: Side, call: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """One runner call: the stock op, or the provider the plan routes its runtime op to, logged with its ops."""
        step, layer, graph = self._where
        stock = getattr(self._stock(side), call)
        plan = self._active
        if plan is None or layer < 0:
            return stock(*args, **kwargs)  # outside a planned step (a benchmark driving the runner): stock
        part = self.dims.layer_kind(layer) if side == "attention" else self.dims.mlp_kind(layer)
        carried = RUNNER_CALLS[part][1].get(call)
        if carried is None:
            raise StepRoutingError(
                f"the layer runner called {call} in {part} layer {layer}, which RUNNER_CALLS does not map to a "
                "runtime op; add it there"
            )
        specialized = [op for op in carried if plan.path_of(layer, op) == "specialized"]
        outer = self._tag
        self._tag = carried
        try:
            if not specialized:
                return stock(*args, **kwargs)
            bound = self._bound.get((specialized[0], call))
            if len(carried) > 1 or bound is None:
                raise StepRoutingError(
                    f"layer {layer} {call}: the plan routes {specialized[0]} to the specialized path but no provider "
                    "is bound to this call; the executor refuses such plans before a step runs, so this is a bug"
                )
            batch, q = (self._rows // self._q, self._q) if call in VERIFY_CALLS else (self._rows, 1)
            record = OpRecord(bound.provider.name, f"provider {bound.provider.name}", bound.launches, batch, q)
            entry = OpLogEntry(step, layer, graph, record, carried, "provider")
            self.op_log.append(entry)
            with self.provider_guard(entry) if self.provider_guard else contextlib.nullcontext():
                return bound.fn(*args, **kwargs)
        finally:
            self._tag = outer

    def _records(
        self, plan: StepPlan, graph: str | None, layers: Sequence[int], note: str = ""
    ) -> list[DispatchRecord]:
        """The plan's records for `layers`, each stock reason saying what the stock ops run as on this device."""
        device = "cuda" if self.attention.implementation == "triton" else "cpu"
        out = []
        for rec in plan.records(self.config.rank, graph):
            if rec.layer not in layers:
                continue
            if rec.path == "specialized":
                names = sorted({b.provider.name for (op, _), b in self._bound.items() if op == rec.op})
                ran = f"provider {', '.join(names)}"
            else:
                impl = self.opmap.implementations(self._part[(rec.layer, rec.op)], device)
                ran = f"stock ops run as {', '.join(impl)}"
            reason = f"{rec.reason}; {ran}" + (f"; {note}" if note else "")
            out.append(dataclasses.replace(rec, reason=reason))
        return out

    def _plan(self, step: StepInput) -> StepPlan:
        plan = self.planner.plan(step)
        bound = {op for op, _ in self._bound}
        for d in plan.decisions:
            if d.path == "specialized" and d.op not in bound:
                raise StepRoutingError(
                    f"the plan routes layer {d.layer} op {d.op} to the specialized path ({d.reason}) but no provider "
                    f"is registered for {d.op}: the specialized kernels are not built; use decode_backend 'auto'"
                )
        return plan

    # -- steps ---------------------------------------------------------------------------------------------------

    def _check_requests(self, requests: Sequence[StepRequest], first_layer: int | None = None) -> None:
        """One entry per request, each carrying the entry state of `first_layer` (default: the stack's first)."""
        if not requests:
            raise ValueError("a step needs at least one request")
        ids = [r.request for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError(f"requests {sorted(ids)} list one request twice; give each request one entry")
        self.state.check(ids)  # before the ledger records a dispatch: a step refused here claims no launch
        for r in requests:
            r.inputs.check_for(self.dims, self.config.layers[0] if first_layer is None else first_layer)

    def _is_verify(self, requests: Sequence[StepRequest]) -> bool:
        """Whether `requests` are a verify step of this stack; raises a one-line error for a step a speculative
        stack cannot run (see the module doc) and for accepted counts where they mean nothing or are wrong."""
        q, unconfirmed = self.config.tokens_per_request, self.state.unconfirmed
        given = [r.request for r in requests if r.num_accepted is not None]
        if q == 1:
            if given:
                raise ValueError(
                    f"requests {given} give num_accepted, but this stack has num_speculative_tokens=0 (no verify "
                    "steps); drop num_accepted or build the stack with num_speculative_tokens > 0"
                )
            # Without speculative tokens a request decodes one token a step (vLLM's too); several are a verify step,
            # which only a speculative stack runs as one (run token by token, it would pass for one silently).
            if multi := [(r.request, r.inputs.tokens) for r in requests if not r.prefill and r.inputs.tokens > 1]:
                raise ValueError(
                    f"decode requests {multi} (request, tokens) carry several tokens, but this stack has "
                    "num_speculative_tokens=0: give each decode request one token, mark a prompt chunk prefill=True, "
                    f"or build the stack with num_speculative_tokens={max(n for _, n in multi) - 1} for verify steps"
                )
            return False
        if any(r.prefill for r in requests):
            if not all(r.prefill for r in requests):
                raise ValueError(
                    "a speculative stack runs prefill and verify requests in separate steps; split this step in two"
                )
            if given:
                raise ValueError(f"prefill requests {given} give num_accepted; only verify requests do, drop it")
            if waiting := [r.request for r in requests if unconfirmed[r.request]]:
                raise ValueError(
                    f"requests {waiting} have a verify step whose accepted count is not reported yet; run their "
                    "next verify step (with num_accepted) before prefilling more of them"
                )
            return False
        lens = sorted({r.inputs.tokens for r in requests})
        if lens[-1] > q:
            raise ValueError(
                f"a step of {lens[-1]} tokens per request exceeds this stack's q = {q} (1 + num_speculative_tokens "
                f"{q - 1}); give each request {q} tokens or build the stack with num_speculative_tokens={lens[-1] - 1}"
            )
        if len(lens) > 1:
            raise ValueError(
                f"verify steps are uniform, but this one has {', '.join(map(str, lens))} tokens per request; give "
                f"every request q = {q} tokens (its last token and {q - 1} drafts)"
            )
        if lens[0] != q:
            raise ValueError(
                f"this stack verifies q = {q} tokens per request (num_speculative_tokens {q - 1}); a step of "
                f"{lens[0]} per request is not one of its steps: give each request {q} tokens or build the stack "
                f"with num_speculative_tokens={lens[0] - 1}"
            )
        if missing := [r.request for r in requests if r.num_accepted is None]:
            raise ValueError(
                f"verify requests {missing} give no num_accepted; pass, per request, how many tokens its previous "
                f"verify step accepted (1..{q}; 1 for the first verify after a prefill)"
            )
        if bad := [(r.request, r.num_accepted) for r in requests if not 1 <= int(r.num_accepted or 0) <= q]:
            raise ValueError(f"num_accepted must be in 1..{q} (q of this stack); (request, num_accepted) {bad} are not")
        if fresh := [r.request for r in requests if not unconfirmed[r.request] and r.num_accepted != 1]:
            raise ValueError(
                f"requests {fresh} ran no verify step since their prefill, which commits all its tokens and leaves "
                "the state where a verify that accepted one token does; pass num_accepted=1 for them"
            )
        return True

    def stock_ops(self, step: int, part: str, op: str) -> tuple[str, ...]:
        """The stock ops runtime op `op` of `part` ran as at `step` (executor/ops.toml; [verify] on verify steps)."""
        return self.opmap.stock_ops(part, op, self._verify_steps.get(step, 1))

    def step(self, requests: Sequence[StepRequest], *, mode: Mode = "eager", trace: bool = False) -> StepResult:
        """Run one step (decode, prefill, mixed or verify) for `requests`; a graph step replays the captured graph
        (a decode graph, or on a speculative stack a verify graph)."""
        self._check_requests(requests)
        verify = self._is_verify(requests)
        lens = tuple(r.inputs.tokens for r in requests)
        prefills = sum(r.prefill for r in requests)
        if mode == "graph":
            q = self.config.tokens_per_request
            if q > 1 and not verify:  # `_is_verify` let it through, so it is a prefill step
                raise ValueError(
                    f"a CUDA-graph step of this speculative stack is a verify step (q = {q} tokens per request, each "
                    "with num_accepted); run prefill steps with mode='eager'"
                )
            if q == 1 and (prefills or max(lens) > 1):
                raise ValueError("a CUDA-graph step takes one decode token per request; run prefill and mixed eagerly")
            if trace:
                raise ValueError("a CUDA-graph step keeps no per-layer trace; run it eagerly with trace=True")
        if verify:
            return self._verify_step(requests, trace, mode)
        if mode == "graph":
            return self._graph_step(requests)
        if trace and max(lens) > 1:
            raise ValueError("trace=True needs a one-token step (one iteration through the layers)")
        plan = self._plan(StepInput(step=self._step, query_lens=lens, num_prefills=prefills, mode="eager"))
        self.ledger.record(*self._records(plan, None, self.config.layers))
        outputs: dict[int, list[Tensor]] = {r.request: [] for r in requests}
        layer_trace: list[LayerTrace] | None = [] if trace else None
        for t in range(max(lens)):
            active = [r for r in requests if r.inputs.tokens > t]
            ids = [r.request for r in active]
            tables = self.state.tables(ids)
            inputs = StackInput.cat([r.inputs.rows(slice(t, t + 1)) for r in active]).to(self.device)
            self.eager.load(inputs, tables)
            splits = self.attention.mla_num_splits(len(ids), tables.max_seq_len) if self.config.mla_layers else 1
            self._where = (self._step, -1, None)
            with self._running(plan, len(ids)):
                out = self.runner.forward(self.eager, len(ids), self.config.layers, splits, layer_trace)
            for b, r in enumerate(ids):
                outputs[r].append(out[b : b + 1].clone())
            self.state.advance(ids)
        result = StepResult(
            step=self._step,
            plan=plan,
            outputs={r: torch.cat(parts) for r, parts in outputs.items()},
            graph=None,
            trace=None if layer_trace is None else tuple(layer_trace),
        )
        self._step += 1
        return result

    def _verify_step(self, requests: Sequence[StepRequest], trace: bool, mode: Mode) -> StepResult:
        """One verify iteration of q tokens per request over B * q rows (module doc): eager, or a replay of the
        smallest verify graph holding the requests, padded with NULL requests. `_is_verify` checked them."""
        q = self.config.tokens_per_request
        ids = [r.request for r in requests]
        accepted = tuple(int(r.num_accepted or 0) for r in requests)
        g = self._graph_for(len(ids)) if mode == "graph" else None
        batch = None if g is None else g.batch
        tables = self.state.verify_tables(ids, accepted, batch)  # raises before anything is recorded or run
        plan = self._plan(
            StepInput(step=self._step, query_lens=(q,) * len(ids), num_accepted=accepted, batch=batch, mode=mode)
        )
        if g is not None and plan.path != g.path:
            raise StepRoutingError(f"graph {g.name} was captured on the {g.path} path but this step plans {plan.path}")
        inputs = StackInput.cat([r.inputs for r in requests]).to(self.device)
        layer_trace: list[LayerTrace] | None = [] if trace else None
        self._verify_steps[self._step] = q
        if g is None:
            note = f"verify of q={q}: KDA states read from slot[b, a-1] with num_accepted a = {list(accepted)}"
            self.ledger.record(*self._records(plan, None, self.config.layers, note))
            rows = len(ids) * q
            self.eager.load(inputs, tables)
            splits = self.attention.mla_num_splits(rows, tables.max_seq_len) if self.config.mla_layers else 1
            self._where = (self._step, -1, None)
            with self._running(plan, rows, q):
                out = self.runner.forward(
                    self.eager, rows, self.config.layers, splits, layer_trace, tokens_per_request=q
                )
        else:
            # Everything this step varies reaches the graph through its buffers (module doc: verify graphs).
            g.buffers.load(inputs, tables)
            g.graph.replay()
            self.ledger.replayed(g.name)
            out = g.output
        self.state.verified(ids, accepted)
        result = StepResult(
            step=self._step,
            plan=plan,
            outputs={r: out[b * q : (b + 1) * q].clone() for b, r in enumerate(ids)},
            graph=None if g is None else g.name,
            trace=None if layer_trace is None else tuple(layer_trace),
        )
        self._step += 1
        return result

    def prefill(self, contexts: Mapping[int, StackInput]) -> StepResult:
        """Prefill each request's context (its tokens' entry states) in one eager stock step."""
        return self.step([StepRequest(r, inputs, prefill=True) for r, inputs in contexts.items()])

    # -- CUDA graphs ---------------------------------------------------------------------------------------------

    def graph_name(self, batch: int, layers: Sequence[int] | None = None) -> str:
        layers = tuple(layers or self.config.layers)
        base = graph_key(batch, self.config.tokens_per_request)
        return base if layers == self.config.layers else f"{base}.L{layers[0]}-{layers[-1]}"

    def capture(self, batch: int, layers: Sequence[int] | None = None) -> str:
        """Capture one iteration of `batch` requests as a CUDA graph (all stack layers, or a consecutive part of
        them for per-layer timing); returns its name. On a speculative stack it is a verify iteration of batch * q
        rows (module doc: verify graphs). Its eager warm-up runs every row as NULL padding."""
        runtime = self.graph_runtime
        if runtime is None:
            raise ValueError(f"CUDA graphs need a CUDA device; this executor runs on {self.device}")
        layers = tuple(layers or self.config.layers)
        all_layers = self.config.layers
        if not set(layers) <= set(all_layers) or list(layers) != list(range(layers[0], layers[-1] + 1)):
            raise ValueError(f"graph layers {list(layers)} must be consecutive layers of the stack {list(all_layers)}")
        if not 1 <= batch <= self.config.max_requests:
            raise ValueError(f"graph batch {batch} outside 1..{self.config.max_requests} (max_requests)")
        name = self.graph_name(batch, layers)
        if name in self.graphs:
            return name
        q = self.config.tokens_per_request
        rows = batch * q
        buffers = StepBuffers.allocate(
            f"graph.{name}", self.dims, layers, rows, self.config.pages_per_request, self.device, verify=q > 1
        )
        buffers.load(None, self.state.verify_tables([], [], batch) if q > 1 else self.state.tables([], rows=batch))
        # A host value the graph keeps for life: the count for its rows at the longest context a step can have.
        splits = self.attention.mla_num_splits(rows, self.config.max_context) if self.config.mla_layers else 1
        warm = self._plan(StepInput(step=self._step, query_lens=(q,) * batch, mode="eager"))
        note = f"CUDA-graph warm-up of {name}: every row is NULL padding, no request state is written"
        self.ledger.record(*self._records(warm, None, layers, note))
        self._where = (self._step, -1, None)
        if q > 1:
            self._verify_steps[self._step] = q
        runtime.warm_up(self._iteration(warm, buffers, rows, layers, splits, q))
        self._step += 1
        plan = self._plan(StepInput(step=self._step, query_lens=(q,) * batch, batch=batch, mode="graph"))
        self._where = (self._step, -1, name)
        if q > 1:
            self._verify_steps[self._step] = q
        graph, output = runtime.capture(self._iteration(plan, buffers, rows, layers, splits, q))
        note = (
            ""
            if q == 1
            else f"verify of q={q}: KDA states read from slot[b, a-1], num_accepted a copied into the graph's buffers "
            "before each replay (a step's counts: its StepResult.plan)"
        )
        self.ledger.record(*self._records(plan, name, layers, note))
        self._step += 1
        self.graphs[name] = CapturedGraph(name, batch, layers, buffers, graph, output, splits, plan.path, q)
        return name

    def _iteration(
        self, plan: StepPlan, buffers: StepBuffers, rows: int, layers: Sequence[int], splits: int, q: int
    ) -> Callable[[], Tensor]:
        """One iteration on a graph's buffers, routed by `plan`: what its warm-up runs and its capture records."""

        def run() -> Tensor:
            with self._running(plan, rows, q):
                return self.runner.forward(buffers, rows, layers, splits, tokens_per_request=q)

        return run

    def _graph_for(self, live: int) -> CapturedGraph:
        full = [g for g in self.graphs.values() if g.layers == self.config.layers and g.batch >= live]
        if not full:
            have = sorted(g.batch for g in self.graphs.values() if g.layers == self.config.layers)
            raise ValueError(
                f"no captured graph holds {live} requests (captured batches: {have}); call capture({live}) first or "
                "run the step with mode='eager'"
            )
        return min(full, key=lambda g: g.batch)

    def _graph_step(self, requests: Sequence[StepRequest]) -> StepResult:
        g = self._graph_for(len(requests))
        plan = self._plan(StepInput(step=self._step, query_lens=(1,) * len(requests), batch=g.batch, mode="graph"))
        if plan.path != g.path:
            raise StepRoutingError(f"graph {g.name} was captured on the {g.path} path but this step plans {plan.path}")
        ids = [r.request for r in requests]
        tables = self.state.tables(ids, rows=g.batch)
        g.buffers.load(StackInput.cat([r.inputs for r in requests]).to(self.device), tables)
        g.graph.replay()
        self.ledger.replayed(g.name)
        outputs = {r: g.output[b : b + 1].clone() for b, r in enumerate(ids)}
        self.state.advance(ids)
        result = StepResult(step=self._step, plan=plan, outputs=outputs, graph=g.name, trace=None)
        self._step += 1
        return result

    def replay(
        self,
        name: str,
        times: int = 1,
        before: Callable[[int], None] | None = None,
        after: Callable[[int], None] | None = None,
    ) -> None:
        """Benchmarks: replay a graph on the inputs and tables already in its buffers, `times` times, without
        advancing any request (every replay rewrites the same cache rows and evolves the same KDA states).
        `before(i)` / `after(i)` run around replay i (to enqueue an L2 flush and timing events)."""
        g = self.graphs.get(name)
        if g is None:
            raise ValueError(f"no graph named {name!r}; captured: {sorted(self.graphs)}")
        for i in range(times):
            if before is not None:
                before(i)
            g.graph.replay()
            if after is not None:
                after(i)
        self.ledger.replayed(name, times)

    def load_graph_inputs(self, name: str, requests: Sequence[StepRequest]) -> None:
        """Benchmarks: put requests' inputs and current tables into a graph's buffers (no replay, no advance). A
        verify graph takes a verify step's requests, q tokens each with its num_accepted."""
        g = self.graphs.get(name)
        if g is None:
            raise ValueError(f"no graph named {name!r}; captured: {sorted(self.graphs)}")
        self._check_requests(requests, g.layers[0])
        ids = [r.request for r in requests]
        if g.tokens_per_request == 1:
            tables = self.state.tables(ids, rows=g.batch)
        elif self._is_verify(requests):
            tables = self.state.verify_tables(ids, [int(r.num_accepted or 0) for r in requests], g.batch)
        else:
            raise ValueError(
                f"graph {name} is a verify graph of q = {g.tokens_per_request}; give it verify requests (q tokens, "
                "num_accepted each), not prefill requests"
            )
        g.buffers.load(StackInput.cat([r.inputs for r in requests]).to(self.device), tables)

    # -- write sets ----------------------------------------------------------------------------------------------

    def buffers_for(self, requests: Sequence[StepRequest], mode: Mode) -> StepBuffers:
        return self._graph_for(len(requests)).buffers if mode == "graph" else self.eager

    def declare(self, requests: Sequence[StepRequest], mode: Mode = "eager") -> WriteSet:
        """The write set of a step: its requests' KDA slots, the MLA cache rows of its new tokens, its buffers (a
        graph step's: those of the graph it replays, whose NULL padding requests write no request state).

        A verify step declares each request's q slots as its [B, q] slot table (the conv row in slot[b, 0], the
        state after each token in slot[b, t]) and the q cache rows from the context its accepted count sets."""
        page_size = self.config.page_size
        verify = self._is_verify(requests)
        slots: list[Any] = []
        cache_slots = []
        for r in requests:
            if verify:
                slots.append(list(self.state.kda_slots(r.request)))
                start = self.state.verify_context(r.request, int(r.num_accepted or 0))
            else:
                slots.append(self.state.kda_slot(r.request))
                start = self.state.context_lens[r.request]
            for pos in range(start, start + r.inputs.tokens):
                if pos >= self.config.max_context:
                    raise ValueError(f"request {r.request} would pass max_context {self.config.max_context}")
                page = int(self.state.block_table_host[r.request, pos // page_size])
                cache_slots.append(page * page_size + pos % page_size)
        buffers = self.buffers_for(requests, mode)
        return declare_step(
            kda_layers=self.config.kda_layers,
            kda_slots=torch.tensor(slots, dtype=torch.int64),
            conv_width=self.dims.kda.conv_width,
            mla_layers=self.config.mla_layers,
            slot_mapping=torch.tensor(cache_slots, dtype=torch.int64),
            page_size=page_size,
            scratch=[f"{buffers.name}.{k}" for k in buffers.tensors()],
        )
