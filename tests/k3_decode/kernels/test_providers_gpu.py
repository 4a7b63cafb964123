"""GPU: the CuTe DSL providers inside the stack executor at real K3 per-rank shapes (TP8 and TP16, one KDA+MoE and
one MLA+MoE layer), under decode_backend "latency_specialized".

- layer by layer against the teacher-forced oracle, as the stock path is (tests/k3_decode/executor/test_gpu.py);
- against the stock path from the same state: same requests, same inputs, outputs within a BF16 rounding level;
- the ledger routes attn_res and in_proj of the KDA layer to the providers and everything else stock, the op log
  agrees (no stock op ran for a specialized dispatch), and in CUDA-graph replays the profiler sees the CuTe DSL
  kernels the ledger claims.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from k3_decode.executor import StackExecutor, load_stack
from k3_decode.executor.attribution import device_events
from k3_decode.executor.audit import op_log_mismatches
from k3_decode.kernels.providers import not_built_reason, served_rows
from k3_decode.runtime.ledger import Expectation, count_delta
from k3_decode.runtime.scopefile import load_scope
from tests.k3_decode.executor.helpers import decode_requests, oracle_failures

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        not_built_reason() is not None, reason=f"the CuTe DSL providers cannot run: {not_built_reason()}"
    ),
]

SPECIALIZED = {"decode_backend": "latency_specialized"}


def _unserved(tp: int) -> int | None:
    """The smallest prepared size the projection's provider does not serve at `tp` (providers.toml), or None."""
    limit = served_rows("in_proj", "cute-kda-in-proj", tp)
    prepared = load_scope("k3-hopper").prepared_batches
    return min((b for b in prepared if limit is not None and not limit.serves(b)), default=None)


def _requests() -> int:
    """The smallest prepared size the projection does not serve at either TP (where
    test_the_projection_stays_stock_where_its_kernel_does_not_serve steps), and two more that no other test touches
    before the agreement test. Derived, not written down: it was 34 while TP16's limit was 16, and raising that
    limit to 32 left the stock-above test asking for requests the executor did not hold; with TP8's row ranges
    (1-8, 16-31, 33-64) it is TP8's 32."""
    unserved = [rows for rows in map(_unserved, (8, 16)) if rows is not None]
    return max(unserved, default=2) + 2


REQUESTS = _requests()
# The two paths differ in FP32 summation orders (AttnRes mixing, the projections' dot products) and in one rounding
# (stock rounds the f_b product to BF16 before the decay gate, the KDA step kernel keeps it in FP32), so BF16 outputs
# land an ulp apart here and there (2^-8 relative) and the layers carry that on: measured stock against stock with a
# different cuBLAS kernel choice gives 4.8e-3 rms (test_gpu.py); the same bound.
PATHS_RMS_REL = 1e-2


def _rms_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).square().mean().sqrt() / b.square().mean().sqrt())


@pytest.fixture(scope="module", params=[8, 16], ids=["tp8", "tp16"])
def pair(request):
    torch.backends.cuda.matmul.allow_tf32 = False  # the oracle's FP32 GEMMs must be IEEE FP32
    config = load_stack("k3-kda-mla", request.param, max_requests=REQUESTS, max_context=1024, graph_batches=(2,))
    stock = StackExecutor.start(config, device="cuda", log=lambda line: None)
    special = StackExecutor.start(config, SPECIALIZED, device="cuda", weights=stock.weights, log=lambda line: None)
    for ex in (stock, special):
        ex.state.fill_synthetic(range(REQUESTS), 600, seed=0)
    special.counts_at_start = special.device_counts()  # the counters are per process: count from here
    yield stock, special
    del stock, special
    torch.cuda.empty_cache()


def _paths(ex: StackExecutor, step: int) -> dict[tuple[int, str], tuple[str, str]]:
    return {(r.layer, r.op): (r.path, r.reason) for r in ex.ledger.records() if r.step == step}


