"""The CuTe DSL kernels as specialized providers of the runtime (k3_decode/runtime/backend.py).

Two ops of a KDA layer have providers: `attn_res` (the AttnRes before attention, one CuTe DSL kernel per
application) and `in_proj` (the packed input projection as a weight stream). Each became a provider only after its
GPU test passed against the oracle on an H200 (tests/k3_decode/kernels/test_attn_res_gpu.py,
test_kda_in_proj_gpu.py). The other ops of the layer stay stock, with the op table's reason in the ledger.

"Built" means the kernels can be compiled and run here: CuTe DSL imports and the current CUDA device is a Hopper
GPU (sm_90, the architecture the kernels target). `register_built` registers both or neither and says why not;
the runtime calls it once before it reads the backend, so `latency_specialized` is refused at start-up on a
machine where they cannot run ("the specialized kernels are not built"), never run stock under that name.
"""

from __future__ import annotations

import importlib.util
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cache
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from k3_decode.attn_res_state import AttnResBuffers, AttnResSite
from k3_decode.reference.attn_res import MixWeights
from k3_decode.runtime.backend import ProviderRegistry, RowLimit
from k3_decode.weights import KdaWeights, ResidualWeights

TARGET_CAPABILITY = (9, 0)  # sm_90a: wgmma-era Hopper, what kernels/builds.toml compiles for
CHOICE = Path(__file__).with_name("providers.toml")  # where each provider serves: its row limits
# The most rows a specialized step has (k3-hopper.toml max_batch; vLLM 0.33.0's PREPARED_MAX): a range past it names
# sizes no step runs, so it is a typo, not a measurement.
MAX_ROWS = 64
LIMIT_KEYS = ("max_rows", "rows")  # an entry's row limit: one of the two


def limits(path: Path | None = None) -> dict[str, Any]:
    """providers.toml (or `path`), checked; a malformed file is a ValueError naming it and the entry."""
    return _limits(path or CHOICE)


def _max_rows(rows: object, where: str) -> None:
    if not isinstance(rows, dict) or not all(
        k.isdigit() and isinstance(v, int) and not isinstance(v, bool) and v >= 1 for k, v in rows.items()
    ):
        raise ValueError(f'{where} is {{ "<tp>" = rows, ... }} with rows >= 1, got {rows!r}')


def _row_ranges(rows: object, where: str) -> None:
    """A `rows = { "<tp>" = [[first, last], ...] }` table: per TP size, the inclusive row ranges served, sorted and
    not overlapping, within 1..MAX_ROWS. A ValueError, one line, names the entry, the range and the fix."""
    fix = (
        f'write {{ "<tp>" = [[first, last], ...] }}: inclusive ranges within 1..{MAX_ROWS}, sorted, not overlapping '
        '(e.g. { "8" = [[1, 8], [16, 16], [33, 64]] })'
    )
    if not isinstance(rows, dict) or not rows:
        raise ValueError(f"{where} is {rows!r}; {fix}")
    for tp, ranges in rows.items():
        at = f'{where} "{tp}" = {ranges!r}'
        if not tp.isdigit():
            raise ValueError(f"{where}: {tp!r} is not a TP size; {fix}")
        if not isinstance(ranges, list) or not ranges:
            raise ValueError(f"{at}: no ranges; {fix}")
        for r in ranges:
            if not (isinstance(r, list) and len(r) == 2 and all(type(b) is int for b in r)):
                raise ValueError(f"{at}: {r!r} is not a [first, last] pair of row counts; {fix}")
            if r[0] > r[1]:
                raise ValueError(f"{at}: {r} has first > last; {fix}")
            if r[0] < 1 or r[1] > MAX_ROWS:
                raise ValueError(f"{at}: {r} is outside 1..{MAX_ROWS}; {fix}")
        for a, b in pairwise(ranges):
            if b[0] < a[0]:
                raise ValueError(f"{at}: {b} comes after {a} (unsorted); {fix}")
            if b[0] <= a[1]:
                raise ValueError(f"{at}: {b} overlaps {a}; {fix}")


def _row_limit(table: Mapping[str, Any], where: str) -> None:
    """The one row limit of an entry or its [.mixing]: max_rows (1..N per TP size) or rows (ranges per TP size)."""
    given = [key for key in LIMIT_KEYS if key in table]
    if len(given) == 2:
        raise ValueError(
            f'{where} gives both max_rows and rows; keep one: max_rows = {{ "<tp>" = N }} serves 1..N, '
            'rows = { "<tp>" = [[first, last], ...] } the ranges listed'
        )
    if given == ["max_rows"]:
        _max_rows(table["max_rows"], f"{where} max_rows")
    elif given == ["rows"]:
        _row_ranges(table["rows"], f"{where} rows")


