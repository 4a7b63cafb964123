"""Red team of the isolation stage, runtime part: "specialized" KDA decode providers that each break isolation.

Each case starts the runtime isolation suite (k3_decode/isolation_suite.py) on the CPU with one provider in a
private registry — never the shipped `PROVIDERS` — and judges its records through the stage's own code
(harness.isolation.runtime); the stage must FAIL.

The private deployment differs from the shipped one only where the CPU needs it: its op table specializes the KDA
core alone (`kda`, the call the providers replace), and its scope lifts the two start-up checks a CPU cannot pass
(`device`: the specialized path is built for sm_90; `cudagraph_mode`: the CPU captures no graphs). Everything after
start-up — routing, the ledger, the op log, the audit, the stock-code probe — is the shipped code path.

The honest provider computes the KDA decode with the reference oracle's math (not the stock path's code); it is the
control: the suite passes with it (tests/k3_decode/runtime/test_isolation_suite.py), so each case fails for its
breakage alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

from harness.isolation.runtime import to_records
from harness.redteam import RedTeamCase
from harness.verdicts import StageRecords
from k3_decode.executor.executor import ProviderTarget
from k3_decode.isolation_suite import K3IsolationSuite
from k3_decode.reference import kda as reference_kda
from k3_decode.runtime.backend import ProviderRegistry
from k3_decode.runtime.optable import OpTable, load_op_table
from k3_decode.runtime.scopefile import RuntimeScope, load_scope
from k3_decode.stock import kda as stock_kda
from k3_decode.weights import KdaWeights

STAGE = "isolation"
OP = "kda"
CPU_LIFTED_CHECKS = ("device", "cudagraph_mode")
Variant = Literal["honest", "writes-neighbour", "stock-inside"]


def private_table() -> OpTable:
    """The shipped op table with only the KDA core specialized (the other KDA ops stay stock, with a reason)."""
    table = load_op_table()
    kda = dataclasses.replace(
        table.parts["kda"],
        specialized=frozenset({OP}),
        stock_reason="red-team deployment: only the KDA core has a (test-double) specialized provider",
    )
    return OpTable({**table.parts, "kda": kda})


def private_scope() -> RuntimeScope:
    """The shipped scope without the start-up checks the CPU cannot pass (see the module doc)."""
    scope = load_scope("k3-hopper")
    kept = tuple(c for c in scope.specialized_checks if c not in CPU_LIFTED_CHECKS)
    return dataclasses.replace(scope, specialized_checks=kept)


def _reference_weights(w: KdaWeights) -> reference_kda.KdaWeights:
    return reference_kda.KdaWeights(f_b=w.f_b, conv=w.conv, a_log=w.a_log, dt_bias=w.dt_bias, o_norm=w.o_norm)


@dataclass(frozen=True)
class RedTeamKdaProvider:
    """A test-double specialized KDA core with the stock calls' signatures (kda_decode: packed, weights, cache,
    slots -> BF16 [B, P]; kda_verify: packed [B, q, rows], weights, cache, slots [B, q], num_accepted [B] -> BF16
    [B, q, P]) and one declared kernel; each variant breaks both calls the same way."""

    variant: Variant = "honest"
    op: str = OP
    launches: Mapping[str, int] = field(default_factory=lambda: {"K3RedTeamKdaDecode": 1})

    @property
    def name(self) -> str:
        return f"redteam-kda-{self.variant}"

    def bind(self, target: ProviderTarget) -> Mapping[str, Callable[..., Any]]:
        spec = reference_kda.KdaSpec.for_rank(target.dims, target.tp)

        Cache = reference_kda.KdaCache

        def honest(packed: Tensor, weights: KdaWeights, cache: Cache, slots: Tensor) -> Tensor:
            out = reference_kda.kda_decode_step(
                spec, _reference_weights(weights), packed, cache, slots.long(), compute_dtype=torch.float32
            )
            return out.to(torch.bfloat16)

        def honest_verify(packed: Tensor, weights: KdaWeights, cache: Cache, slots: Tensor, accepted: Tensor) -> Tensor:
            rw = _reference_weights(weights)
            out = reference_kda.kda_verify_step(
                spec, rw, packed, cache, slots.long(), accepted.long(), compute_dtype=torch.float32
            )
            return out.to(torch.bfloat16)

        def clobber(cache: Cache, slots: Tensor) -> None:
            live = [int(s) for s in slots.flatten().tolist() if s > 0]
            if live:
                # The slot after the step's last one belongs to another request: give it this request's state.
                victim = (max(live) + 1) % cache.num_slots or 1
                cache.recurrent[victim].copy_(cache.recurrent[live[0]])
                cache.conv[victim].copy_(cache.conv[live[0]])

        def writes_neighbour(packed: Tensor, weights: KdaWeights, cache: Cache, slots: Tensor) -> Tensor:
            out = honest(packed, weights, cache, slots)
            clobber(cache, slots)
            return out

        def writes_neighbour_verify(
            packed: Tensor, weights: KdaWeights, cache: Cache, slots: Tensor, accepted: Tensor
        ) -> Tensor:
            out = honest_verify(packed, weights, cache, slots, accepted)
            clobber(cache, slots)
            return out

        def stock_inside(packed: Tensor, weights: KdaWeights, cache: Cache, slots: Tensor) -> Tensor:
            # Claims its own kernel, runs the stock path's fused decode.
            return stock_kda.kda_decode_step(spec, weights, packed, cache, slots, validate=False)

        def stock_inside_verify(
            packed: Tensor, weights: KdaWeights, cache: Cache, slots: Tensor, accepted: Tensor
        ) -> Tensor:
            return stock_kda.kda_verify_step(spec, weights, packed, cache, slots, accepted, validate=False)

        chosen = {
            "honest": (honest, honest_verify),
            "writes-neighbour": (writes_neighbour, writes_neighbour_verify),
            "stock-inside": (stock_inside, stock_inside_verify),
        }
        decode, verify = chosen[self.variant]
        return {"kda_decode": decode, "kda_verify": verify}


def suite_for(provider: RedTeamKdaProvider) -> K3IsolationSuite:
    """The runtime suite on the CPU at k3-mini dims, TP 1, latency_specialized with `provider` alone registered."""
    registry = ProviderRegistry()
    registry.register(provider)
    return K3IsolationSuite(
        "k3-hopper",
        "k3-mini",
        (1,),
        "cpu",
        registry=registry,
        table=private_table(),
        scope=private_scope(),
        backends=("latency_specialized",),
    )


def run_variant(variant: Variant) -> StageRecords:
    return to_records(STAGE, suite_for(RedTeamKdaProvider(variant)).run(lambda what, done: None))


def _writes_neighbour(_tmp: Path) -> StageRecords:
    return run_variant("writes-neighbour")


def _stock_inside(_tmp: Path) -> StageRecords:
    return run_variant("stock-inside")


CASES = [
    RedTeamCase(
        STAGE,
        "kda-writes-other-request",
        "a specialized KDA decode that also writes another request's KDA state slot",
        _writes_neighbour,
    ),
    RedTeamCase(
        STAGE,
        "stock-claimed-specialized",
        "a step that runs the stock KDA kernels while the ledger records the specialized path",
        _stock_inside,
    ),
]
