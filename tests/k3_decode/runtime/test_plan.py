"""Per-step routing: every reason a step goes stock, prepared sizes (vLLM's rounding rule), per-op paths."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from k3_decode.config import K3
from k3_decode.runtime.backend import RowLimit
from k3_decode.runtime.plan import Planner, PreparedSizes, StepInput
from k3_decode.runtime.scopefile import load_scope
from k3_decode.runtime.startup import start

from .helpers import CAPTURE_SIZES, SPECIALIZED, built_registry, deployment

SCOPE = load_scope("k3-hopper")
BASE = {1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64}
LAYERS = (0, 1, 2, 3)  # K3's first layers: KDA+dense, KDA+MoE, KDA+MoE, MLA+MoE


def planner(spec_tokens: int = 0, capture_sizes=CAPTURE_SIZES, config=SPECIALIZED, **kw) -> Planner:
    dep = deployment(
        num_speculative_tokens=spec_tokens,
        spec_method="dspark" if spec_tokens else None,
        capture_sizes=tuple(capture_sizes),
    )
    runtime = start(config, dep, registry=built_registry())
    return dataclasses.replace(runtime.planner(K3, LAYERS), **kw)


DECODE = planner()
DECODE_NO_CAPTURES = planner(capture_sizes=())
VERIFY3 = planner(spec_tokens=2)
VERIFY4 = planner(spec_tokens=3)


def decode(live: int, **kw) -> StepInput:
    return StepInput(step=0, query_lens=(1,) * live, **kw)


def verify(requests: int, q: int, **kw) -> StepInput:
    return StepInput(step=0, query_lens=(q,) * requests, num_accepted=(1,) * requests, **kw)


# -- prepared sizes ------------------------------------------------------------------------------------------------


def test_prepared_rows_follow_vllm_rounding_rule():
    assert PreparedSizes.build(SCOPE, 1, ()).rows == BASE
    assert PreparedSizes.build(SCOPE, 1, CAPTURE_SIZES).rows == BASE | {24, 40, 48, 56}
    # q = 3: capture sizes rounded up to multiples of 3, kept while <= 64 (64 -> 66 is dropped).
    assert PreparedSizes.build(SCOPE, 3, CAPTURE_SIZES).rows == BASE | {9, 18, 24, 33, 42, 48, 57}
    assert PreparedSizes.build(SCOPE, 1, (100, 65)).rows == BASE


def test_padded_batch_picks_the_smallest_prepared_graph():
    assert DECODE_NO_CAPTURES.prepared.padded_batch(9, 1) == 16
    assert DECODE.prepared.padded_batch(17, 1) == 24
    assert DECODE.prepared.padded_batch(65, 1) is None
    assert VERIFY3.prepared.padded_batch(4, 3) == 6  # 12 rows not prepared, 18 is
    assert VERIFY3.prepared.padded_batch(2, 3) == 2  # 6 rows: a base size divisible by 3


# -- step routing --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("batch", range(1, 66))
def test_pure_decode_goes_specialized_exactly_at_prepared_sizes(batch):
    plan = DECODE_NO_CAPTURES.plan(decode(batch))
    if batch in BASE:
        assert (plan.path, plan.reason) == ("specialized", f"pure decode, batch {batch} prepared")
    elif batch > 64:
        assert (plan.path, plan.reason) == ("stock", "batch 65 above the prepared maximum of 64 rows")
    else:
        assert plan.path == "stock"
        assert plan.reason == f"batch {batch} not prepared (prepared rows: 1-8, 16, 32, 64)"


def test_capture_sizes_add_prepared_decode_batches():
    assert DECODE_NO_CAPTURES.plan(decode(24)).path == "stock"
    assert DECODE.plan(decode(24)).path == "specialized"
    assert DECODE.plan(decode(25)).path == "stock"


def test_graph_padding_makes_an_unprepared_batch_prepared():
    assert DECODE_NO_CAPTURES.plan(decode(9, mode="graph")).path == "stock"
    padded = DECODE_NO_CAPTURES.plan(decode(9, batch=16, mode="graph"))
    assert (padded.path, padded.rows) == ("specialized", 16)


@pytest.mark.parametrize(
    ("requests", "path"), [(1, "specialized"), (3, "specialized"), (11, "specialized"), (4, "stock")]
)
def test_uniform_verify_routes_by_prepared_rows(requests, path):
    plan = VERIFY3.plan(verify(requests, 3))
    assert plan.path == path
    size = f"batch {requests} x q 3 = {requests * 3} rows"
    assert plan.reason == (
        f"uniform verify, {size} prepared"
        if path == "specialized"
        else f"{size} not prepared (prepared rows: 1-9, 16, 18, 24, 32, 33, 42, 48, 57, 64)"
    )


def test_verify_above_prepared_maximum():
    assert VERIFY3.plan(verify(22, 3)).reason == "batch 22 x q 3 = 66 rows above the prepared maximum of 64 rows"


def test_decode_step_in_a_speculative_deployment():
    # vLLM keeps one prepared set: q=1 steps are specialized at the base sizes and the q-rounded capture sizes.
    assert VERIFY4.plan(decode(8)).path == "specialized"
    assert VERIFY4.plan(decode(24)).path == "specialized"
    assert VERIFY4.plan(decode(40)).path == "specialized"


@pytest.mark.parametrize(
    ("p", "step", "reason"),
    [
        (VERIFY4, verify(2, 3), "verify with 3 tokens per request (kernels prepared for q=4)"),
        (DECODE, verify(2, 2), "verify with 2 tokens per request (kernels prepared for decode only"),
        (VERIFY4, verify(1, 9), "verify with 9 tokens per request"),
        (VERIFY4, StepInput(0, (4, 1, 4)), "non-uniform tokens per request (1, 4)"),
        (DECODE, StepInput(0, (7, 30), num_prefills=2), "prefill batch (2 prefill requests)"),
        (DECODE, StepInput(0, (1, 1, 1, 12), num_prefills=1), "mixed batch (1 prefill and 3 decode requests)"),
        (DECODE, StepInput(0, (1, 1), num_prefills=1), "mixed batch (1 prefill and 1 decode requests)"),
    ],
)
def test_each_stock_reason(p, step, reason):
    plan = p.plan(step)
    assert plan.path == "stock"
    assert reason in plan.reason
    assert {d.path for d in plan.decisions} == {"stock"}
    assert {d.reason for d in plan.decisions} == {plan.reason}


def test_auto_backend_is_always_stock():
    plan = planner(config={}).plan(decode(8))
    assert (plan.path, plan.reason) == ("stock", "decode_backend 'auto' selects the stock path")


def test_step_modes_come_from_the_scope_data():
    graph_only = dataclasses.replace(DECODE, specialized_modes=("graph",))
    assert graph_only.plan(decode(8, mode="graph")).path == "specialized"
    eager = graph_only.plan(decode(8))
    assert (eager.path, eager.reason) == ("stock", "eager step (the specialized path runs in graph)")
    assert DECODE.plan(decode(8)).path == "specialized"  # the shipped scope allows eager


# -- per layer and per op ------------------------------------------------------------------------------------------


def test_specialized_step_keeps_mla_and_mlp_ops_stock_per_the_op_table():
    plan = DECODE.plan(decode(4))
    paths = {(d.layer, d.op): (d.path, d.reason) for d in plan.decisions}
    for layer in (0, 1, 2):
        for op in ("attn_res", "in_proj", "kda", "o_proj"):
            assert paths[(layer, op)] == ("specialized", "pure decode, batch 4 prepared")
    for op in ("attn_res", "in_proj", "mla", "o_proj"):
        assert paths[(3, op)] == ("stock", "MLA layers stay stock until their specialized kernels are built")
    assert paths[(0, "dense_mlp")][0] == "stock"
    assert paths[(1, "moe")] == ("stock", "the MoE stays stock until its specialized kernels are built")
    assert len(plan.decisions) == 4 * 4 + 4
    assert plan.path_of(2, "in_proj") == "specialized" and plan.path_of(2, "kda") == "specialized"
    assert plan.path_of(3, "mla") == "stock"
    with pytest.raises(KeyError):
        plan.path_of(3, "kda")


def test_plan_records_carry_every_ledger_field():
    plan = VERIFY4.plan(verify(2, 4, mode="graph", batch=2))
    records = plan.records(rank=5)
    assert len(records) == len(plan.decisions)
    first = records[0]
    assert (first.step, first.layer, first.op, first.path) == (0, 0, "attn_res", "specialized")
    assert (first.batch, first.tokens_per_request, first.mode, first.rank, first.graph) == (2, 4, "graph", 5, "B2q4")
    eager = DECODE.plan(decode(3)).records(rank=0)
    assert {r.graph for r in eager} == {None}
    with pytest.raises(ValueError, match="eager step belongs to no graph"):
        DECODE.plan(decode(3)).records(rank=0, graph="B3q1")


def test_planner_rejects_a_layer_the_model_lacks():
    with pytest.raises(ValueError, match=r"layer 93 is outside k3's layers 0\.\.92"):
        dataclasses.replace(DECODE, layers=(92, 93))


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"query_lens": ()}, "query_lens must list"),
        ({"query_lens": (1, 0)}, "query_lens must list"),
        ({"query_lens": (1,), "num_prefills": 2}, "num_prefills 2 outside 0..1"),
        ({"query_lens": (1, 1), "batch": 1, "mode": "graph"}, "padded batch 1 is smaller than the 2 live"),
        ({"query_lens": (1,), "batch": 2}, "only CUDA-graph steps are padded"),
        ({"query_lens": (3, 3), "num_accepted": (1,)}, "num_accepted has 1 entries for 2 live requests"),
        ({"query_lens": (3, 3), "num_accepted": (1, 4)}, r"\(accepted, q\) pairs \[\(4, 3\)\]"),
        ({"query_lens": (1,), "mode": "cuda"}, "step mode 'cuda'"),
        ({"query_lens": (1,), "step": -1}, "step must be >= 0"),
    ],
)
def test_malformed_step_is_one_line_error(kw, message):
    args = {"step": 0, **kw}
    with pytest.raises(ValueError, match=message):
        StepInput(**args)


# -- property: routing equals an independent statement of the rule -------------------------------------------------


@st.composite
def steps(draw):
    n = draw(st.integers(1, 70))
    uniform = draw(st.booleans())
    q = draw(st.sampled_from([1, 1, 2, 3, 4, 9]))
    lens = (q,) * n if uniform else tuple(draw(st.lists(st.integers(1, 5), min_size=n, max_size=n)))
    prefills = draw(st.sampled_from([0, 0, 0, 1, n]))
    mode = draw(st.sampled_from(["graph", "eager"]))
    pad = draw(st.integers(0, 8)) if mode == "graph" else 0
    return StepInput(step=1, query_lens=lens, num_prefills=min(prefills, n), batch=n + pad, mode=mode)


@settings(max_examples=300, deadline=None)
@given(steps(), st.sampled_from([0, 2, 3]))
def test_routing_matches_independent_statement(step, spec_tokens):
    p = {0: DECODE, 2: VERIFY3, 3: VERIFY4}[spec_tokens]
    q_dep = 1 + spec_tokens
    rounded = {-(-c // q_dep) * q_dep for c in CAPTURE_SIZES}
    prepared = BASE | {r for r in rounded if r <= 64}
    qs = set(step.query_lens)
    q = max(qs)
    expect_specialized = step.num_prefills == 0 and len(qs) == 1 and q in (1, q_dep) and step.requests * q in prepared
    plan = p.plan(step)
    assert (plan.path == "specialized") == expect_specialized, plan.reason
    assert plan.rows == step.requests * q


# -- provider row limits ---------------------------------------------------------------------------------------------


def test_an_op_above_its_providers_rows_runs_stock_with_the_reason():
    limit = RowLimit.up_to(4, "rows cute-x serves at TP8 (cuBLAS is faster)")
    limited = dataclasses.replace(DECODE, op_rows={"in_proj": limit})
    small = {(d.layer, d.op): (d.path, d.reason) for d in limited.plan(decode(4)).decisions}
    assert small[(0, "in_proj")] == ("specialized", "pure decode, batch 4 prepared")
    big = limited.plan(decode(8))
    paths = {(d.layer, d.op): (d.path, d.reason) for d in big.decisions}
    assert big.path == "specialized" and paths[(0, "attn_res")][0] == "specialized"
    assert paths[(0, "in_proj")] == ("stock", "8 rows above the 4 rows cute-x serves at TP8 (cuBLAS is faster)")
    # A graph step runs its kernels on the padded rows: 3 live requests in a graph of 8 are 8 rows.
    padded = {(d.layer, d.op): d.path for d in limited.plan(decode(3, mode="graph", batch=8)).decisions}
    assert padded[(0, "in_proj")] == "stock"


def test_a_layer_limit_replaces_the_ops_limit_at_its_layer_only():
    """A provider that serves more rows at some layers (the fused o_proj where the AttnRes mixes several blocks):
    the per-layer limit decides there, the op's everywhere else."""
    stack = dataclasses.replace(DECODE, layers=(0, 1))  # two KDA layers
    limited = dataclasses.replace(
        stack,
        op_rows={"in_proj": RowLimit.up_to(4, "rows at TP8 (op-wide)")},
        layer_rows={("in_proj", 1): RowLimit.up_to(8, "rows at layer 1 (mixing)")},
    )
    paths = {(d.layer, d.op): (d.path, d.reason) for d in limited.plan(decode(8)).decisions}
    assert paths[(0, "in_proj")] == ("stock", "8 rows above the 4 rows at TP8 (op-wide)")
    assert paths[(1, "in_proj")] == ("specialized", "pure decode, batch 8 prepared")
    # a layer's limit may also be lower than the op's
    lower = dataclasses.replace(limited, layer_rows={("in_proj", 1): RowLimit.up_to(2, "rows at layer 1")})
    paths = {(d.layer, d.op): d.path for d in lower.plan(decode(4)).decisions}
    assert paths[(0, "in_proj")] == "specialized" and paths[(1, "in_proj")] == "stock"


