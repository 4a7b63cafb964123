"""Run one function in N processes, one per device (or N CPU processes), and bring every rank's result back.

The gate's multi-GPU suites and benchmarks start their ranks here. Every child gets the environment that keeps
NVLink multicast off (on a shared host a program that uses multicast can take every GPU of the host out of service
for a long time), whatever the caller's environment says. A rank that raises reports its one-line error; the parent
raises one `RankFailure` naming each failed rank, or, when every rank failed the same way, that one message.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import socket
import tempfile
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MULTICAST_OFF: Mapping[str, str] = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
DEFAULT_TIMEOUT_S = 600.0


class RankFailure(RuntimeError):
    """One or more ranks raised, hung or died; the message says which and why."""


@dataclass(frozen=True)
class RankOutcome:
    rank: int
    result: Any = None
    error: str | None = None  # "Type: message" of what the rank raised
    trace: str = ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child(fn: Callable[..., Any], rank: int, world: int, port: int, kind: str, args: tuple, out: str) -> None:
    os.environ.update(MULTICAST_OFF)
    try:
        outcome = RankOutcome(rank, result=fn(rank, world, "127.0.0.1", port, kind, *args))
    except Exception as exc:  # handed to the parent, which raises it as RankFailure
        first = str(exc).splitlines()[0] if str(exc) else ""
        outcome = RankOutcome(rank, error=f"{type(exc).__name__}: {first}", trace=traceback.format_exc())
    Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps(outcome))
    # The result is saved; leave without interpreter teardown, whose NCCL and symmetric-memory finalizers can block
    # once a peer has exited (seen on a two-GPU host), and must never decide a rank's result.
    os._exit(0)


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    kind: str,
    args: Sequence[Any] = (),
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> list[Any]:
    """Call `fn(rank, world, address, port, kind, *args)` in `world` fresh processes; return results in rank order.

    `fn` must be importable (a module-level function) and its result picklable. `kind` is "cuda" or "cpu".
    """
    if world < 1:
        raise ValueError(f"world size {world} must be at least 1")
    if kind not in ("cuda", "cpu"):
        raise ValueError(f"device kind {kind!r} is not 'cuda' or 'cpu'")
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="k3gate-ranks-") as out:
        procs = [
            ctx.Process(target=_child, args=(fn, rank, world, port, kind, tuple(args), out), daemon=False)
            for rank in range(world)
        ]
        saved = {k: os.environ.get(k) for k in MULTICAST_OFF}
        os.environ.update(MULTICAST_OFF)  # spawned children start from this environment
        try:
            for p in procs:
                p.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        for p in procs:
            p.join(timeout_s)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        outcomes: list[RankOutcome | None] = []
        for rank in range(world):
            path = Path(out, f"rank{rank}.pkl")
            outcomes.append(pickle.loads(path.read_bytes()) if path.exists() else None)
        exit_codes = [p.exitcode for p in procs]
    problems: list[str] = []
    for rank, outcome in enumerate(outcomes):
        if rank in hung:
            problems.append(f"rank {rank} still running after {timeout_s:.0f} s (killed)")
        elif outcome is None:
            problems.append(f"rank {rank} died with exit code {exit_codes[rank]} before reporting")
        elif outcome.error is not None:
            problems.append(f"rank {rank}: {outcome.error}")
    if problems:
        errors = {o.error for o in outcomes if o is not None and o.error is not None}
        if len(errors) == 1 and all(o is not None and o.error for o in outcomes):
            raise RankFailure(f"every rank of {world} failed: {errors.pop()}")
        raise RankFailure(f"{len(problems)} of {world} ranks failed: " + "; ".join(problems))
    return [o.result for o in outcomes if o is not None]
