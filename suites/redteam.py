"""The numerics red team: broken versions of the stock KDA decode step, each of which the stage must FAIL.

Every case runs the numerics stage's own evaluation over cells chosen to expose its cheat; on a machine
without CUDA the side-stream case cannot run and says so.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from harness.numerics import redteam_kernels as rt
from harness.numerics.cells import Impl, Implementation
from harness.numerics.compare import ToleranceTable
from harness.redteam import RedTeamCase
from harness.stages.numerics import evaluate
from harness.verdicts import StageRecords
from k3_decode.config import K3_MINI
from suites.k3 import kda
from suites.k3.suite import K3Suite

SUITE = K3Suite("k3-hopper", "k3-mini")
GRID_BATCHES = (1, 2, 4, 8)


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _needs_cuda() -> str | None:
    return None if torch.cuda.is_available() else "needs a CUDA GPU (streams exist only there)"


def _reference(call) -> dict[str, torch.Tensor]:
    return kda.KdaCell(K3_MINI, call.args["tp"], call.tensors["packed"].shape[0]).reference(call)


def _case(name: str, description: str, broken: Callable[[Impl], Impl], batches=(4,), requires=None) -> RedTeamCase:
    def run(_tmp: Path) -> StageRecords:
        cells = [kda.KdaCell(K3_MINI, 1, b) for b in batches]
        impl = Implementation("redteam", {"kda_decode": broken(SUITE._stock_kda_decode)})
        return evaluate(cells, [impl], _device(), ToleranceTable.load(), SUITE.forbidden(), seed=7)

    return RedTeamCase("numerics", name, description, run, requires or (lambda: None))


CASES = [
    _case("zeros", "returns zeros", rt.returns_zeros),
    _case(
        "calls-the-oracle",
        "returns the reference by calling it",
        lambda _impl: rt.calls_the_oracle(_reference, torch.bfloat16, ("conv_state", "recurrent_state")),
    ),
    _case("caches-by-address", "caches results by data_ptr", rt.caches_by_address),
    _case(
        "grid-shapes-only",
        "correct only on the grid's exact shapes",
        lambda impl: rt.grid_shapes_only(impl, GRID_BATCHES, "packed"),
        batches=(4, 5),
    ),
    _case("side-stream", "launches on a side stream without sync", rt.side_stream_without_sync, requires=_needs_cuda),
    _case(
        "stale-state",
        "reads stale memory (the state before the previous step's write)",
        lambda impl: rt.reads_stale_state(impl, "recurrent_state"),
    ),
    _case(
        "mutates-input", "mutates its input (the packed projection)", lambda impl: rt.mutates_an_input(impl, "packed")
    ),
    _case("skips-batch", "skips part of the batch", lambda impl: rt.skips_part_of_the_batch(impl, "packed")),
]