def test_the_runtime_takes_row_limits_from_the_providers_at_its_tp():
    @dataclasses.dataclass(frozen=True)
    class Limited:
        op: str
        name: str
        launches: dict
        limits: dict

        def max_rows(self, tp: int):
            return self.limits.get(tp)

    reg = built_registry()
    reg._by_op["in_proj"] = Limited("in_proj", "limited", {"K": 1}, {8: (4, "why")})
    # (most rows, why), the older answer, reaches the plan as the rows 1..most
    assert reg.row_limits(8) == {"in_proj": RowLimit(((1, 4),), "why")} and reg.row_limits(16) == {}
    for tp, want in ((8, {"in_proj": RowLimit.up_to(4, "why")}), (16, {})):
        runtime = start(SPECIALIZED, deployment(tp=tp), registry=reg)
        assert runtime.op_rows() == want
        assert runtime.planner(K3, [0]).op_rows == want
        assert runtime.planner(K3, [0]).layer_rows == {}  # no provider here limits by layer


def test_the_runtime_takes_per_layer_limits_from_providers_that_have_them():
    @dataclasses.dataclass(frozen=True)
    class ByLayer:
        op: str
        name: str
        launches: dict

        def max_rows(self, tp: int):
            return (4, "op-wide")

        def layer_max_rows(self, tp: int, dims, layer: int):
            return (16, f"layer {layer} at TP{tp}") if layer % 2 else None

    reg = built_registry()
    reg._by_op["in_proj"] = ByLayer("in_proj", "by-layer", {"K": 1})
    want = {("in_proj", 1): RowLimit.up_to(16, "layer 1 at TP8"), ("in_proj", 5): RowLimit.up_to(16, "layer 5 at TP8")}
    assert reg.layer_row_limits(8, K3, [0, 1, 2, 5]) == want
    planner = start(SPECIALIZED, deployment(tp=8), registry=reg).planner(K3, [0, 1])
    assert planner.layer_rows == {("in_proj", 1): RowLimit.up_to(16, "layer 1 at TP8")}
    assert planner.op_rows == {"in_proj": RowLimit.up_to(4, "op-wide")}
    paths = {(d.layer, d.op): d.path for d in planner.plan(decode(8)).decisions}
    assert paths[(0, "in_proj")] == "stock" and paths[(1, "in_proj")] == "specialized"


