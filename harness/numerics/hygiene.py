"""Run one cell of one op against its oracle, with the checks every kernel must pass beyond the numbers.

Each probe targets a way agent-written kernels are known to cheat or break (KernelBench #165 zero outputs,
GPU MODE's result caching and side-stream work, robust-kbench's grid-shaped kernels):
- outputs within tolerance, with a non-trivial reference (a zero or constant output cannot pass);
- output dtype and layout as specified;
- inputs unchanged, and in-place state changed only inside the declared write set, equal to the oracle's;
- guard bands around every input untouched (no out-of-bounds writes);
- the oracle's entry points are not called while the implementation runs;
- reruns bit-identical where determinism is promised;
- new values in the same buffers give new, correct results (no caching by address or shape);
- several chained steps stay correct (stale state reads show only over steps);
- on a GPU, the work runs on the caller's stream: results are read after syncing only that stream.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import CodeType
from typing import Any

import torch

from harness.numerics.cells import Case, Impl, OpCall
from harness.numerics.compare import Tolerance, ToleranceTable, compare
from harness.verdicts import Check

GUARD = 64  # elements of sentinel on each side of every input tensor
# Values no kernel plausibly writes; FP8 has no such finite value (every byte but NaN is a plausible output), so
# its bands hold NaN, compared by bits.
_SENTINEL = {
    torch.float32: -7.25e30,
    torch.float64: -7.25e300,
    torch.bfloat16: -3.0e38,
    torch.float16: -6.0e4,
    torch.float8_e4m3fn: float("nan"),
}


@dataclass
class CellResult:
    case_id: str
    axes: dict[str, Any]
    checks: list[Check] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)


def _sentinel(dtype: torch.dtype) -> float | int:
    if dtype.is_floating_point:
        return _SENTINEL.get(dtype, -1.0)
    if dtype == torch.bool:
        return True
    return torch.iinfo(dtype).min if dtype != torch.uint8 else 0xA5


def guarded(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(a view with t's values inside a larger buffer, the buffer) — sentinels fill GUARD elements each side."""
    flat = torch.full((t.numel() + 2 * GUARD,), _sentinel(t.dtype), dtype=t.dtype, device=t.device)
    view = flat[GUARD : GUARD + t.numel()].view(t.shape)
    view.copy_(t)
    return view, flat


def _bands_intact(flat: torch.Tensor) -> bool:
    fill = _bits(torch.full((GUARD,), _sentinel(flat.dtype), dtype=flat.dtype, device=flat.device))
    return torch.equal(_bits(flat[:GUARD]), fill) and torch.equal(_bits(flat[-GUARD:]), fill)


class OracleCalled(RuntimeError):
    pass


@contextmanager
def oracle_guard(forbidden: Iterable[CodeType]):
    """Record calls into the oracle's entry points while the implementation runs (an implementation that
    returns the reference by calling it passes every numeric check)."""
    codes = set(forbidden)
    seen: list[str] = []

    def profiler(frame, event, _arg):
        if event == "call" and frame.f_code in codes:
            seen.append(frame.f_code.co_name)

    previous = sys.getprofile()
    sys.setprofile(profiler)
    try:
        yield seen
    finally:
        sys.setprofile(previous)


def _run_on_stream(impl: Impl, call: OpCall) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(outputs, tensors after the call) as the caller's stream sees them.

    On a GPU the call runs on a fresh non-default stream and both are snapshotted on that stream before it is
    synchronized: work an implementation left on another stream, unsynchronized, shows up as stale values.
    """
    if not any(t.device.type == "cuda" for t in call.tensors.values()):
        out = impl(call)
        return out, dict(call.tensors)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = impl(call)
        seen_out = {k: v.clone() for k, v in out.items()}
        seen_state = {k: v.clone() for k, v in call.tensors.items()}
    stream.synchronize()
    return seen_out, seen_state


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Element-wise raw bits, so NaN == NaN and -0 != +0 when comparing before/after."""
    if t.dtype in (torch.float32, torch.int32):
        return t.contiguous().view(torch.int32)
    if t.dtype in (torch.float64, torch.int64):
        return t.contiguous().view(torch.int64)
    if t.dtype in (torch.bfloat16, torch.float16, torch.int16):
        return t.contiguous().view(torch.int16)
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t


def _bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].shape == b[k].shape and torch.equal(_bits(a[k]), _bits(b[k])) for k in a)


def _tolerances(case: Case, table: ToleranceTable) -> dict[str, Tolerance]:
    """The tolerance entry of every output and in-place tensor of the case's op (looked up before anything runs,
    so a missing entry fails the cell at once)."""
    spec = case.spec
    return {name: table.get(spec.tolerance_of(name), spec.dtype_of(name)) for name in (*spec.outputs, *spec.inplace)}


def _unit_size(case: Case, name: str, tol: Tolerance) -> int | None:
    """Elements per unit of `name` where its entry counts matches by a unit other than the element (the table
    names the unit, the case knows its size: the harness knows neither model), None where the case defines none."""
    if tol.matched_unit == "element":
        return 1
    size_of = getattr(case, "unit_size", None)
    return size_of(name, tol.matched_unit) if size_of is not None else None


