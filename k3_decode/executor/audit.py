"""Audit mode of the stack executor: one step with every owned tensor checked outside the step's write set.

The executor declares the step's write set (k3_decode.runtime.writeset: its requests' KDA slots, the MLA cache rows
of its new tokens, the step buffers it runs on), the audit snapshots every owned tensor (weights, KV pages, KDA
slots, the block table, every step buffer) before the step and compares after it (k3_decode.runtime.audit). This is
what the isolation stage calls: a correct step reports no change, a step that writes another request's state or
another graph's buffers is named with the tensor and the index range.

Three methods: "copy" keeps full copies and names exact element boxes (small stacks, CPU tests); "digest" keeps one
hash per index along dim 0 of everything outside the write set, so no second copy of real-size weights is held;
"device" computes those per-index hashes where the tensors live (`device_digest`), so a real-shape audit on a GPU
neither copies gigabytes of weights to the host nor hashes them on one CPU core.

Proof of path, the other half: `op_log_mismatches` joins the dispatch ledger with the executor's op log (what each
routed call really ran: stock ops or a provider), and `StockCodeProbe` watches every provider call for code of the
stock packages, so a "specialized" dispatch that runs the stock path is named with the functions it ran.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from k3_decode.executor.executor import OpLogEntry, StackExecutor, StepRequest, StepResult
from k3_decode.runtime.audit import Change, TensorDigest, changes_outside, digest, digest_changes
from k3_decode.runtime.ledger import Mode
from k3_decode.runtime.writeset import WriteSet

Method = Literal["copy", "digest", "device"]
METHODS: tuple[Method, ...] = ("copy", "digest", "device")

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Odd 64-bit constants of the device hash (any fixed odd values do; these are the golden-ratio and splitmix64 ones).
_K1, _K2, _K3 = -7046029254386353131, -4658895280553007687, -7723592293110705685
_CHUNK = 1 << 26  # int64 elements hashed at a time, so a multi-GB tensor needs no equal-size temporary


def _row_hash(flat: Tensor) -> Tensor:
    """Two 64-bit hashes per row of an int64 [rows, n] tensor, wrapping mod 2^64: sum_i x_i * w_i with an odd weight
    per position (a change of one element always changes it, swapped elements almost always do) and the same over
    x_i + K3 with other weights, so one accidental collision of the first is not one of the second."""
    pos = torch.arange(flat.shape[1], device=flat.device, dtype=torch.int64)
    w1 = pos * _K1 + _K2 | 1
    w2 = pos * _K2 + _K1 | 1
    return torch.stack([(flat * w1).sum(dim=1), ((flat + _K3) * w2).sum(dim=1)], dim=1)


def _hashes(t: Tensor, name: str, mask: Tensor | None) -> tuple[str, ...]:
    kind = _INT_OF_SIZE.get(t.element_size())
    if kind is None:
        raise ValueError(f"tensor {name}: {t.dtype} elements of {t.element_size()} bytes cannot be audited (1-8 only)")
    bits = t.detach().contiguous().view(kind)
    if mask is not None:
        bits = bits.masked_fill(mask.to(bits.device), 0)
    rows = bits.reshape(1, -1) if bits.dim() < 2 else bits.reshape(bits.shape[0], -1)
    per = max(1, _CHUNK // max(1, rows.shape[1]))
    parts = [_row_hash(rows[i : i + per].to(torch.int64)) for i in range(0, rows.shape[0], per)]
    table = torch.cat(parts).cpu().tolist() if parts else []
    return tuple(f"{a & 0xFFFFFFFFFFFFFFFF:016x}{b & 0xFFFFFFFFFFFFFFFF:016x}" for a, b in table)


def device_digest(tensors: dict[str, Tensor], declared: WriteSet) -> dict[str, TensorDigest]:
    """`runtime.audit.digest` computed on each tensor's own device: one hash per index along dim 0 (one for a
    tensor below 2 dims) of its bits with the declared elements zeroed. Compare two with `digest_changes`."""
    if unknown := sorted(declared.tensors() - set(tensors)):
        raise ValueError(f"the write set declares tensors {unknown} that the audit was not given; register them")
    out: dict[str, TensorDigest] = {}
    for name, t in sorted(tensors.items()):
        regions = declared.of(name)
        mask = declared.mask(name, t.shape) if regions else None
        rows = _hashes(t, name, mask)
        out[name] = TensorDigest(tuple(t.shape), str(t.dtype), ";".join(map(str, regions)), rows)
    return out


def _digest(tensors: dict[str, Tensor], declared: WriteSet, method: Method) -> dict[str, TensorDigest]:
    return device_digest(tensors, declared) if method == "device" else digest(tensors, declared)


@dataclass(frozen=True)
class AuditedStep:
    result: StepResult
    declared: WriteSet
    changes: tuple[Change, ...]
    method: Method
    tensors: int  # how many owned tensors were compared

    @property
    def passed(self) -> bool:
        return not self.changes

    def summary(self) -> str:
        if self.passed:
            return (
                f"step {self.result.step}: no change outside the declared write set "
                f"({len(self.declared.regions)} regions, {self.tensors} tensors compared by {self.method})"
            )
        return f"step {self.result.step}: " + "; ".join(str(c) for c in self.changes)


def audit_step(
    executor: StackExecutor, requests: Sequence[StepRequest], *, mode: Mode = "eager", method: Method = "digest"
) -> AuditedStep:
    """Run one step of `executor` under the audit."""
    if method not in METHODS:
        raise ValueError(f"audit method {method!r} is not one of {', '.join(METHODS)}")
    declared = executor.declare(requests, mode)
    owned = executor.owned_tensors()
    if method == "copy":
        before = {name: t.detach().clone() for name, t in owned.items()}
        result = executor.step(requests, mode=mode)
        changes = changes_outside(before, executor.owned_tensors(), declared)
    else:
        hashed = _digest(owned, declared, method)
        result = executor.step(requests, mode=mode)
        changes = digest_changes(hashed, _digest(executor.owned_tensors(), declared, method))
    return AuditedStep(result, declared, tuple(changes), method, len(owned))


@dataclass(frozen=True)
class AuditedCapture:
    graph: str
    changes: tuple[Change, ...]
    method: Method
    tensors: int  # how many tensors the executor owned before the capture, all compared

    @property
    def passed(self) -> bool:
        return not self.changes

    def summary(self) -> str:
        if self.passed:
            return (
                f"capture of graph {self.graph} (with its warm-up): none of the {self.tensors} tensors owned before "
                f"it changed (compared by {self.method})"
            )
        return f"capture of graph {self.graph}: " + "; ".join(str(c) for c in self.changes)


def audit_capture(executor: StackExecutor, batch: int, *, method: Method = "digest") -> AuditedCapture:
    """Capture the graph of `batch` rows with every tensor the executor already owned checked after it.

    A capture writes only the new graph's own buffers (which did not exist before it) and its eager warm-up runs
    every row as NULL padding, so nothing the executor owned before may change: not a weight, not a KDA slot (the
    NULL slot included), not a cache row, not another graph's buffers."""
    if method not in METHODS:
        raise ValueError(f"audit method {method!r} is not one of {', '.join(METHODS)}")
    nothing = WriteSet()
    owned = executor.owned_tensors()
    if method == "copy":
        before = {name: t.detach().clone() for name, t in owned.items()}
        name = executor.capture(batch)
        after = {n: t for n, t in executor.owned_tensors().items() if n in before}
        changes = changes_outside(before, after, nothing)
    else:
        hashed = _digest(owned, nothing, method)
        name = executor.capture(batch)
        after = {n: t for n, t in executor.owned_tensors().items() if n in hashed}
        changes = digest_changes(hashed, _digest(after, nothing, method))
    return AuditedCapture(name, tuple(changes), method, len(owned))


