"""Audit mode of the stack executor: one step with every owned tensor checked outside the step's write set.

The executor declares the step's write set (k3_decode.runtime.writeset: its requests' KDA slots, the MLA cache rows
of its new tokens, the step buffers it runs on), the audit snapshots every owned tensor (weights, KV pages, KDA
slots, the block table, every step buffer) before the step and compares after it (k3_decode.runtime.audit). This is
what the isolation stage calls: a correct step reports no change, a step that writes another request's state or
another graph's buffers is named with the tensor and the index range.

Two methods: "copy" keeps full copies and names exact element boxes (small stacks, CPU tests); "digest" keeps one
hash per index along dim 0 of everything outside the write set, so no second copy of real-size weights is held.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from k3_decode.executor.executor import StackExecutor, StepRequest, StepResult
from k3_decode.runtime.audit import Change, changes_outside, digest, digest_changes
from k3_decode.runtime.ledger import Mode
from k3_decode.runtime.writeset import WriteSet

Method = Literal["copy", "digest"]
METHODS: tuple[Method, ...] = ("copy", "digest")


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
        hashed = digest(owned, declared)
        result = executor.step(requests, mode=mode)
        changes = digest_changes(hashed, digest(executor.owned_tensors(), declared))
    return AuditedStep(result, declared, tuple(changes), method, len(owned))