def test_a_provider_that_serves_row_ranges_is_asked_for_them_first():
    """served_rows (ranges) is what the runtime asks where a provider has it; its max_rows is not consulted."""

    @dataclasses.dataclass(frozen=True)
    class Ranges:
        op: str
        name: str
        launches: dict

        def served_rows(self, tp: int):
            return RowLimit(((1, 8), (16, 16), (33, 64)), f"rows ranges serves at TP{tp}") if tp == 8 else None

        def max_rows(self, tp: int):
            raise AssertionError("the runtime asked max_rows of a provider that names its ranges")

        def layer_served_rows(self, tp: int, dims, layer: int):
            return RowLimit(((2, 4),), f"rows at layer {layer}") if layer == 1 else None

        def layer_max_rows(self, tp: int, dims, layer: int):
            raise AssertionError("the runtime asked layer_max_rows of a provider that names its ranges")

    reg = built_registry()
    reg._by_op["in_proj"] = Ranges("in_proj", "ranges", {"K": 1})
    assert reg.row_limits(8) == {"in_proj": RowLimit(((1, 8), (16, 16), (33, 64)), "rows ranges serves at TP8")}
    assert reg.row_limits(16) == {}
    assert reg.layer_row_limits(8, K3, [0, 1]) == {("in_proj", 1): RowLimit(((2, 4),), "rows at layer 1")}
    paths = {
        (d.layer, d.op): d
        for d in start(SPECIALIZED, deployment(), registry=reg).planner(K3, [0, 1]).plan(decode(1)).decisions
    }
    assert paths[(0, "in_proj")].path == "specialized"
    assert (paths[(1, "in_proj")].path, paths[(1, "in_proj")].reason) == (
        "stock",
        "1 rows outside the 2-4 rows at layer 1",
    )