@cache
def _limits(path: Path) -> dict[str, Any]:
    table = tomllib.loads(path.read_text())
    for op, entry in table.items():
        where = f"{path.name}: [{op}]"
        if (
            not isinstance(entry, dict)
            or not any(key in entry for key in LIMIT_KEYS)
            or not str(entry.get("why", "")).strip()
        ):
            raise ValueError(f"{where} needs max_rows and a why (or rows, ranges per TP size, in place of max_rows)")
        _row_limit(entry, where)
        if "tp_all_reduce" in entry and not str(entry.get("tp_all_reduce_why", "")).strip():
            raise ValueError(f"{where} tp_all_reduce needs a tp_all_reduce_why")
        mixing = entry.get("mixing")
        if mixing is not None:
            keys = set(mixing) if isinstance(mixing, dict) else set()
            if (
                keys - {"min_blocks", "why"} not in ({"max_rows"}, {"rows"}, set(LIMIT_KEYS))
                or "why" not in keys
                or not isinstance(mixing.get("min_blocks"), int)
            ):
                raise ValueError(
                    f"{where}.mixing is min_blocks (a count), max_rows (or rows) and why, got {sorted(keys)}"
                )
            _row_limit(mixing, f"{where}.mixing")
    return table


def _ranges_at(table: Mapping[str, Any], tp: int) -> tuple[tuple[int, int], ...] | None:
    """The row ranges an entry (or its [.mixing]) lists at `tp`, from either form; None where it names no limit."""
    if "rows" in table:
        ranges = table["rows"].get(str(tp))
        return None if ranges is None else tuple((int(a), int(b)) for a, b in ranges)
    most = table["max_rows"].get(str(tp))
    return None if most is None else ((1, int(most)),)


def served_rows(op: str, name: str, tp: int, blocks: int | None = None) -> RowLimit | None:
    """The rows the provider `name` of `op` serves at `tp` and why (providers.toml), or None for no limit. `blocks`:
    the bank blocks the layer's AttnRes after attention mixes, for an op with a [<op>.mixing] limit that applies
    from `min_blocks` on in place of its own."""
    entry = limits().get(op)
    if entry is None:
        return None
    mixing = entry.get("mixing")
    if blocks is not None and mixing is not None and blocks >= mixing["min_blocks"]:
        ranges = _ranges_at(mixing, tp)
        if ranges is not None:
            return RowLimit(
                ranges,
                f"rows {name} serves at TP{tp} where the AttnRes after attention mixes {mixing['min_blocks']} or "
                f"more bank blocks ({mixing['why']})",
            )
    ranges = _ranges_at(entry, tp)
    return None if ranges is None else RowLimit(ranges, f"rows {name} serves at TP{tp} ({entry['why']})")


def max_rows(op: str, name: str, tp: int, blocks: int | None = None) -> tuple[int, str] | None:
    """(most rows, why) for a provider that serves 1..most at `tp` (served_rows), or None for no limit. A limit with
    gaps (rows ranges) raises ValueError rather than hand back its last row, which a caller would read as 1..N."""
    limit = served_rows(op, name, tp, blocks)
    if limit is None:
        return None
    if limit.ranges != ((1, limit.most),):
        raise ValueError(
            f"providers.toml [{op}] serves {limit.describe()} rows at TP{tp}, not 1..N; ask served_rows for the ranges"
        )
    return limit.most, limit.why


def mixing_min_blocks(op: str) -> int | None:
    """The bank blocks from which providers.toml's [<op>.mixing] rows replace the op's own, or None without them."""
    mixing = limits().get(op, {}).get("mixing")
    return None if mixing is None else int(mixing["min_blocks"])


class ProviderBindError(RuntimeError):
    pass


def _check_target(target: Any, what: str) -> None:
    device = torch.device(target.device)
    if device.type != "cuda":
        raise ProviderBindError(f"the CuTe DSL {what} runs on a CUDA device, the stack is on {device}; use 'auto'")
    capability = torch.cuda.get_device_capability(device)
    if capability != TARGET_CAPABILITY:
        raise ProviderBindError(
            f"the CuTe DSL {what} is built for sm_90a, the device is sm_{capability[0]}{capability[1]}; use 'auto'"
        )


