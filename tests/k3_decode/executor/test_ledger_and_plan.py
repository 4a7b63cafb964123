"""Every executor step goes through the runtime's Planner into the dispatch ledger; prefill, mixed and unprepared
steps route to stock with their reasons; a step the plan sends to the (unbuilt) specialized path is refused."""

from __future__ import annotations

import pytest

from k3_decode.executor import StackExecutor, StepRequest, StepRoutingError, load_stack, random_input
from k3_decode.executor.opmap import load_op_map
from k3_decode.runtime.errors import BackendError
from k3_decode.runtime.ledger import Expectation
from k3_decode.runtime.optable import load_op_table
from k3_decode.runtime.plan import Planner, PreparedSizes
from k3_decode.runtime.scopefile import load_scope
from tests.k3_decode.executor.helpers import build, decode_requests, prefill, stack_weights

STACK = "k3-mini-kda3-mla"


def specialized_executor(max_requests: int = 10) -> StackExecutor:
    """An executor whose planner runs decode_backend 'latency_specialized' (as if its kernels were registered)."""
    config = load_stack(STACK, 1, max_requests=max_requests)
    scope = load_scope("k3-hopper")
    table = load_op_table()
    planner = Planner(
        backend="latency_specialized",
        table=table,
        prepared=PreparedSizes.build(scope, 1, config.graph_batches),
        specialized_modes=scope.specialized_step_modes,
        dims=config.dims,
        layers=config.layers,
    )
    return StackExecutor(config, planner, weights=stack_weights(STACK, 1), log=lambda line: None)


def test_an_eager_decode_step_records_every_op_of_every_layer() -> None:
    ex = build()
    ex.step(decode_requests(ex, [0, 2, 5], seed=1))
    recs = ex.ledger.records()
    table = ex.planner.table
    want = [(layer, op) for layer in ex.config.layers for _, op in table.layer_ops(ex.dims, layer)]
    assert [(r.layer, r.op) for r in recs] == want
    assert {(r.path, r.mode, r.batch, r.tokens_per_request, r.graph, r.step, r.rank) for r in recs} == {
        ("stock", "eager", 3, 1, None, 0, 0)
    }
    assert {r.reason for r in recs} == {"decode_backend 'auto' selects the stock path; stock ops run as torch-cpu"}
    ex.ledger.expect(Expectation("stock", by="test"))
    assert ex.ledger.check() == []
    ex.ledger.expect(Expectation("specialized", by="a test that expects the specialized kda op", op="kda"))
    assert len(ex.ledger.check()) == len(ex.config.kda_layers)


def test_the_stock_calls_of_a_layer_are_the_op_map_in_order() -> None:
    ex = build()
    ex.step(decode_requests(ex, [1], seed=2))
    opmap = load_op_map(ex.planner.table)
    for layer in ex.config.layers:
        called = [e.record.op for e in ex.op_log if e.layer == layer]
        assert called == [stock for _, stock in opmap.layer_ops(ex.planner.table, ex.dims, layer)]
    assert {e.record.implementation for e in ex.op_log} == {"torch-cpu"}


def test_the_kernel_catalog_names_the_stock_verify_pipeline_for_verify_steps() -> None:
    catalog = build().kernel_catalog()
    decode, verify = catalog.launches_of("kda", "stock"), catalog.launches_of("kda", "stock", verify=True)
    assert "kda_decode_kernel" in decode and "kda_decode_kernel" not in verify
    # stock kda_verify's kernels (k3_decode/stock/attention_ops.toml), as ops.toml [verify.kda] maps them
    assert {"verify_conv_kernel", "fused_recurrent_kda_fwd_kernel", "state_scatter_kernel", "gated_norm_kernel"} <= set(
        verify
    )
    # every other op launches the same kernels on a verify step
    assert catalog.launches_of("attn_res", "stock", verify=True) == catalog.launches_of("attn_res", "stock")


def test_a_prefill_step_is_one_ledger_step_with_its_token_count() -> None:
    ex = build()
    prefill(ex, {0: 3, 4: 5})
    recs = ex.ledger.records()
    assert {(r.step, r.batch, r.tokens_per_request, r.path) for r in recs} == {(0, 2, 5, "stock")}
    assert ex.state.context_lens[0] == 3 and ex.state.context_lens[4] == 5