def _judge(
    name: str, case: Case, key: str, actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance
) -> tuple[list[Check], dict[str, Any]]:
    """compare() with the unit size the case declares for output or in-place tensor `key`."""
    return compare(name, actual, expected, tol, _unit_size(case, key, tol))


def _compare_all(
    prefix: str,
    case: Case,
    out: dict[str, torch.Tensor],
    ref: dict[str, torch.Tensor],
    tols: dict[str, Tolerance],
) -> tuple[list[Check], dict[str, Any]]:
    checks: list[Check] = []
    metrics: dict[str, Any] = {}
    spec = case.spec
    missing = [k for k in spec.outputs if k not in out]
    checks.append(Check(f"{prefix}outputs returned", missing, "==", []))
    for name in spec.outputs:
        if name in out:
            c, m = _judge(f"{prefix}{name}", case, name, out[name], ref[name], tols[name])
            checks += c
            metrics[name] = m
    return checks, metrics


def run_cell(
    case: Case,
    impl: Impl,
    device: torch.device,
    table: ToleranceTable,
    forbidden: Iterable[CodeType] = (),
    seed: int = 0,
) -> CellResult:
    spec = case.spec
    tols = _tolerances(case, table)
    result = CellResult(case.id, dict(case.axes))
    forbidden = tuple(forbidden)

    # 1. One guarded call: outputs, layout, inputs, state, guard bands, oracle calls.
    base = case.make(seed, device)
    ref = case.reference(base.clone())
    allowed = case.allowed_writes(base)
    bufs: dict[str, torch.Tensor] = {}
    call = OpCall({}, dict(base.args))
    for k, t in base.tensors.items():
        call.tensors[k], bufs[k] = guarded(t)
    before = {k: t.clone() for k, t in call.tensors.items()}
    with oracle_guard(forbidden) as oracle_calls:
        out, after = _run_on_stream(impl, call)
    checks, metrics = _compare_all("", case, out, ref, tols)
    result.metrics.update(metrics)
    for name in spec.outputs:
        if name in out:
            want_dtype = getattr(torch, spec.dtype_of(name))
            checks.append(Check(f"{name}: dtype", str(out[name].dtype), "==", str(want_dtype)))
            checks.append(Check(f"{name}: contiguous", out[name].is_contiguous(), "==", True))
    for k in call.tensors:
        if k in spec.inplace:
            changed = _bits(after[k]) != _bits(before[k])
            outside = int((changed & ~allowed[k]).sum())  # masks have the tensor's shape
            checks.append(Check(f"{k}: writes outside the declared write set", outside, "==", 0))
            c, _ = _judge(f"{k} (state after the call)", case, k, after[k], ref[k], tols[k])
            checks += c
        else:
            same = torch.equal(_bits(after[k]), _bits(before[k]))
            checks.append(Check(f"{k}: input unchanged", same, "==", True))
        checks.append(Check(f"{k}: guard bands intact (no out-of-bounds writes)", _bands_intact(bufs[k]), "==", True))
    checks.append(Check("oracle entry points called by the implementation", sorted(set(oracle_calls)), "==", []))

    # 2. Determinism: the same inputs again, in new buffers.
    if spec.deterministic:
        again = base.clone()
        out2, _ = _run_on_stream(impl, again)
        checks.append(Check("bit-identical rerun", _bit_equal(out, {k: out2[k] for k in out if k in out2}), "==", True))

    # 3. New values in the same buffers (defeats caching keyed by address, shape or version counters).
    fresh = case.make(seed + 1000, device)
    reuse = OpCall(call.tensors, dict(fresh.args))  # the very buffers of the first call
    for k, t in reuse.tensors.items():
        t.copy_(fresh.tensors[k])
    ref_fresh = case.reference(fresh.clone())
    out3, _ = _run_on_stream(impl, reuse)
    c, _ = _compare_all("fresh values in reused buffers: ", case, out3, ref_fresh, tols)
    checks += c

    # 4. Chained steps: state written by step s is read by step s+1.
    if spec.steps > 1 and spec.inplace:
        impl_call, ref_call = base.clone(), base.clone()
        for step in range(1, spec.steps + 1):
            nxt = case.make(seed + step, device)
            for name in spec.inplace:  # carry each chain's own state forward
                nxt_impl = nxt.tensors[name]
                nxt_impl.copy_(impl_call.tensors[name])
            ref_next = OpCall({k: v.clone() for k, v in nxt.tensors.items()}, dict(nxt.args))
            for name in spec.inplace:
                ref_next.tensors[name].copy_(ref_call.tensors[name])
            impl_call = nxt
            ref_out = case.reference(ref_next)
            step_out, seen = _run_on_stream(impl, impl_call)
            c, _ = _compare_all(f"step {step}: ", case, step_out, ref_out, tols)
            checks += c
            ref_call = OpCall({**ref_next.tensors, **{k: ref_out[k] for k in spec.inplace}}, ref_next.args)
            for name in spec.inplace:
                c, _ = _judge(f"step {step}: {name}", case, name, seen[name], ref_out[name], tols[name])
                checks += c
    result.checks = checks
    return result