def _launch_counts() -> dict[str, Callable[[], int]]:
    """Each kernel's device-counter reader, by the kernel name the providers declare in `launches`."""
    from k3_decode.kernels import attn_res_op, kda_in_proj_op, kda_o_proj_op, kda_step_op

    return {
        "AttnResKernel": attn_res_op.launch_count,
        "KdaInProjKernel": kda_in_proj_op.launch_count,
        "KdaOProjKernel": kda_o_proj_op.launch_count,
        "KdaStepKernel": kda_step_op.launch_count,
    }


class _CuteProvider:
    """What every provider here shares: its row limit from providers.toml and its kernels' device counters."""

    op: str
    name: str
    launches: Mapping[str, int]

    def served_rows(self, tp: int) -> RowLimit | None:
        """The rows this provider serves at `tp` (providers.toml); what the runtime asks (ProviderRegistry
        .row_limits)."""
        return served_rows(self.op, self.name, tp)

    def max_rows(self, tp: int) -> tuple[int, str] | None:
        """(most rows, why) where it serves 1..most at `tp`; a ValueError where it serves ranges (see max_rows)."""
        return max_rows(self.op, self.name, tp)

    def refuses(self, tp_all_reduce: bool) -> str | None:
        """Why this provider cannot serve a deployment whose TP all-reduces run (providers.toml), or None."""
        entry = limits().get(self.op, {})
        if tp_all_reduce and entry.get("tp_all_reduce") is False:
            return f"{self.name} serves one rank's shard alone ({entry['tp_all_reduce_why']})"
        return None

    def device_counts(self) -> dict[str, int]:
        """Launches of this provider's kernels the device-side counters saw in this process (kernels/counters.py)."""
        readers = _launch_counts()
        return {kernel: readers[kernel]() for kernel in self.launches}


@dataclass(frozen=True)
class CuteAttnResProvider(_CuteProvider):
    """AttnRes before attention: prefix update, block save, source mixing and the input RMSNorm, one kernel."""

    op: str = "attn_res"
    name: str = "cute-attn-res"
    # Kernel names are substrings of the CUDA names CuTe DSL gives its kernels (kernel_cutlass_kernel_<module><class>
    # _object_at_<signature>), which the ledger matches against the profiler's names.
    launches: Mapping[str, int] = field(default_factory=lambda: {"AttnResKernel": 1})

    def bind(self, target: Any) -> Mapping[str, Callable[..., Any]]:
        from k3_decode.kernels import attn_res_op

        _check_target(target, "AttnRes")
        block_size, eps = target.dims.attn_res_block_size, target.dims.rms_norm_eps

        def attn_res_before(
            buffers: AttnResBuffers, layer: int, delta: Tensor | None, residual: ResidualWeights
        ) -> Tensor:
            weights = MixWeights(residual.attn_res.norm, residual.attn_res.proj, residual.input_norm)
            return attn_res_op.apply(buffers, AttnResSite.before_attention(layer, block_size), delta, weights, eps)

        return {"attn_res_before": attn_res_before}


@dataclass(frozen=True)
class CuteKdaInProjProvider(_CuteProvider):
    """The packed KDA input projection x[B, hidden] @ W[rows, hidden]^T, one weight-streaming kernel."""

    op: str = "in_proj"
    name: str = "cute-kda-in-proj"
    launches: Mapping[str, int] = field(default_factory=lambda: {"KdaInProjKernel": 1})

    def bind(self, target: Any) -> Mapping[str, Callable[..., Any]]:
        from k3_decode.kernels import kda_in_proj_op

        _check_target(target, "KDA input projection")

        def kda_in_proj(x: Tensor, weights: KdaWeights) -> Tensor:
            return kda_in_proj_op.linear(x.contiguous(), weights.in_proj)

        return {"kda_in_proj": kda_in_proj}


class FusedCallError(RuntimeError):
    """The layer runner called a fused provider's calls in an order its one launch cannot serve."""


