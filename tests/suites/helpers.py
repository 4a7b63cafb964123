"""Shared pieces of the suite tests: the k3-mini suite, the stock implementation on the CPU, one-cell runs."""

from __future__ import annotations

from functools import cache

import torch

from harness.numerics.cells import Case, Impl
from harness.numerics.compare import ToleranceTable
from harness.numerics.hygiene import CellResult, run_cell
from suites.k3.suite import K3Suite

CPU = torch.device("cpu")
SUITE = K3Suite("k3-hopper", "k3-mini")


@cache
def table() -> ToleranceTable:
    return ToleranceTable.load()


def stock(op: str) -> Impl:
    return SUITE.implementations(CPU)[0].ops[op]


def run(case: Case, impl: Impl | None = None, seed: int = 0) -> CellResult:
    return run_cell(case, impl or stock(case.spec.op), CPU, table(), SUITE.forbidden(), seed=seed)


def failed(result: CellResult) -> list[str]:
    return [c.name for c in result.checks if not c.passed]