def test_the_shipped_limits_name_the_provider_tp_and_measurement():
    from k3_decode.kernels.providers import max_rows, served_rows

    tp8 = served_rows("in_proj", "cute-kda-in-proj", 8)
    assert tp8 is not None and tp8.ranges == ((1, 8), (16, 31), (33, 64))  # the wgmma stream at B16-B31, B33-B64
    assert tp8.why.startswith("rows cute-kda-in-proj serves at TP8 (cuBLAS is faster at the other sizes")
    # a limit with gaps has no "most rows": asking for one is refused rather than read as 1..64
    refused = r"\[in_proj\] serves 1-8, 16-31, 33-64 rows at TP8, not 1..N; ask served_rows"
    with pytest.raises(ValueError, match=refused):
        max_rows("in_proj", "cute-kda-in-proj", 8)
    assert max_rows("in_proj", "cute-kda-in-proj", 16)[0] == 64  # the wgmma stream takes B33-B64 there
    assert served_rows("in_proj", "cute-kda-in-proj", 16).ranges == ((1, 64),)
    assert max_rows("in_proj", "cute-kda-in-proj", 1) is None and max_rows("attn_res", "cute-attn-res", 8) is None
    # o_proj serves more rows where the AttnRes after attention mixes 2 or more bank blocks; blocks do not change
    # an op without a [mixing] limit.
    assert max_rows("o_proj", "cute-kda-o-proj", 8)[0] == max_rows("o_proj", "cute-kda-o-proj", 8, blocks=1)[0] == 64
    assert "wgmma" in max_rows("o_proj", "cute-kda-o-proj", 8, blocks=1)[1]
    rows, why = max_rows("o_proj", "cute-kda-o-proj", 16, blocks=2)
    assert rows == 64 and "mixes 2 or more bank blocks" in why and "TP16" in why
    assert served_rows("in_proj", "cute-kda-in-proj", 8, blocks=8) == tp8