def test_prefill_and_mixed_steps_route_to_stock_with_their_reasons() -> None:
    ex = specialized_executor()
    first = ex.config.layers[0]
    ex.prefill({0: random_input(ex.dims, first, 3, seed=0), 1: random_input(ex.dims, first, 2, seed=1)})
    mixed = [
        StepRequest(2, random_input(ex.dims, first, 3, seed=2), prefill=True),
        StepRequest(0, random_input(ex.dims, first, 1, seed=3)),
    ]
    ex.step(mixed)
    reasons = {r.step: r.reason for r in ex.ledger.records()}
    assert reasons[0].startswith("prefill batch (2 prefill requests)")
    assert reasons[1].startswith("mixed batch (1 prefill and 1 decode requests)")
    assert {r.path for r in ex.ledger.records()} == {"stock"}
    assert ex.state.context_lens[:3] == [4, 2, 3]


def test_an_unprepared_decode_batch_routes_to_stock_with_the_prepared_sizes() -> None:
    ex = specialized_executor()
    ex.step(decode_requests(ex, list(range(9)), seed=4))
    reasons = {r.reason for r in ex.ledger.records()}
    assert len(reasons) == 1
    assert next(iter(reasons)).startswith("batch 9 not prepared (prepared rows: 1-8, 16, 32, 64)")


def test_a_step_the_plan_sends_to_the_specialized_path_is_refused_before_it_runs() -> None:
    ex = specialized_executor()
    with pytest.raises(StepRoutingError, match="specialized kernels are not built"):
        ex.step(decode_requests(ex, [0, 1], seed=5))
    assert ex.ledger.records() == ()
    assert ex.state.context_lens[:2] == [0, 0]


def test_latency_specialized_fails_at_start_up() -> None:
    with pytest.raises(BackendError, match="specialized kernels are not built"):
        StackExecutor.start(load_stack(STACK, 1), {"decode_backend": "latency_specialized"}, log=lambda line: None)


def test_graph_mode_needs_a_cuda_device_and_a_decode_step() -> None:
    ex = build()
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        ex.capture(2)
    first = ex.config.layers[0]
    with pytest.raises(ValueError, match="one decode token per request; run prefill and mixed eagerly"):
        ex.step([StepRequest(0, random_input(ex.dims, first, 2, seed=0), prefill=True)], mode="graph")


def test_a_multi_token_decode_request_needs_a_speculative_stack() -> None:
    """Several decode tokens of one request are a verify step; a stack without speculative tokens used to run them
    token by token as if they were, which no check would have noticed."""
    ex = build()
    first = ex.config.layers[0]
    two = random_input(ex.dims, first, 2, seed=0)
    with pytest.raises(ValueError, match=r"decode requests \[\(0, 2\)\] .* num_speculative_tokens=1 for verify"):
        ex.step([StepRequest(0, two), StepRequest(1, random_input(ex.dims, first, 1, seed=1))])
    assert ex.state.context_lens[:2] == [0, 0] and not ex.ledger.records()
    ex.step([StepRequest(0, two, prefill=True), StepRequest(1, random_input(ex.dims, first, 1, seed=1))])  # mixed


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda ex, x: [StepRequest(0, x), StepRequest(0, x)], "list one request twice"),
        (lambda ex, x: [StepRequest(99, x)], "outside 0..5"),
        (lambda ex, x: [], "at least one request"),
        (lambda ex, x: [StepRequest(0, random_input(ex.dims, 0, 1, seed=0))], "entered with 2 AttnRes blocks"),
    ],
    ids=["duplicate", "unknown-request", "empty", "wrong-entry-layer"],
)
def test_bad_steps_get_one_line_errors(make, match: str) -> None:
    ex = build()
    x = random_input(ex.dims, ex.config.layers[0], 1, seed=0)
    with pytest.raises(ValueError, match=match) as info:
        ex.step(make(ex, x))
    assert "\n" not in str(info.value)
    # A refused step claims no dispatch: the ledger's launch counts must match the device counters afterwards.
    assert not ex.ledger.records()