# -- proof of path: what ran against what the ledger records ------------------------------------------------------


def _part_of(executor: StackExecutor, layer: int, op: str) -> str:
    for part, name in executor.planner.table.layer_ops(executor.dims, layer):
        if name == op:
            return part.part
    raise ValueError(f"layer {layer} has no runtime op {op!r} in the op table")


def _attributed(executor: StackExecutor, entry: OpLogEntry) -> tuple[str, ...]:
    """The runtime ops a logged call belongs to: its runner call's ops, narrowed (for a call carrying several, such
    as MLA's one attention call) to the ops whose stock ops (executor/ops.toml) include the logged stock op."""
    if entry.source == "provider" or len(entry.ops) <= 1:
        return entry.ops
    return tuple(
        op
        for op in entry.ops
        if entry.record.op in executor.stock_ops(entry.step, _part_of(executor, entry.layer, op), op)
    )


def _where(step: int, layer: int, op: str) -> str:
    return f"step {step} layer {layer} {op}"


def op_log_mismatches(executor: StackExecutor) -> list[str]:
    """Every disagreement between the dispatch ledger and the executor's op log, per (step, layer, op).

    A record of the stock path must have run exactly the stock ops executor/ops.toml maps its op to (its [verify]
    tables on a verify step), and no provider; a record of the specialized path must have called its provider and
    no stock op. A logged call no record accounts for (a provider the ledger never recorded, a stock op outside any
    routed call) is a mismatch too. Graph records are joined with the calls logged at their capture, which is where
    Python ran."""
    logged: dict[tuple[int, int, str], list[OpLogEntry]] = defaultdict(list)
    out: list[str] = []
    for entry in executor.op_log:
        ops = _attributed(executor, entry)
        what = f"step {entry.step} layer {entry.layer}: stock op {entry.record.op}"
        if not entry.ops:
            out.append(f"{what} ran outside any call the plan routed")
        elif not ops:
            out.append(f"{what} ran in the call of {', '.join(entry.ops)}, none of which executor/ops.toml maps it to")
        for op in ops:
            logged[(entry.step, entry.layer, op)].append(entry)
    recorded: set[tuple[int, int, str]] = set()
    for rec in executor.ledger.records():
        key = (rec.step, rec.layer, rec.op)
        recorded.add(key)
        entries = logged.get(key, [])
        where = _where(*key)
        stock = sorted({e.record.op for e in entries if e.source == "stock"})
        providers = sorted({e.record.op for e in entries if e.source == "provider"})
        if not entries:
            out.append(f"{where}: the ledger records a {rec.path} dispatch but the op log shows no call of it")
        elif rec.path == "specialized":
            if stock:
                out.append(
                    f"{where}: the ledger records the specialized path ({', '.join(providers) or 'no provider'}) "
                    f"but the stock ops {', '.join(stock)} ran for it: the launched ops are the stock ones"
                )
            elif not providers:
                out.append(f"{where}: the ledger records the specialized path but no provider was called")
        else:
            want = sorted(set(executor.stock_ops(rec.step, _part_of(executor, rec.layer, rec.op), rec.op)))
            if providers:
                out.append(f"{where}: the ledger records the stock path but provider {', '.join(providers)} ran")
            if stock != want:
                out.append(f"{where}: the stock path ran stock ops {stock}, but executor/ops.toml maps it to {want}")
    for key in sorted(set(logged) - recorded):
        names = sorted({e.record.op for e in logged[key]})
        out.append(f"{_where(*key)}: {', '.join(names)} ran but the ledger records no dispatch of it")
    return out