@pytest.mark.parametrize(
    ("rows", "path"),
    [(8, "specialized"), (12, "stock"), (16, "specialized"), (24, "specialized"), (32, "stock"), (48, "specialized")],
)
def test_the_shipped_projection_runs_stock_between_its_tp8_ranges(rows: int, path: str):
    """The shipped provider through the whole chain (providers.toml -> the provider's served_rows -> the registry ->
    start-up -> the plan): at TP8 the projection is specialized at 1-8, 16-31 and 33-64 rows and stock between, with the
    ranges and the measurement in the ledger; at TP16 specialized at every prepared size. The op table's expected
    paths (what tests and perf cells declare) agree with the plan."""
    from k3_decode.kernels.providers import CuteKdaInProjProvider

    reg = built_registry()
    reg._by_op["in_proj"] = CuteKdaInProjProvider()
    for tp in (8, 16):
        dep = deployment(tp=tp, capture_sizes=(*CAPTURE_SIZES, 12))  # 12 rows prepared too: between 8 and 16
        planner = start(SPECIALIZED, dep, registry=reg).planner(K3, [0, 1])
        plan = planner.plan(decode(rows))
        assert plan.path == "specialized", plan.reason
        got = {(d.layer, d.op): d for d in plan.decisions}
        want = path if tp == 8 else "specialized"
        assert {got[(layer, "in_proj")].path for layer in (0, 1)} == {want}
        assert got[(1, "attn_res")].path == "specialized"
        if want == "stock":
            assert got[(1, "in_proj")].reason.startswith(
                f"{rows} rows outside the 1-8, 16-31, 33-64 rows cute-kda-in-proj serves at TP8 (cuBLAS is faster at "
                "the other sizes"
            )
        expected = planner.table.expected_paths(K3, [0, 1], rows, planner.op_rows, planner.op_stock)
        assert expected == {key: d.path for key, d in got.items()}


