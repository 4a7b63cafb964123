"""The per-step plan: which path each op of each layer takes on one decode step, and why.

Step-level routing follows vLLM 0.33.0's `plan` (vllm/models/kimi_k3/nvidia/specialized_decode/runtime/decode.py):
the specialized path takes a step only when every request decodes one token (pure decode) or verifies the same q
tokens as the deployment's speculative q (uniform verify), and the step's row count (requests x q, graph padding
included) is a prepared size. Prefill, mixed prefill+decode, non-uniform q and unprepared sizes go to stock, each
with its reason. The first failing condition, in that order, is the reason, so every stock step says why.

Within a specialized step the op table decides per op: ops whose kernels are not built yet stay stock with the
table's reason. On a stock step every op is stock with the step's reason.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from k3_decode.config import ModelDims
from k3_decode.runtime.backend import CONFIG_KEY, DecodeBackend, RowLimit
from k3_decode.runtime.ledger import MODES, DispatchRecord, Mode, graph_key
from k3_decode.runtime.optable import DispatchPath, OpTable
from k3_decode.runtime.scopefile import RuntimeScope


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _ranges(values: Iterable[int]) -> str:
    """[1, 2, 3, 4, 16] -> "1-4, 16"."""
    runs: list[list[int]] = []
    for v in sorted(values):
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ", ".join(f"{a}-{b}" if b > a + 1 else (f"{a}, {b}" if b > a else f"{a}") for a, b in runs)


@dataclass(frozen=True)
class PreparedSizes:
    """Row counts (requests x q) the specialized path prepares kernels, scratch and graphs for.

    vLLM 0.33.0's rule: the fixed batches of the scope, plus every CUDA-graph capture size rounded up to a multiple
    of the deployment's q, where that stays within the maximum (vLLM: PREPARED_MAX = 64).
    """

    rows: frozenset[int]
    q: int  # the deployment's tokens per request: 1 + speculative tokens
    max_rows: int

    @classmethod
    def build(cls, scope: RuntimeScope, q: int, capture_sizes: Sequence[int]) -> PreparedSizes:
        if q < 1:
            raise ValueError(f"tokens per request must be >= 1, got {q}")
        rounded = {_round_up(c, q) for c in capture_sizes}
        rows = frozenset(scope.prepared_batches) | {r for r in rounded if r <= scope.max_batch}
        return cls(rows, q, scope.max_batch)

    def describe(self) -> str:
        return _ranges(self.rows)

    def padded_batch(self, requests: int, q: int) -> int | None:
        """The fewest requests >= `requests` whose rows at `q` are prepared (the graph to pad into), or None."""
        fits = [r // q for r in self.rows if r % q == 0 and r >= requests * q]
        return min(fits) if fits else None


@dataclass(frozen=True)
class StepInput:
    """What the executor knows about one step before it runs it."""

    step: int
    query_lens: tuple[int, ...]  # tokens of each live request this step
    num_prefills: int = 0  # how many of the live requests are prefilling
    num_accepted: tuple[int, ...] | None = None  # per live request, tokens the previous verify accepted (1..q)
    batch: int | None = None  # requests after CUDA-graph padding with whole NULL requests; None: no padding
    mode: Mode = "eager"

    def __post_init__(self) -> None:
        n = len(self.query_lens)
        if self.step < 0:
            raise ValueError(f"step must be >= 0, got {self.step}")
        if n == 0 or min(self.query_lens) < 1:
            raise ValueError(f"query_lens must list >= 1 token for each live request, got {list(self.query_lens)}")
        if not 0 <= self.num_prefills <= n:
            raise ValueError(f"num_prefills {self.num_prefills} outside 0..{n} (the live requests)")
        if self.mode not in MODES:
            raise ValueError(f"step mode {self.mode!r} is not one of {', '.join(MODES)}")
        if self.batch is not None:
            if self.batch < n:
                raise ValueError(f"padded batch {self.batch} is smaller than the {n} live requests")
            if self.batch > n and self.mode != "graph":
                raise ValueError("only CUDA-graph steps are padded; pass batch=None for an eager step")
        if self.num_accepted is not None:
            if len(self.num_accepted) != n:
                raise ValueError(f"num_accepted has {len(self.num_accepted)} entries for {n} live requests")
            if bad := [(a, q) for a, q in zip(self.num_accepted, self.query_lens, strict=True) if not 1 <= a <= q]:
                raise ValueError(f"num_accepted must be in 1..q of its request; (accepted, q) pairs {bad} are not")

    @property
    def requests(self) -> int:
        """Requests the step's kernels see, graph padding included."""
        return self.batch if self.batch is not None else len(self.query_lens)


@dataclass(frozen=True)
class OpDecision:
    layer: int
    op: str
    path: DispatchPath
    reason: str