class OneLaunch:
    """What lets two runner calls be one launch: the o_proj call keeps its operands and hands back the buffer the
    fused kernel will write o_proj's output (the partial) into; the AttnRes call after attention, which consumes that
    output, takes them back and launches the kernel that computes both. In stream order the buffer holds o_proj's
    output once the AttnRes call has launched, before anything later in the stream reads it.

    Only that order is served: an o_proj call whose output was not consumed, or an AttnRes call on a tensor other
    than the buffer handed back (a TP all-reduce's result, say), raises instead of computing from a stale buffer."""

    def __init__(self) -> None:
        self._pending: tuple[Tensor, Tensor, Tensor] | None = None

    def defer(self, o: Tensor, weight: Tensor) -> Tensor:
        """Keep o [B, K] and weight [H, K]; returns the [B, H] buffer the launch will write o @ weight^T into."""
        if self._pending is not None:
            self._pending = None
            raise FusedCallError(
                "o_proj was called again before the AttnRes after attention consumed the previous output; the fused "
                "kernel computes both in one launch, so each o_proj call must be followed by its AttnRes call"
            )
        partial = torch.empty(o.shape[0], weight.shape[0], dtype=o.dtype, device=o.device)
        self._pending = (o, weight, partial)
        return partial

    def take(self, partial: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(o, weight, partial) of the deferred o_proj call whose output `partial` is; raises for any other tensor."""
        pending, self._pending = self._pending, None
        if pending is None or pending[2] is not partial:
            raise FusedCallError(
                "the AttnRes after attention must consume the o_proj output this provider's o_proj call returned "
                "(the fused kernel computes both in one launch); it got "
                + ("no deferred o_proj call" if pending is None else "another tensor")
            )
        return pending


@dataclass(frozen=True)
class CuteKdaOProjProvider(_CuteProvider):
    """o_proj and the AttnRes after attention in one launch (kda_o_proj.py): the `kda_o_proj` call defers the launch
    and returns the buffer o_proj's output will be in, the `attn_res_after` call on it launches the fused kernel
    (OneLaunch), so the two runner calls of op o_proj (executor RUNNER_CALLS) are one kernel.

    One rank's shard alone only: with a TP all-reduce between o_proj and the AttnRes (k3_decode.distributed) the
    partials would have to be combined inside the kernel, which is not built yet (kda_o_proj.py says where it goes).
    So a deployment whose all-reduces run keeps o_proj stock (providers.toml tp_all_reduce, `refuses`; the plan
    records why), and the o_proj call still refuses a stack that combines partials without having said so at
    start-up, rather than run either half apart.

    Registered after tests/k3_decode/kernels/test_kda_o_proj_gpu.py passed on an H200 (TP8 B1: 8.5 us against
    14.5 us for cuBLAS + the AttnRes kernel)."""

    op: str = "o_proj"
    name: str = "cute-kda-o-proj"
    launches: Mapping[str, int] = field(default_factory=lambda: {"KdaOProjKernel": 1})

    def bind(self, target: Any) -> Mapping[str, Callable[..., Any]]:
        from k3_decode.kernels import kda_o_proj_op

        _check_target(target, "o_proj")
        block_size, eps = target.dims.attn_res_block_size, target.dims.rms_norm_eps
        one = OneLaunch()

        def kda_o_proj(o: Tensor, weights: KdaWeights) -> Tensor:
            if target.combines_partials():
                raise ProviderBindError(
                    "the fused o_proj + AttnRes kernel serves one rank's shard alone; this stack combines o_proj's "
                    "partials across ranks (a TP all-reduce) before the AttnRes, which the kernel does not do yet; "
                    "start the executor with tp_all_reduce=True so the plan keeps o_proj stock"
                )
            return one.defer(o.contiguous(), weights.o_proj)

        def attn_res_after(buffers: AttnResBuffers, layer: int, attn_out: Tensor, residual: ResidualWeights) -> Tensor:
            o, weight, partial = one.take(attn_out)
            weights = MixWeights(residual.mlp_res.norm, residual.mlp_res.proj, residual.post_attn_norm)
            site = AttnResSite.after_attention(layer, block_size)
            _, mlp_input = kda_o_proj_op.apply(o, weight, buffers, site, weights, eps, attn_out=partial)
            return mlp_input

        return {"kda_o_proj": kda_o_proj, "attn_res_after": attn_res_after}

    def layer_served_rows(self, tp: int, dims: Any, layer: int) -> RowLimit | None:
        """The row limit at one layer: the stock pair's AttnRes grows with the bank blocks it mixes, so where the
        layer's AttnRes after attention mixes enough of them the kernel serves more rows (providers.toml)."""
        return served_rows(self.op, self.name, tp, self._blocks(dims, layer))

    def layer_max_rows(self, tp: int, dims: Any, layer: int) -> tuple[int, str] | None:
        """layer_served_rows as (most rows, why), for a limit of 1..most (see max_rows)."""
        return max_rows(self.op, self.name, tp, self._blocks(dims, layer))

    @staticmethod
    def _blocks(dims: Any, layer: int) -> int:
        return AttnResSite.after_attention(layer, dims.attn_res_block_size).num_blocks


@dataclass(frozen=True)
class CuteKdaStepProvider(_CuteProvider):
    """The KDA step as one kernel (kda_step.py): the decode step (q = 1) in place of the stock f_b GEMM + Triton
    kernel, and the verify step (q <= 8 tokens per request, KdaStepKernel.verify) in place of the stock f_b GEMM +
    conv + fla-core recurrence + state scatter + gated norm: f_b, conv, norms, gates, the delta rule on the recurrent
    state in place, the gated RMSNorm; NULL slots (<= 0) give zeros and touch no state, as stock. Both launch one
    kernel named KdaStepKernel, counted by one device counter, so `launches` holds for either call.

    It binds the calls of op kda that the layer runner makes (executor RUNNER_CALLS, with the stock methods'
    signatures): `kda_decode` on decode steps and `kda_verify` (StockAttentionOps.kda_verify: packed [B, q, rows],
    weights, cache, slots [B, q], num_accepted [B]) on the verify steps of a speculative stack (executor/forward.py).
    A call of op kda it has no kernel for is a bind error. The decode launcher takes the conv row of a stack without
    speculative tokens (W - 1 columns) and the verify launcher exactly 2 + q columns, which is what the executor's
    speculative stacks allocate; a speculative stack runs no decode steps (executor.py), so the two never meet.

    Registered after tests/k3_decode/kernels/test_kda_step_gpu.py and test_kda_step_verify_gpu.py passed on an H200
    (TP8 B1 decode 3.5 us against 11.3 us for the stock f_b GEMM + Triton kernel)."""

    op: str = "kda"
    name: str = "cute-kda-step"
    launches: Mapping[str, int] = field(default_factory=lambda: {"KdaStepKernel": 1})

    def bind(self, target: Any) -> Mapping[str, Callable[..., Any]]:
        from k3_decode.executor.executor import RUNNER_CALLS
        from k3_decode.kernels import kda_step_op
        from k3_decode.reference.kda import KdaCache, KdaSpec

        _check_target(target, "KDA step")
        spec = KdaSpec.for_rank(target.dims, target.tp)

        def kda_decode(packed: Tensor, weights: KdaWeights, cache: KdaCache, slots: Tensor) -> Tensor:
            return kda_step_op.decode_step(spec, weights, packed.contiguous(), cache, slots.contiguous())

        def kda_verify(
            packed: Tensor, weights: KdaWeights, cache: KdaCache, slots: Tensor, num_accepted: Tensor
        ) -> Tensor:
            return kda_step_op.verify_step(
                spec, weights, packed.contiguous(), cache, slots.contiguous(), num_accepted.contiguous()
            )

        served = {"kda_decode": kda_decode, "kda_verify": kda_verify}
        calls = [call for call, ops in RUNNER_CALLS["kda"][1].items() if self.op in ops]
        unknown = [call for call in calls if call not in served]
        if unknown:
            raise ProviderBindError(
                f"the layer runner makes op kda's call(s) {unknown}, which {self.name} has no kernel for; it serves "
                f"{sorted(served)}"
            )
        return {call: served[call] for call in calls}


PROVIDERS = (CuteAttnResProvider(), CuteKdaInProjProvider(), CuteKdaStepProvider(), CuteKdaOProjProvider())
# Written and compiled, waiting for their GPU run: a provider stays here, unregistered, until its GPU tests pass.
PENDING: tuple[_CuteProvider, ...] = ()


def not_built_reason() -> str | None:
    """Why the kernels cannot run on this machine (one line), or None when they can."""
    if importlib.util.find_spec("cutlass") is None:
        return "CuTe DSL is not installed (pip install 'k3gate[cutedsl]')"
    if not torch.cuda.is_available():
        return "no CUDA device (the CuTe DSL kernels run on an sm_90 GPU)"
    capability = torch.cuda.get_device_capability()
    if capability != TARGET_CAPABILITY:
        return f"the CUDA device is sm_{capability[0]}{capability[1]}; the CuTe DSL kernels are built for sm_90a"
    return None


def register_built(registry: ProviderRegistry) -> str | None:
    """Register every provider into `registry` when the kernels can run here (once; a second call is a no-op).
    Returns why they were not registered, or None."""
    reason = not_built_reason()
    if reason is None:
        for provider in PROVIDERS:
            if registry.get(provider.op) is None:
                registry.register(provider)
    return reason