def test_specialized_layers_match_the_oracle_layer_by_layer(pair) -> None:
    _, special = pair
    assert special.planner.backend == "latency_specialized"
    # Two rows: a size both providers serve at TP8 and TP16 (providers.toml).
    assert oracle_failures(special, decode_requests(special, [0, 1], seed=1), dtype=torch.float32) == []
    step = special.ledger.records()[-1].step
    paths = _paths(special, step)
    kda_layer, mla_layer = special.config.kda_layers[0], special.config.mla_layers[0]
    assert all(paths[(kda_layer, op)][0] == "specialized" for op in ("attn_res", "in_proj", "kda", "o_proj"))
    assert all(paths[(mla_layer, op)][0] == "stock" for op in ("attn_res", "in_proj", "mla", "o_proj"))
    ran = {e.record.op for e in special.op_log if e.step == step and e.source == "provider"}
    assert ran == {"cute-attn-res", "cute-kda-in-proj", "cute-kda-step", "cute-kda-o-proj"}
    assert op_log_mismatches(special) == []


def test_the_projection_stays_stock_where_its_kernel_does_not_serve(pair) -> None:
    _, special = pair
    tp = special.config.tp
    limit = served_rows("in_proj", "cute-kda-in-proj", tp)
    unserved = sorted(r for r in special.planner.prepared.rows if limit is not None and not limit.serves(r))
    if not unserved:
        pytest.skip(f"the projection serves every prepared size at TP{tp} ({limit.describe() if limit else 'all'})")
    rows = unserved[0]  # the step runs there: a prepared size outside the served rows (TP8: 32, between 16 and 33)
    special.step(decode_requests(special, list(range(rows)), seed=3))
    paths = _paths(special, special.ledger.records()[-1].step)
    layer = special.config.kda_layers[0]
    assert paths[(layer, "attn_res")][0] == "specialized"
    path, reason = paths[(layer, "in_proj")]
    said = f"{rows} rows outside the {limit.describe()} rows cute-kda-in-proj serves at TP{tp}"
    if limit.ranges == ((1, limit.most),):
        said = f"{rows} rows above the {limit.most} rows cute-kda-in-proj serves at TP{tp}"
    assert path == "stock" and reason.startswith(said), reason
    assert op_log_mismatches(special) == []


def test_the_specialized_step_agrees_with_the_stock_step_from_the_same_state(pair) -> None:
    """The first layer's attention output from the same input and state: what the providers change. (Whole-stack
    outputs are no measure: an ulp in a router input can flip a top-k expert, which changes a token's MoE output
    by design; the oracle test above checks every layer from its own inputs.)"""
    stock, special = pair
    ids = [REQUESTS - 2, REQUESTS - 1]  # untouched by the other tests so far: the same synthetic state on both
    got = special.step(decode_requests(special, ids, seed=2), trace=True).trace
    want = stock.step(decode_requests(stock, ids, seed=2), trace=True).trace
    assert got is not None and want is not None
    first = _rms_rel(got[0].attn_output, want[0].attn_output)
    print(f"METRIC providers TP{special.config.tp} B2: first-layer attention output rms_rel vs stock {first:.2e}")
    assert 0 < first < PATHS_RMS_REL  # zero would mean the providers did not run
    layer = special.config.kda_layers[0]
    a = special.state.kda[layer].recurrent[[special.state.kda_slot(r) for r in ids]]
    b = stock.state.kda[layer].recurrent[[stock.state.kda_slot(r) for r in ids]]
    assert _rms_rel(a, b) < PATHS_RMS_REL