# -- providers that cannot serve a deployment with the TP all-reduces ------------------------------------------------


def test_an_op_whose_provider_refuses_the_all_reduce_runs_stock_with_the_reason():
    @dataclasses.dataclass(frozen=True)
    class SingleRank:
        op: str
        name: str
        launches: dict

        def refuses(self, tp_all_reduce: bool):
            return "single-rank serves one rank's shard alone (no all-reduce epilogue)" if tp_all_reduce else None

    reg = built_registry()
    reg._by_op["o_proj"] = SingleRank("o_proj", "single-rank", {"K": 1})
    assert reg.kept_stock(False) == {}
    assert reg.kept_stock(True) == {"o_proj": "single-rank serves one rank's shard alone (no all-reduce epilogue)"}
    for combined in (False, True):
        planner = start(SPECIALIZED, deployment(tp_all_reduce=combined), registry=reg).planner(K3, [0, 1, 3])
        plan = planner.plan(decode(2))
        paths = {(d.layer, d.op): (d.path, d.reason) for d in plan.decisions}
        assert plan.path == "specialized" and paths[(1, "kda")][0] == "specialized"
        o_proj = [v for (layer, op), v in paths.items() if op == "o_proj" and layer != 3]  # layer 3 is MLA
        if combined:
            assert o_proj and all(v == ("stock", reg.kept_stock(True)["o_proj"]) for v in o_proj)
        else:
            assert o_proj and all(v[0] == "specialized" for v in o_proj)
        expected = planner.table.expected_paths(K3, [1], 2, {}, planner.op_stock)
        assert expected[(1, "o_proj")] == ("stock" if combined else "specialized")
        assert expected == {(1, op): p for (layer, op), (p, _) in paths.items() if layer == 1}


def test_the_shipped_o_proj_provider_keeps_o_proj_stock_where_the_all_reduces_run():
    from k3_decode.kernels.providers import CuteKdaInProjProvider, CuteKdaOProjProvider, CuteKdaStepProvider

    reason = CuteKdaOProjProvider().refuses(True)
    assert reason is not None and reason.startswith("cute-kda-o-proj serves one rank's shard alone (the TP all-reduce")
    assert CuteKdaOProjProvider().refuses(False) is None
    assert CuteKdaStepProvider().refuses(True) is None and CuteKdaInProjProvider().refuses(True) is None
