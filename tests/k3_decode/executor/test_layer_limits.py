"""A provider's per-layer row limit through the whole runtime on the CPU: start-up asks the registered provider
(`layer_max_rows`), the planner routes each layer on it, the ledger records why, the layer runner calls the provider
only where the plan says, and the step's output is the stock executor's within the reference's rounding."""

from __future__ import annotations

from k3_decode.executor import StackExecutor, StepRequest, load_stack, random_input
from k3_decode.executor.audit import op_log_mismatches
from k3_decode.isolation_redteam import RedTeamKdaProvider, private_scope, private_table
from k3_decode.runtime.backend import ProviderRegistry, RowLimit
from tests.k3_decode.executor.helpers import LIMITED_LAYER, LayerLimitedKda, stack_weights

STACK = "k3-mini-kda3-mla"  # layers 4, 5, 6 KDA, 7 MLA


def _start(registry: ProviderRegistry | None = None) -> StackExecutor:
    config = load_stack(STACK, 1)
    extra = {} if registry is None else {
        "additional_config": {"decode_backend": "latency_specialized"}, "registry": registry,
        "scope": private_scope(), "table": private_table(),
    }  # fmt: skip
    return StackExecutor.start(config, device="cpu", weights=stack_weights(STACK, 1), log=lambda line: None, **extra)


def _run(ex: StackExecutor, requests: list[int]):
    first = ex.config.layers[0]
    ex.prefill({r: random_input(ex.dims, first, 3, seed=10 + r) for r in requests})
    step = ex._step
    tokens = [StepRequest(r, random_input(ex.dims, first, 1, seed=40 + r)) for r in requests]
    return step, ex.step(tokens, trace=False)


def test_a_layer_limit_keeps_that_layer_stock_and_the_others_specialized():
    registry = ProviderRegistry()
    registry.register(LayerLimitedKda("honest"))
    ex = _start(registry)
    # the provider's (most rows, why), as the runtime holds it
    limit = RowLimit.up_to(1, "rows the test provider serves at layer 5")
    assert ex.planner.layer_rows == {("kda", LIMITED_LAYER): limit}
    step, result = _run(ex, [0, 1])
    assert result.plan.path == "specialized"
    kda = {r.layer: r for r in ex.ledger.records() if r.step == step and r.op == "kda"}
    assert {layer: r.path for layer, r in kda.items()} == {4: "specialized", 5: "stock", 6: "specialized"}
    assert kda[5].reason.startswith("2 rows above the 1 rows the test provider serves at layer 5")
    called = sorted(e.layer for e in ex.op_log if e.step == step and e.record.op == "redteam-kda-honest")
    assert called == [4, 6]  # the provider ran where the plan sent it, and only there
    assert op_log_mismatches(ex) == []
    stock = _start()
    _, want = _run(stock, [0, 1])
    for r in (0, 1):
        got, ref = result.outputs[r].float(), want.outputs[r].float()
        assert 0 < float((got - ref).norm() / ref.norm()) < 3e-2, r  # the FP32 reference core, not the same bits


def test_within_the_limit_every_kda_layer_is_specialized():
    registry = ProviderRegistry()
    registry.register(LayerLimitedKda("honest"))
    ex = _start(registry)
    step, _ = _run(ex, [0])
    paths = {r.layer: r.path for r in ex.ledger.records() if r.step == step and r.op == "kda"}
    assert paths == {4: "specialized", 5: "specialized", 6: "specialized"}


def test_a_provider_without_layer_limits_gives_the_planner_none():
    registry = ProviderRegistry()
    registry.register(RedTeamKdaProvider("honest"))
    assert _start(registry).planner.layer_rows == {}