def test_graph_replays_run_the_cute_kernels_the_ledger_claims(pair, tmp_path) -> None:
    _, special = pair
    name = special.capture(2)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for seed in range(2):
            special.step(decode_requests(special, [0, 1], seed=20 + seed), mode="graph")
        torch.cuda.synchronize()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    kernels = Counter(e.name for e in device_events(json.loads(path.read_text())) if e.category == "kernel")
    for kernel in ("AttnResKernel", "KdaInProjKernel", "KdaStepKernel", "KdaOProjKernel"):  # one per KDA layer
        assert sum(n for k, n in kernels.items() if kernel in k) == 2 * len(special.config.kda_layers), kernel
    graph_paths = {(r.layer, r.op): r.path for r in special.ledger.records() if r.graph == name}
    assert graph_paths[(special.config.kda_layers[0], "in_proj")] == "specialized"
    assert special.ledger.summary()["graphs"][name]["replays"] == 2
    special.ledger.report_profiler_kernels(kernels)
    counts = count_delta(special.counts_at_start, special.device_counts())
    special.ledger.report_device_counts(counts)
    assert special.ledger.check_execution(special.kernel_catalog()) == []
    # Broken case of the counter join: one launch fewer than the ledger claims is named.
    special.ledger.report_device_counts({**counts, "KdaInProjKernel": counts["KdaInProjKernel"] - 1})
    (mismatch,) = special.ledger.check_execution(special.kernel_catalog())
    assert mismatch.startswith("kernel KdaInProjKernel:") and "but the device counters show" in mismatch
    by = "test_graph_replays_run_the_cute_kernels"
    layer, step = special.config.kda_layers[0], min(r.step for r in special.ledger.records() if r.graph == name)
    expected = [Expectation("specialized", by, op=op, layer=layer, step=step) for op in ("attn_res", "in_proj")]
    assert special.ledger.check(expected) == []
    # Broken case of the same check: the stock path expected where the providers ran.
    assert special.ledger.check([Expectation("stock", by, op="in_proj", layer=layer, step=step)])


# --- the o_proj provider (registered after this passed) ------------------------------------------------------------


@pytest.mark.parametrize("tp", [8, 16])
def test_the_o_proj_provider_matches_the_stock_ops(tp: int) -> None:
    """Its two calls (one fused launch, kernels/kda_o_proj.py) against the stock ops from the same inputs: o_proj
    within one BF16 rounding of the exact product and two of cuBLAS's (the bound of test_kda_in_proj_gpu.py), the
    MLP input within the AttnRes tolerance of the stock pair's, and the prefix and bank bit-equal to the stock
    AttnRes fed the provider's own o_proj output, on a plain and a block-write (restart) layer. An AttnRes call on
    another tensor than the o_proj output it was handed is refused."""
    from k3_decode.attn_res_state import AttnResBuffers
    from k3_decode.config import K3
    from k3_decode.executor.executor import ProviderTarget
    from k3_decode.kernels.providers import CuteKdaOProjProvider, FusedCallError
    from k3_decode.stock.attention_ops import StockAttentionOps
    from tests.k3_decode.kernels.test_kda_in_proj_gpu import bound
    from tests.k3_decode.stock.attention_helpers import assert_close, load_tolerances, weights_for

    fns = CuteKdaOProjProvider().bind(ProviderTarget(K3, tp, 0, torch.device("cuda")))
    stock = StockAttentionOps(K3, tp, "cuda")
    gen = torch.Generator().manual_seed(tp)
    weights = weights_for(K3, tp, "cuda")
    attention = weights.layer(6, experts=[0]).attention
    hidden, proj = K3.shard(tp).kda_o_proj
    tol = load_tolerances()["attn_res"]
    bs = K3.attn_res_block_size
    for rows in (1, 4, 8, 16):  # the CUDA-core stream, then tensor cores
        for layer_index in (6, bs):  # a plain layer, and a block-write layer (its attention output restarts p)
            residual = weights.residual(layer_index)
            blocks = layer_index // bs + 1
            o = torch.randn(rows, proj, generator=gen).bfloat16().cuda()
            prefix = torch.randn(rows, hidden, generator=gen).bfloat16().cuda()
            bank = torch.randn(rows, K3.num_attn_res_blocks, hidden, generator=gen).bfloat16().cuda()
            mine, theirs, fed = (AttnResBuffers(prefix.clone(), bank.clone(), blocks) for _ in range(3))
            partial = fns["kda_o_proj"](o, attention)
            got = fns["attn_res_after"](mine, layer_index, partial, residual)
            want_partial = stock.kda_o_proj(o, attention)
            want = stock.attn_res_after(theirs, layer_index, want_partial, residual)
            exact, tol_elem = bound(o, attention.o_proj)
            what = f"o_proj provider TP{tp} rows {rows} layer {layer_index}"
            assert ((partial.double() - exact).abs() <= tol_elem).all(), f"{what}: beyond one BF16 rounding"
            assert ((partial.double() - want_partial.double()).abs() <= 2 * tol_elem).all(), f"{what}: vs cuBLAS"
            rms, peak = assert_close(got, want.float(), tol, what)
            print(f"METRIC {what}: MLP input vs the stock pair rms_rel {rms:.2e} peak_rel {peak:.2e}")
            stock.attn_res_after(fed, layer_index, partial, residual)
            assert torch.equal(mine.prefix, fed.prefix) and torch.equal(mine.blocks, fed.blocks), what
    partial = fns["kda_o_proj"](o, attention)
    with pytest.raises(FusedCallError, match="another tensor"):
        fns["attn_res_after"](mine, layer_index, partial.clone(), residual)