@dataclass(frozen=True)
class StepPlan:
    step: StepInput
    path: DispatchPath  # the step's route; single ops may still be stock on a specialized step
    reason: str
    tokens_per_request: int  # the uniform q, or the largest q of a non-uniform step
    decisions: tuple[OpDecision, ...]

    @property
    def rows(self) -> int:
        return self.step.requests * self.tokens_per_request

    def path_of(self, layer: int, op: str) -> DispatchPath:
        for d in self.decisions:
            if (d.layer, d.op) == (layer, op):
                return d.path
        raise KeyError(f"layer {layer} has no op {op!r} in this plan")

    def records(self, rank: int, graph: str | None = None) -> list[DispatchRecord]:
        """Ledger records of the plan. A graph step is named by its batch descriptor unless `graph` names it."""
        if self.step.mode == "graph":
            graph = graph or graph_key(self.step.requests, self.tokens_per_request)
        elif graph is not None:
            raise ValueError("an eager step belongs to no graph; pass graph=None")
        return [
            DispatchRecord(
                step=self.step.step,
                layer=d.layer,
                op=d.op,
                path=d.path,
                reason=d.reason,
                batch=self.step.requests,
                tokens_per_request=self.tokens_per_request,
                mode=self.step.mode,
                rank=rank,
                graph=graph,
            )
            for d in self.decisions
        ]


@dataclass(frozen=True)
class Planner:
    """Plans the steps of one deployment over a stack of layers."""

    backend: DecodeBackend
    table: OpTable
    prepared: PreparedSizes
    specialized_modes: tuple[str, ...]
    dims: ModelDims
    layers: tuple[int, ...]
    # Per specialized op, the rows its provider serves at this deployment and why (a kernel that loses to the stock
    # op at a batch size is not run there: above one limit, or between ranges); an op without an entry is served at
    # every prepared size.
    op_rows: Mapping[str, RowLimit] = field(default_factory=dict)
    # Per (op, layer), a limit that replaces the op's at that layer (backend.ProviderRegistry.layer_row_limits).
    layer_rows: Mapping[tuple[str, int], RowLimit] = field(default_factory=dict)
    # Specialized ops whose provider cannot serve this deployment at all, and why (backend.ProviderRegistry
    # .kept_stock): stock on every step, each decision with that reason.
    op_stock: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for layer in self.layers:
            self.table.layer_ops(self.dims, layer)  # raises on a layer the model does not have

    def route(self, step: StepInput) -> tuple[DispatchPath, str]:
        """The step's path and the reason: the first failing condition, or what made it specialized."""
        if self.backend != "latency_specialized":
            return "stock", f"{CONFIG_KEY} {self.backend!r} selects the stock path"
        if step.mode not in self.specialized_modes:
            return "stock", f"{step.mode} step (the specialized path runs in {' and '.join(self.specialized_modes)})"
        live = len(step.query_lens)
        if step.num_prefills == live:
            return "stock", f"prefill batch ({live} prefill requests)"
        if step.num_prefills:
            return "stock", f"mixed batch ({step.num_prefills} prefill and {live - step.num_prefills} decode requests)"
        qs = sorted(set(step.query_lens))
        if len(qs) > 1:
            return "stock", f"non-uniform tokens per request ({', '.join(map(str, qs))})"
        q, requests = qs[0], step.requests
        if q > 1 and q != self.prepared.q:
            prepared = f"q={self.prepared.q}" if self.prepared.q > 1 else "decode only (no speculative tokens)"
            return "stock", f"verify with {q} tokens per request (kernels prepared for {prepared})"
        size = f"batch {requests}" if q == 1 else f"batch {requests} x q {q} = {requests * q} rows"
        if requests * q > self.prepared.max_rows:
            return "stock", f"{size} above the prepared maximum of {self.prepared.max_rows} rows"
        if requests * q not in self.prepared.rows:
            return "stock", f"{size} not prepared (prepared rows: {self.prepared.describe()})"
        kind = "pure decode" if q == 1 else "uniform verify"
        return "specialized", f"{kind}, {size} prepared"

    def plan(self, step: StepInput) -> StepPlan:
        path, reason = self.route(step)
        rows = step.requests * max(step.query_lens)
        decisions: list[OpDecision] = []
        for layer in self.layers:
            for part, op in self.table.layer_ops(self.dims, layer):
                limit = self.layer_rows.get((op, layer), self.op_rows.get(op))
                if path == "specialized" and part.path_on_specialized_step(op) == "stock":
                    decisions.append(OpDecision(layer, op, "stock", part.stock_reason))
                elif path == "specialized" and op in self.op_stock:
                    decisions.append(OpDecision(layer, op, "stock", self.op_stock[op]))
                elif path == "specialized" and limit is not None and not limit.serves(rows):
                    decisions.append(OpDecision(layer, op, "stock", limit.stock_reason(rows)))
                else:
                    decisions.append(OpDecision(layer, op, path, reason))
        return StepPlan(step, path, reason, max(step.query_lens), tuple(decisions))
