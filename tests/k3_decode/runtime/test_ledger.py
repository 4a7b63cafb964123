"""The dispatch ledger: summaries, expectations, the graph-replay join with device counters, JSON and its schema."""

from __future__ import annotations

import copy
import json

import pytest

from k3_decode.runtime.ledger import DispatchRecord, Expectation, KernelCatalog, Ledger, graph_key, schema_problems

from .helpers import FakeProvider

KDA_KERNEL = "KdaSplit"
STOCK_KDA = "fused_kda_decode"
CATALOG = KernelCatalog.build(
    [
        FakeProvider("kda", "kda", {KDA_KERNEL: 1}),
        FakeProvider("o_proj", "oproj", {"OprojProducer": 1, "OprojConsumer": 1}),
    ],
    stock={"kda": {STOCK_KDA: 1}},
)


def rec(
    step=0,
    layer=1,
    op="kda",
    path="specialized",
    reason="pure decode, batch 16 prepared",
    batch=16,
    q=1,
    mode="eager",
    rank=0,
    graph=None,
) -> DispatchRecord:
    return DispatchRecord(step, layer, op, path, reason, batch, q, mode, rank, graph)


def captured_graph(ledger: Ledger, path="specialized", layers=(1, 2, 3, 5), replays=5) -> str:
    """A graph of one KDA op per layer, captured once and replayed `replays` times."""
    g = graph_key(16, 1)
    ledger.record(*(rec(layer=i, path=path, mode="graph", graph=g) for i in layers))
    if replays:
        ledger.replayed(g, replays)
    return g


# -- records and summary -------------------------------------------------------------------------------------------


def test_summary_counts_by_path_op_and_reason():
    ledger = Ledger()
    ledger.record(rec(), rec(layer=2), rec(op="moe", path="stock", reason="the MoE stays stock"))
    ledger.record(rec(step=1, path="stock", reason="batch 9 not prepared", batch=9))
    s = ledger.summary()["decisions"]
    assert s["total"] == 4
    assert s["by_path"] == {"specialized": 2, "stock": 2}
    assert s["by_op"] == {"kda": {"specialized": 2, "stock": 1}, "moe": {"specialized": 0, "stock": 1}}
    assert s["by_reason"]["batch 9 not prepared"] == 1
    assert ledger.summary()["dispatches"] == s  # eager records run once each


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"path": "fast"}, "dispatch path 'fast'"),
        ({"mode": "graph"}, "names its graph exactly when its mode is 'graph'"),
        ({"graph": "B1q1"}, "names its graph exactly when"),
        ({"batch": 0}, "out of range"),
        ({"layer": -1}, "out of range"),
        ({"reason": ""}, "needs an op name and a reason"),
    ],
)
def test_malformed_record_is_one_line_error(kw, message):
    with pytest.raises(ValueError, match=message):
        rec(**kw)


# -- expectations --------------------------------------------------------------------------------------------------


def test_expectation_mismatch_names_step_layer_op_reason_and_who():
    ledger = Ledger()
    ledger.record(rec(step=3, layer=5, path="stock", reason="batch 9 not prepared", batch=9), rec(step=3, layer=6))
    mismatches = ledger.check([Expectation("specialized", by="test_kda_b9", op="kda")])
    assert mismatches == [
        "rank 0 step 3 layer 5 kda ran stock (reason: batch 9 not prepared) but specialized was expected by test_kda_b9"
    ]
    assert ledger.check([Expectation("specialized", by="t", op="kda", layer=6)]) == []
    assert ledger.check([Expectation("stock", by="t", step=3, layer=5)]) == []


def test_expectation_that_matches_nothing_is_a_mismatch():
    ledger = Ledger()
    ledger.record(rec(op="moe", path="stock", reason="r"))
    assert ledger.check([Expectation("specialized", by="cell b16", op="kda")]) == [
        "no dispatch of op kda was recorded, but cell b16 expected specialized"
    ]
    assert ledger.check([Expectation("stock", by="cell", layer=7)]) == [
        "no dispatch of any op at layer 7 was recorded, but cell expected stock"
    ]


def test_declared_expectations_are_checked_by_default():
    ledger = Ledger()
    ledger.record(rec(path="stock", reason="eager step"))
    ledger.expect(Expectation("specialized", by="perf cell", op="kda"))
    assert len(ledger.check()) == 1
    assert ledger.check([]) == []


def test_graph_records_count_only_when_replayed():
    ledger = Ledger()
    g = captured_graph(ledger, replays=0)
    exp = Expectation("specialized", by="test_graph", op="kda")
    assert ledger.check([exp]) == [
        "no dispatch of op kda was recorded only in graphs that were never replayed, "
        "but test_graph expected specialized"
    ]
    ledger.replayed(g, 2)
    assert ledger.check([exp]) == []


def test_graph_mismatch_says_which_graph_and_how_often():
    ledger = Ledger()
    captured_graph(ledger, path="stock", layers=(4,), replays=3)
    (msg,) = ledger.check([Expectation("specialized", by="t", op="kda")])
    assert "layer 4 kda ran stock" in msg and "[graph B16q1, 3 replays]" in msg


