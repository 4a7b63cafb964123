"""What a numerics suite hands the runner: one grid cell of one op, and the implementation under test."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass
class OpCall:
    """The inputs of one call: tensors by name (some of them state the op updates in place) and other arguments."""

    tensors: dict[str, torch.Tensor]
    args: dict[str, Any] = field(default_factory=dict)

    def clone(self) -> OpCall:
        return OpCall({k: v.clone() for k, v in self.tensors.items()}, dict(self.args))


@dataclass(frozen=True)
class Judged:
    """How one output (or in-place tensor) is judged where it differs from its op's defaults.

    An op whose outputs differ in kind (FP32 router logits, integer expert ids) names, per output, the dtype the
    output must have and the tolerance-table entry `[<tolerance>.<dtype>]` it is held to (an entry may demand
    bit-exact equality: `exact = true`).
    """

    name: str
    dtype: str | None = None  # None: the op's dtype
    tolerance: str | None = None  # None: the op's key (outputs) or "<op>.state" (in-place tensors)


@dataclass(frozen=True)
class OpSpec:
    op: str  # the tolerance-table key
    dtype: str  # the dtype the implementation computes in (tolerance-table key)
    outputs: tuple[str, ...]
    inplace: tuple[str, ...] = ()  # state tensors the op may update (only where allowed_writes says)
    deterministic: bool = True  # bit-identical reruns are promised
    steps: int = 1  # consecutive calls chaining the in-place state (stale reads show only over steps)
    judged: tuple[Judged, ...] = ()  # per-output dtype and tolerance entry, where not the defaults

    def _override(self, name: str) -> Judged | None:
        return next((j for j in self.judged if j.name == name), None)

    def dtype_of(self, name: str) -> str:
        """The dtype output `name` must have and whose tolerance entry applies."""
        j = self._override(name)
        return j.dtype if j is not None and j.dtype else self.dtype

    def tolerance_of(self, name: str) -> str:
        """The tolerance-table key of output or in-place tensor `name`."""
        j = self._override(name)
        if j is not None and j.tolerance:
            return j.tolerance
        return f"{self.op}.state" if name in self.inplace else self.op


class Case(Protocol):
    """One cell. A case whose op's tolerance entry counts matches per unit rather than per element (the table's
    `matched_unit`, e.g. "head") also defines `unit_size(name, unit) -> int | None`: how many consecutive elements
    of output `name`'s last dimension make one such unit (None: no such unit there). The table names the unit, the
    case knows its size, so the harness needs no model facts. It is optional: the runner looks it up only for such
    entries, and a case without it fails their matched fraction."""

    id: str
    axes: dict[str, Any]
    spec: OpSpec

    def make(self, seed: int, device: torch.device) -> OpCall:
        """Fresh inputs for this cell (new values for every seed, same shapes)."""
        ...

    def reference(self, call: OpCall) -> dict[str, torch.Tensor]:
        """The oracle: every output and the post-call value of every in-place tensor, computed in fp32 or wider."""
        ...

    def allowed_writes(self, call: OpCall) -> dict[str, torch.Tensor]:
        """Per in-place tensor, a boolean mask of the elements the call may change (its declared write set)."""
        ...


# The implementation under test: reads call.tensors, may update its in-place state, returns its outputs.
Impl = Callable[[OpCall], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class Implementation:
    name: str  # e.g. "stock" or "specialized"
    ops: dict[str, Impl]  # by OpSpec.op
    backend: str = ""  # which code ran, e.g. "triton", "torch-cpu"
    # A partial implementation serves only the ops in `ops` (the specialized path replaces some ops, the stock path
    # keeps the rest): it runs every cell of those ops and no other. A complete one must serve every cell's op.
    partial: bool = False
    # A partial implementation may also decline cells of its ops that its code cannot take (a kernel's row limit),
    # naming why: the records list each declined cell with its reason, and it is never counted as tested. A
    # complete implementation that declines a cell fails it, as one missing the op does.
    declines: Callable[[Case], str | None] | None = None