# --- verify steps of a speculative stack through the layer runner ---------------------------------------------------


@pytest.fixture(scope="module")
def verify_pair():
    """TP8, q = 4: one request is 4 rows, a prepared size every provider serves (providers.toml), so the KDA layer's
    verify runs the KDA step kernel's verify entry (KdaStepKernel.verify) beside the other three kernels."""
    torch.backends.cuda.matmul.allow_tf32 = False
    config = load_stack("k3-kda-mla", 8, max_requests=2, max_context=1024, graph_batches=(1,), num_speculative_tokens=3)
    stock = StackExecutor.start(config, device="cuda", log=lambda line: None)
    special = StackExecutor.start(config, SPECIALIZED, device="cuda", weights=stock.weights, log=lambda line: None)
    for ex in (stock, special):
        ex.state.fill_synthetic(range(2), 600, seed=4)
    yield stock, special
    del stock, special
    torch.cuda.empty_cache()


def test_verify_steps_run_the_kernels_verify_entry_and_agree_with_stock_verify(verify_pair) -> None:
    """Two verify steps of request 0 from the same state (accepted 1, then 3: the second reads slot[b, 2]): the
    first layer's attention output within the bound of the decode comparison above, the ledger routes every op of
    the KDA layer to its provider, the op log shows the four kernels and no stock op in their place, and the q
    recurrent states the step wrote agree with stock's."""
    from k3_decode.executor import StepRequest, random_input

    stock, special = verify_pair
    layer = special.config.kda_layers[0]
    for seed, accepted in ((30, 1), (31, 3)):
        tokens = random_input(special.dims, special.config.layers[0], 4, seed=seed)
        got = special.step([StepRequest(0, tokens, num_accepted=accepted)], trace=True)
        want = stock.step([StepRequest(0, tokens, num_accepted=accepted)], trace=True)
        assert got.trace is not None and want.trace is not None
        first = _rms_rel(got.trace[0].attn_output, want.trace[0].attn_output)
        print(f"METRIC verify TP8 q4 accepted {accepted}: first-layer attention output rms_rel vs stock {first:.2e}")
        assert 0 < first < PATHS_RMS_REL
        paths = _paths(special, got.step)
        assert all(paths[(layer, op)][0] == "specialized" for op in ("attn_res", "in_proj", "kda", "o_proj")), paths
        ran = {e.record.op for e in special.op_log if e.step == got.step and e.source == "provider"}
        assert ran == {"cute-attn-res", "cute-kda-in-proj", "cute-kda-step", "cute-kda-o-proj"}
        slots = list(special.state.kda_slots(0))
        a = special.state.kda[layer].recurrent[slots]
        b = stock.state.kda[layer].recurrent[slots]
        assert _rms_rel(a, b) < PATHS_RMS_REL
    assert op_log_mismatches(special) == []
