"""Specialized providers in the stack executor: the plan's specialized calls go to the bound provider, every call is
logged with the runtime ops it carried, and what ran is joined with the ledger (op log, stock-code probe); providers
the executor cannot call are refused at start."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from k3_decode.executor import StackExecutor, StepRoutingError, load_stack
from k3_decode.executor.audit import StockCodeProbe, op_log_mismatches
from k3_decode.executor.executor import RUNNER_CALLS, ProviderTarget
from k3_decode.isolation_redteam import RedTeamKdaProvider, private_scope, private_table
from k3_decode.runtime.backend import ProviderRegistry
from k3_decode.runtime.ledger import DispatchRecord
from k3_decode.runtime.optable import OpTable
from tests.k3_decode.executor.helpers import build, decode_requests, prefill, stack_weights

STACK = "k3-mini-kda3-mla"
SPECIALIZED = {"decode_backend": "latency_specialized"}


def specialized(provider: Any, table: OpTable | None = None, **kwargs: Any) -> StackExecutor:
    registry = ProviderRegistry()
    registry.register(provider)
    return StackExecutor.start(
        load_stack(STACK, 1),
        SPECIALIZED,
        device="cpu",
        weights=stack_weights(STACK, 1),
        registry=registry,
        scope=private_scope(),
        table=table or private_table(),
        log=lambda line: None,
        **kwargs,
    )


@dataclass(frozen=True)
class Provider:
    """A provider whose bind() returns whatever the test gives it."""

    calls: Mapping[str, Callable[..., Any]]
    op: str = "kda"
    name: str = "test-kda"
    launches: Mapping[str, int] = field(default_factory=lambda: {"K3TestKernel": 1})

    def bind(self, target: ProviderTarget) -> Mapping[str, Callable[..., Any]]:
        return self.calls


def test_the_provider_runs_instead_of_the_stock_op_and_matches_it():
    stock, ex = build(), specialized(RedTeamKdaProvider("honest"))
    for e in (stock, ex):
        prefill(e, {0: 3, 1: 2})
    want = stock.step(decode_requests(stock, [0, 1], seed=3), trace=True).trace
    got = ex.step(decode_requests(ex, [0, 1], seed=3), trace=True).trace
    assert want is not None and got is not None
    # The first layer sees the same input on both: its attention output is the provider's against the stock op's.
    a, b = got[0].attn_output.float(), want[0].attn_output.float()
    rel = float((a - b).norm() / b.norm())
    assert 0 < rel < 1e-2, rel  # reference math in FP32 against the stock path's, both rounded to BF16
    step = ex.ledger.records()[-1].step
    called = [(e.layer, e.record.op, e.source) for e in ex.op_log if e.step == step and e.ops == ("kda",)]
    assert called == [(layer, "redteam-kda-honest", "provider") for layer in ex.config.kda_layers]
    kda = [r for r in ex.ledger.records() if r.step == step and r.op == "kda"]
    assert {r.path for r in kda} == {"specialized"} and all("provider redteam-kda-honest" in r.reason for r in kda)
    assert op_log_mismatches(ex) == []


def test_a_provider_without_bind_is_refused_at_start():
    @dataclass(frozen=True)
    class Declares:
        op: str = "kda"
        name: str = "no-bind"
        launches: Mapping[str, int] = field(default_factory=lambda: {"K": 1})

    with pytest.raises(StepRoutingError, match=r"provider 'no-bind' of op 'kda' has no bind\(target\)"):
        specialized(Declares())


def test_a_provider_that_binds_other_calls_is_refused_at_start():
    with pytest.raises(StepRoutingError, match=r"binds \['kda_in_proj'\] but op 'kda' runs as the runner calls"):
        specialized(Provider({"kda_in_proj": lambda *a: None}))


def test_an_op_the_runner_makes_together_with_others_cannot_be_specialized_alone():
    table = private_table()
    kda = dataclasses.replace(table.parts["kda"], specialized=frozenset())
    mla = dataclasses.replace(table.parts["mla"], specialized=frozenset({"mla"}))
    with pytest.raises(StepRoutingError, match=r"makes it in one call \(mla_attention\) with in_proj, o_proj"):
        specialized(Provider({}, op="mla"), OpTable({**table.parts, "kda": kda, "mla": mla}))


def test_providers_are_told_whether_the_runner_combines_partials_across_ranks():
    """A provider that fuses past o_proj asks its target at call time; the TP executor sets its combines after the
    providers are bound (k3_decode.distributed.tp_stack)."""
    from k3_decode.distributed.row_parallel import UnfusedRowParallel

    targets: list[ProviderTarget] = []

    @dataclass(frozen=True)
    class Recording(Provider):
        def bind(self, target: ProviderTarget) -> Mapping[str, Callable[..., Any]]:
            targets.append(target)
            return self.calls

    ex = specialized(Recording({"kda_decode": lambda *a: None, "kda_verify": lambda *a: None}))
    (target,) = targets
    assert target.combines_partials() is False  # one rank's shard alone: the all-reduces are elided
    ex.runner.row_parallel = UnfusedRowParallel(lambda partial: partial)
    assert target.combines_partials() is True
    assert ProviderTarget(ex.dims, 1, 0, ex.device).combines_partials() is False  # a target made outside an executor


def test_the_runner_calls_map_to_the_op_tables_ops():
    """RUNNER_CALLS covers every op of every part of the shipped op table, and nothing else."""
    table = private_table()
    for part, (_, calls) in RUNNER_CALLS.items():
        assert {op for ops in calls.values() for op in ops} == set(table.parts[part].ops), part


def test_a_provider_that_calls_the_executors_stock_op_is_caught_by_the_op_log():
    """Broken case of the op-log join: the ledger records specialized, the stock ops ran for it."""
    holder: dict[str, Any] = {}
    ex = specialized(Provider({"kda_decode": lambda *a: holder["stock"](*a), "kda_verify": lambda *a: None}))
    holder["stock"] = ex.attention.kda_decode
    ex.step(decode_requests(ex, [0], seed=1))
    found = op_log_mismatches(ex)
    assert len(found) == len(ex.config.kda_layers)
    assert found[0] == (
        "step 0 layer 4 kda: the ledger records the specialized path (test-kda) but the stock ops kda_decode, kda_f_b "
        "ran for it: the launched ops are the stock ones"
    )


def test_a_record_nothing_ran_for_and_a_call_no_record_covers_are_caught():
    ex = build()
    ex.step(decode_requests(ex, [0], seed=2))
    assert op_log_mismatches(ex) == []
    rec = ex.ledger.records()[0]
    ex.ledger.record(dataclasses.replace(rec, step=7))
    ex.op_log.append(dataclasses.replace(ex.op_log[0], step=9))
    ex.op_log.append(dataclasses.replace(ex.op_log[0], ops=()))
    assert op_log_mismatches(ex) == [
        "step 0 layer 4: stock op attn_res ran outside any call the plan routed",
        "step 7 layer 4 attn_res: the ledger records a stock dispatch but the op log shows no call of it",
        "step 9 layer 4 attn_res: attn_res ran but the ledger records no dispatch of it",
    ]


def test_a_stock_path_that_runs_the_wrong_stock_ops_is_caught():
    ex = build()
    ex.step(decode_requests(ex, [0], seed=4))
    ex.ledger.record(
        DispatchRecord(
            step=1, layer=4, op="kda", path="stock", reason="test", batch=1, tokens_per_request=1, mode="eager", rank=0
        )
    )
    ex.op_log.append(dataclasses.replace(ex.op_log[0], step=1, ops=("kda",)))
    assert (
        "step 1 layer 4 kda: the stock path ran stock ops ['attn_res'], but executor/ops.toml maps it to "
        "['kda_decode', 'kda_f_b']" in op_log_mismatches(ex)
    )


def test_the_stock_code_probe_sees_stock_functions_and_nothing_else():
    from k3_decode.reference import kda as reference
    from k3_decode.stock import kda as stock_kda

    probe = StockCodeProbe(["k3_decode.stock"])
    ex = build()
    ex.step(decode_requests(ex, [0], seed=5))
    entry = ex.op_log[0]
    with probe.watch(entry):
        reference.l2_normalize(torch.ones(2, 2), 1e-6)
    assert probe.mismatches() == [] and probe.watched == 1
    with probe.watch(entry):
        stock_kda._l2(torch.ones(2, 2), 1e-6)
    (found,) = probe.mismatches()
    assert found.startswith(
        "step 0 layer 4 attn_res: specialized provider attn_res ran stock code (k3_decode.stock/kda.py:_l2)"
    )


def test_the_probe_restores_and_chains_an_outer_profiler():
    seen: list[str] = []

    def outer(frame, event, arg):
        if event == "call":
            seen.append(frame.f_code.co_name)

    ex = build()
    ex.step(decode_requests(ex, [0], seed=6))

    def marker():
        return 1

    sys.setprofile(outer)
    try:
        with StockCodeProbe(["k3_decode.stock"]).watch(ex.op_log[0]):
            marker()
        assert sys.getprofile() is outer
    finally:
        sys.setprofile(None)
    assert "marker" in seen


def test_routed_ops_hand_every_other_attribute_to_the_stock_object():
    ex = build()
    assert ex.runner.attention.implementation == ex.attention.implementation == "torch-cpu"
    assert ex.runner.moe.check_weights == ex.moe.check_weights