# -- capture x replay join -----------------------------------------------------------------------------------------


def test_effective_dispatches_are_replays_times_captured_records():
    ledger = Ledger()
    captured_graph(ledger, replays=5)
    ledger.record(rec(step=9, path="stock", reason="eager step"))
    s = ledger.summary()
    assert s["decisions"]["by_op"]["kda"] == {"specialized": 4, "stock": 1}
    assert s["dispatches"]["by_op"]["kda"] == {"specialized": 20, "stock": 1}
    assert s["graphs"] == {"B16q1": {"captured": 4, "replays": 5}}


def test_replay_bookkeeping_errors():
    ledger = Ledger()
    with pytest.raises(ValueError, match="graph B16q1 replayed but nothing was recorded at its capture"):
        ledger.replayed("B16q1")
    g = captured_graph(ledger, replays=1)
    with pytest.raises(ValueError, match="already replayed"):
        ledger.record(rec(mode="graph", graph=g))
    with pytest.raises(ValueError, match="replay count must be >= 1"):
        ledger.replayed(g, 0)


def test_device_counters_that_match_the_claims_pass():
    ledger = Ledger()
    captured_graph(ledger, replays=5)
    ledger.record(rec(step=7))  # one eager specialized dispatch
    ledger.report_device_counts({KDA_KERNEL: 21, "OprojProducer": 0, "OprojConsumer": 0})
    ledger.report_profiler_kernels({"void cutlass::KdaSplit<128>(Params)": 21})
    assert ledger.check_execution(CATALOG) == []


def test_specialized_claimed_but_counters_show_stock():
    # The ledger says the graph ran KdaSplit; the device counters say the stock kernel ran instead.
    ledger = Ledger()
    captured_graph(ledger, replays=5)
    ledger.report_device_counts({KDA_KERNEL: 0, STOCK_KDA: 20})
    ledger.report_profiler_kernels({"fused_kda_decode_kernel": 20})
    assert ledger.check_execution(CATALOG) == [
        "kernel KdaSplit: the ledger claims 20 launches (graph B16q1: 5 replays x 4 specialized kda dispatches) "
        "but the device counters show 0",
        "kernel fused_kda_decode: the ledger claims 0 launches (no dispatch launches it) "
        "but the device counters show 20",
        "kernel KdaSplit: the ledger claims 20 launches (graph B16q1: 5 replays x 4 specialized kda dispatches) "
        "but the profiler saw no kernel named like it",
        "kernel fused_kda_decode: the profiler saw 20 launches of kernels named like it but the ledger claims none",
    ]


def test_stock_claimed_but_specialized_kernel_ran():
    ledger = Ledger()
    captured_graph(ledger, path="stock", replays=2)
    ledger.report_device_counts({KDA_KERNEL: 8})
    (msg,) = ledger.check_execution(CATALOG)
    assert (
        msg == "kernel KdaSplit: the ledger claims 0 launches (no dispatch launches it) but the device counters show 8"
    )


def test_missing_counters_and_undeclared_kernels():
    ledger = Ledger()
    captured_graph(ledger, replays=1)
    (msg,) = ledger.check_execution(CATALOG)
    assert msg.startswith("no device execution counters were reported, so the specialized kernels KdaSplit cannot")
    ledger.report_device_counts({"SideStreamPrefetch": 3})
    msgs = ledger.check_execution(CATALOG)
    assert (
        "kernel KdaSplit: the ledger claims 4 launches (graph B16q1: 1 replays x 4 specialized kda dispatches) "
        "but the device counters have no entry for it" in msgs
    )
    assert any("SideStreamPrefetch: the device counters show 3 launches but no op in the catalog" in m for m in msgs)


def test_a_stock_verify_dispatch_claims_the_verify_pipeline_not_the_decode_kernel():
    # The stock KDA core runs other kernels on a verify step (q > 1) than on a decode step: judged by the decode
    # entry, a verify cell's baseline claimed the fused decode kernel and the profiler never saw it (an H200 perf run).
    catalog = KernelCatalog.build(
        [FakeProvider("kda", "kda", {KDA_KERNEL: 1})],
        stock={"kda": {STOCK_KDA: 1}},
        stock_verify={"kda": {"verify_conv": 1, "recurrent_verify": 1}},
        verify_steps=[0],
    )
    ledger = Ledger()
    ledger.record(*(rec(layer=i, path="stock", q=4, reason="verify step") for i in (1, 2)))
    ledger.record(rec(step=1, layer=1, path="stock"))  # one decode step of the same op
    # A prefill or mixed step has several tokens per request too, and is no verify step: the decode entry holds.
    ledger.record(rec(step=2, layer=1, path="stock", q=4, reason="mixed step"))
    claims = {k: sum(n for _, n in v) for k, v in ledger.expected_launches(catalog).items()}
    assert claims == {STOCK_KDA: 2, "verify_conv": 2, "recurrent_verify": 2, KDA_KERNEL: 0}
    ledger.report_profiler_kernels({"fused_kda_decode_kernel": 2, "verify_conv_kernel": 2, "recurrent_verify_k": 2})
    assert ledger.check_execution(catalog) == []  # each kernel seen, and no specialized dispatch to count
    ledger.report_profiler_kernels({"fused_kda_decode_kernel": 3})  # the decode kernel ran where verify should
    assert ledger.check_execution(catalog) == [
        "kernel recurrent_verify: the ledger claims 2 launches (eager: 2 stock kda verify dispatches) but the "
        "profiler saw no kernel named like it",
        "kernel verify_conv: the ledger claims 2 launches (eager: 2 stock kda verify dispatches) but the "
        "profiler saw no kernel named like it",
    ]
    # A specialized provider launches its kernel whatever q is.
    assert catalog.launches_of("kda", "specialized", verify=True) == {KDA_KERNEL: 1}
    assert catalog.kernels("stock") == {STOCK_KDA, "verify_conv", "recurrent_verify"}