@dataclass(frozen=True)
class StockCall:
    """A function of a watched package that ran inside a provider call."""

    step: int
    layer: int
    op: str
    provider: str
    function: str  # package-relative: "k3_decode.stock/kda.py:kda_decode_step"


class StockCodeProbe:
    """Watches every provider call for Python code of the stock packages (the CPU's ground truth that a
    specialized dispatch did not run the stock path: there are no device counters or kernel names there).

    `watch` is the executor's provider guard: a profile hook (sys.setprofile) sees each Python function a provider
    enters, for the length of the call, and keeps those defined in the watched packages. A provider that calls
    the stock ops, the stock kernels' Python launchers or their torch fallbacks is caught; one that reimplements
    them in its own code is not this probe's business (the numerics stage compares it with the oracles)."""

    def __init__(self, packages: Sequence[str]) -> None:
        self.roots: dict[str, str] = {}  # folder of a watched package -> its dotted name
        for name in packages:
            module = importlib.import_module(name)
            for folder in getattr(module, "__path__", []):
                self.roots[os.path.join(os.path.realpath(folder), "")] = name
        if not self.roots:
            raise ValueError(f"stock packages {list(packages)} have no folders to watch; name packages, not modules")
        self.calls: list[StockCall] = []
        self.watched = 0  # provider calls watched

    def _function(self, code: Any) -> str | None:
        path = os.path.realpath(code.co_filename)
        for root, name in self.roots.items():
            if path.startswith(root):
                return f"{name}/{path[len(root) :]}:{getattr(code, 'co_qualname', code.co_name)}"
        return None

    @contextlib.contextmanager
    def watch(self, entry: OpLogEntry) -> Iterator[None]:
        outer = sys.getprofile()
        seen: dict[str, None] = {}

        def hook(frame: Any, event: str, arg: Any) -> None:
            if event == "call" and (name := self._function(frame.f_code)) is not None:
                seen.setdefault(name)
            if outer is not None:
                outer(frame, event, arg)

        self.watched += 1
        sys.setprofile(hook)
        try:
            yield
        finally:
            sys.setprofile(outer)
            op = ",".join(entry.ops)
            self.calls += [StockCall(entry.step, entry.layer, op, entry.record.op, f) for f in seen]

    def mismatches(self) -> list[str]:
        by_call: dict[tuple[int, int, str, str], list[str]] = defaultdict(list)
        for c in self.calls:
            by_call[(c.step, c.layer, c.op, c.provider)].append(c.function)
        return [
            f"{_where(step, layer, op)}: specialized provider {provider} ran stock code ({', '.join(functions[:4])}"
            + (f" and {len(functions) - 4} more" if len(functions) > 4 else "")
            + "): the launched ops are the stock ones"
            for (step, layer, op, provider), functions in sorted(by_call.items())
        ]
