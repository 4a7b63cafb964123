"""The numerics red team: broken versions of stock ops, each of which the stage must FAIL.

Eight cheats wrapped around the stock KDA decode step (zeros, the oracle, caching, grid-shaped code, a side stream,
stale state, a mutated input, half a batch), then one realistic bug per op family of the other cells: AttnRes
reading a wrong bank slot, MLA attending one position short, the router breaking ties toward the higher expert id,
the experts dropping a top-k slot, the input projection skipping its last K block, o_proj's AttnRes adding its
output where the prefix restarts. Every case runs the numerics stage's own evaluation over cells chosen to expose
its bug; on a machine without CUDA the side-stream case cannot run and says so.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from harness.numerics import redteam_kernels as rt
from harness.numerics.cells import Impl, Implementation, OpCall
from harness.numerics.compare import ToleranceTable
from harness.redteam import RedTeamCase
from harness.stages.numerics import evaluate
from harness.verdicts import StageRecords
from k3_decode.config import K3_MINI
from suites.k3 import attn_res, kda, mla, moe, projections
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


def _op_case(name: str, description: str, cells: Callable[[], list], op: str, broken: Callable[[Impl], Impl]):
    def run(_tmp: Path) -> StageRecords:
        stock = SUITE.implementations(_device())[0].ops[op]
        impl = Implementation("redteam", {op: broken(stock)})
        return evaluate(cells(), [impl], _device(), ToleranceTable.load(), SUITE.forbidden(), seed=7)

    return RedTeamCase("numerics", name, description, run)


def _zero_block0(call) -> dict[str, torch.Tensor]:
    blocks = call.tensors["blocks"].clone()
    blocks[:, 0] = 0
    return {"blocks": blocks}


def _one_short(call) -> dict[str, torch.Tensor]:
    return {"seq_lens": (call.tensors["seq_lens"] - 1).clamp(min=0)}


def _reverse_experts(call) -> dict[str, torch.Tensor]:
    return {"router": call.tensors["router"].flip(0), "router_bias": call.tensors["router_bias"].flip(0)}


def _ids_back(call, out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    last = call.tensors["router"].shape[0] - 1
    return {"logits": out["logits"].flip(-1), "ids": (last - out["ids"]).to(torch.int32), "weights": out["weights"]}


def _skip_last_k_block(call) -> dict[str, torch.Tensor]:
    x = call.tensors["x"].clone()
    x[:, -32:] = 0
    return {"x": x}


def _adds_at_a_restart(impl: Impl) -> Impl:
    """Runs the AttnRes rule of the plain layer after the call's one: at a block-write layer's restart it adds."""

    def run(call) -> dict[str, torch.Tensor]:
        return impl(OpCall(call.tensors, {**call.args, "layer": call.args["layer"] + 1}))

    return run


def _drop_last_slot(call) -> dict[str, torch.Tensor]:
    w = call.tensors["weights"].clone()
    w[:, -1] = 0
    return {"weights": w}


CASES += [
    _op_case(
        "attn-res-wrong-block",
        "AttnRes mixes a wrong bank slot (block 0 read as zeros)",
        lambda: [attn_res.AttnResCell(K3_MINI, 4, "before-plain")],
        "attn_res",
        lambda impl: rt.reads_altered_inputs(impl, _zero_block0),
    ),
    _op_case(
        "mla-one-position-short",
        "MLA decode attends one position short (the new token's own row left out)",
        lambda: [mla.MlaCell(K3_MINI, 1, 4, 64, "auto", 16)],
        "mla_decode",
        lambda impl: rt.reads_altered_inputs(impl, _one_short),
    ),
    _op_case(
        "route-ties-to-higher-id",
        "the router lets the higher expert id win exact ties",
        lambda: [moe.RouteCell(K3_MINI, 8, "ties")],
        "moe_route",
        lambda impl: rt.maps_outputs(rt.reads_altered_inputs(impl, _reverse_experts), _ids_back),
    ),
    _op_case(
        "experts-drop-a-slot",
        "the routed experts skip the last top-k slot",
        lambda: [moe.ExpertsCell(K3_MINI, 1, 5)],
        "moe_experts",
        lambda impl: rt.reads_altered_inputs(impl, _drop_last_slot),
    ),
    _op_case(
        "in-proj-skips-a-k-block",
        "the KDA input projection leaves out its last 32 columns of K",
        lambda: [projections.InProjCell(K3_MINI, 1, 4)],
        "kda_in_proj",
        lambda impl: rt.reads_altered_inputs(impl, _skip_last_k_block),
    ),
    _op_case(
        "o-proj-adds-at-a-restart",
        "o_proj's AttnRes adds its output to the prefix where a block-write layer restarts it",
        lambda: [projections.OProjCell(K3_MINI, 1, 4, "after-write")],
        "kda_o_proj",
        _adds_at_a_restart,
    ),
]
