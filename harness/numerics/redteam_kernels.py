"""Broken implementations built from a correct one: each models a way kernels cheat or break.

The numerics stage's red team wraps a real op with these; every one must make the stage FAIL.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from harness.numerics.cells import Impl, OpCall

Reference = Callable[[OpCall], dict[str, torch.Tensor]]


def returns_zeros(impl: Impl) -> Impl:
    def run(call: OpCall) -> dict[str, torch.Tensor]:
        return {k: torch.zeros_like(v) for k, v in impl(call).items()}

    return run


def calls_the_oracle(reference: Reference, dtype: torch.dtype, inplace: Iterable[str] = ()) -> Impl:
    """Returns the oracle's answer (cast to the kernel's dtype) and writes the oracle's state."""
    names = tuple(inplace)

    def run(call: OpCall) -> dict[str, torch.Tensor]:
        ref = reference(call.clone())
        for name in names:
            call.tensors[name].copy_(ref[name])
        return {k: v.to(dtype) for k, v in ref.items() if k not in names}

    return run


def caches_by_address(impl: Impl) -> Impl:
    """Memoizes on the inputs' addresses and shapes: fine until the same buffers hold new values."""
    cache: dict[tuple, dict[str, torch.Tensor]] = {}

    def run(call: OpCall) -> dict[str, torch.Tensor]:
        key = tuple((k, v.data_ptr(), tuple(v.shape)) for k, v in sorted(call.tensors.items()))
        if key not in cache:
            cache[key] = {k: v.clone() for k, v in impl(call).items()}
        return {k: v.clone() for k, v in cache[key].items()}

    return run


def grid_shapes_only(impl: Impl, batches: Iterable[int], batch_input: str) -> Impl:
    """Correct on the batch sizes of the published grid, wrong elsewhere (hard-coded shapes)."""
    known = set(batches)

    def run(call: OpCall) -> dict[str, torch.Tensor]:
        out = impl(call)
        if call.tensors[batch_input].shape[0] in known:
            return out
        return {k: v * 0.5 for k, v in out.items()}

    return run


def skips_part_of_the_batch(impl: Impl, batch_input: str) -> Impl:
    """Computes every request but returns garbage for the last half of the batch."""

    def run(call: OpCall) -> dict[str, torch.Tensor]:
        out = impl(call)
        b = call.tensors[batch_input].shape[0]
        for v in out.values():
            if v.shape[0] == b and b > 1:
                v[b - b // 2 :] = 0
        return out

    return run


def mutates_an_input(impl: Impl, name: str) -> Impl:
    """Scales an input in place after use (the caller's next use of it is corrupted)."""

    def run(call: OpCall) -> dict[str, torch.Tensor]:
        out = impl(call)
        call.tensors[name].mul_(2)
        return out

    return run


def reads_stale_state(impl: Impl, state: str) -> Impl:
    """Reads the state as it was at its first call (a load hoisted above the wait for the previous write)."""
    snapshot: dict[str, torch.Tensor] = {}

    def run(call: OpCall) -> dict[str, torch.Tensor]:
        current = call.tensors[state]
        if state not in snapshot:
            snapshot[state] = current.clone()
        written = current.clone()
        current.copy_(snapshot[state])  # compute from the stale copy ...
        out = impl(call)
        fresh_rows = current.clone()
        current.copy_(written)
        changed = fresh_rows != snapshot[state]
        current[changed] = fresh_rows[changed]  # ... and publish what it computed
        return out

    return run


def side_stream_without_sync(impl: Impl, delay_cycles: int = 200_000_000) -> Impl:
    """Publishes its results from its own stream, late, without making the caller's stream wait (GPU only).

    The work itself may synchronize the host (slot checks do); only the final copy into the returned buffers is
    left pending behind a delay on the side stream, which is what a reader on the caller's stream must not miss.
    """

    def run(call: OpCall) -> dict[str, torch.Tensor]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out = impl(call)
            late = {k: torch.zeros_like(v) for k, v in out.items()}
            torch.cuda._sleep(delay_cycles)
            for k, v in out.items():
                late[k].copy_(v)
        return late

    return run


def reads_altered_inputs(impl: Impl, alter: Callable[[OpCall], dict[str, torch.Tensor]]) -> Impl:
    """Computes from inputs changed by `alter` (a wrong index, a missing row, a reversed table), then puts the
    caller's inputs back: what a kernel that loads the wrong elements computes, with no visible side effect.

    `alter` returns the replacement values of the tensors it changes, by name; they are copied in before the call
    and the originals restored after it."""

    def run(call: OpCall) -> dict[str, torch.Tensor]:
        changes = alter(call)
        saved = {name: call.tensors[name].clone() for name in changes}
        for name, value in changes.items():
            call.tensors[name].copy_(value)
        try:
            return impl(call)
        finally:
            for name, value in saved.items():
                call.tensors[name].copy_(value)

    return run


def maps_outputs(impl: Impl, change: Callable[[OpCall, dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> Impl:
    """Post-processes the outputs (a wrong epilogue: a bias added twice, ids mapped back the wrong way)."""

    def run(call: OpCall) -> dict[str, torch.Tensor]:
        return change(call, impl(call))

    return run