def test_launches_per_dispatch_multiply():
    catalog = KernelCatalog.build([FakeProvider("in_proj", "splitk", {"SplitK": 2, "Reduce": 1})])
    ledger = Ledger()
    ledger.record(*(rec(layer=i, op="in_proj", mode="graph", graph="B4q1") for i in range(3)))
    ledger.replayed("B4q1", 10)
    assert {k: sum(n for _, n in v) for k, v in ledger.expected_launches(catalog).items()} == {
        "SplitK": 60,
        "Reduce": 30,
    }
    ledger.report_device_counts({"SplitK": 60, "Reduce": 29})
    (msg,) = ledger.check_execution(catalog)
    assert "Reduce: the ledger claims 30 launches" in msg and "show 29" in msg


def test_counts_must_be_non_negative_integers():
    with pytest.raises(ValueError, match="launch counts >= 0"):
        Ledger().report_device_counts({KDA_KERNEL: -1})


# -- JSON ----------------------------------------------------------------------------------------------------------


def full_ledger() -> Ledger:
    ledger = Ledger()
    captured_graph(ledger, replays=5)
    ledger.record(rec(step=6, op="moe", path="stock", reason="the MoE stays stock", rank=1))
    ledger.expect(Expectation("specialized", by="test", op="kda"), Expectation("stock", by="test", op="moe", rank=1))
    ledger.report_device_counts({KDA_KERNEL: 20})
    return ledger


def test_json_matches_its_schema_and_round_trips():
    ledger = full_ledger()
    data = json.loads(ledger.dumps())
    assert schema_problems(data) == []
    again = Ledger.from_json(data)
    assert again.records() == ledger.records()
    assert again.to_json() == ledger.to_json()
    assert again.check() == [] and again.check_execution(CATALOG) == []


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["summary"]["dispatches"]["by_path"].update(specialized=99), "summary does not match its records"),
        (lambda d: d["records"][0].update(path="stock"), "summary does not match its records"),
        (lambda d: d["replays"].update(B16q1=6), "summary does not match its records"),
        (lambda d: d["replays"].update(B99q1=1), r"replays graphs \['B99q1'\] that no record"),
        (lambda d: d["records"][0].update(path="fast"), "does not match ledger.schema.json: records/0/path"),
        (lambda d: d["records"][0].update(graph=None), "does not match ledger.schema.json"),
        (lambda d: d.pop("summary"), "does not match ledger.schema.json"),
    ],
)
def test_edited_json_is_rejected(edit, message):
    data = copy.deepcopy(full_ledger().to_json())
    edit(data)
    with pytest.raises(ValueError, match=message):
        Ledger.from_json(data)


# -- windows -------------------------------------------------------------------------------------------------------


def test_a_window_holds_what_ran_since_its_mark_and_nothing_before():
    ledger = Ledger()
    old = captured_graph(ledger, replays=5)  # captured and replayed before the mark
    idle = graph_key(2, 1)
    ledger.record(rec(batch=2, mode="graph", graph=idle), rec(step=1, path="stock", reason="prefill batch"))
    ledger.replayed(idle, 3)
    mark = ledger.mark()
    ledger.replayed(old, 2)  # replayed again after it: those two replays belong to the window
    ledger.record(rec(step=7))
    window = ledger.since(mark)
    assert window.replays() == {old: 2}  # the idle graph ran nothing since the mark
    assert [r.step for r in window.records()] == [0, 0, 0, 0, 7]
    assert {r.graph for r in window.records()} == {old, None}
    assert window.summary()["dispatches"]["total"] == 4 * 2 + 1
    # The prefill before the mark is outside: a window expecting stock everywhere sees only specialized dispatches.
    assert len(window.check([Expectation("specialized", by="t")])) == 0
    assert ledger.check([Expectation("specialized", by="t")]) != []
    # An empty window matches no expectation, so a cell that ran nothing cannot pass.
    assert Ledger().since(Ledger().mark()).check([Expectation("stock", by="t")]) != []
