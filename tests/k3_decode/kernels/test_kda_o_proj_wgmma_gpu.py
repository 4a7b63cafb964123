"""GPU: the fused o_proj + AttnRes's wgmma build (k3_decode/kernels/kda_o_proj_wgmma.py).

- Against the FP64 oracle as the mma.sync build is held (test_kda_o_proj_gpu.py's check: o_proj within one BF16
  rounding of an FP32 sum and cuBLAS's bits on >= 98% of outputs, the MLP input within the AttnRes tolerance, the
  prefix and a saved block bit-equal, nothing else written, NaN in unused bank slots never read) at TP8 and TP16,
  B = 9 (the plan's least), 16, 17 (N 32, rows past the batch zero-filled by TMA), 22, 32, 33 (two rows an epilogue
  cluster, the last cluster's second row past the batch), 48 and 64, the lightest and heaviest kinds, every
  after-attention kind at TP16 B12 and the kinds that save a block at TP8 B64.
- A row's o_proj bits do not depend on the batch (one K order, whatever wgmma's N).
- Launches of both builds back to back on the device's one arrival word, and a CUDA graph of them replayed: each
  launch sees its own grid's whole o_proj output, the word's low bits return to 0, the counter counts each launch.
- Per call in CUDA-graph replays against the mma.sync build and the stock pair (cuBLAS + the Triton AttnRes),
  printed (METRIC); asserted only where kda_o_proj_choice.toml serves the wgmma build (not slower than the faster of
  the other two by more than SLOWER_LIMIT): serving is decided by the KDA layer benchmark.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from k3_decode.config import K3
from k3_decode.kernels import kda_o_proj_op, kda_o_proj_plan, kda_o_proj_wgmma_plan
from k3_decode.kernels.attn_res_plan import AttnResKind
from k3_decode.kernels.cluster_residency import max_active_clusters
from k3_decode.kernels.kda_o_proj_plan import OProjPlan, wgmma_at
from k3_decode.kernels.kda_o_proj_wgmma_plan import OProjWgmmaPlan
from k3_decode.kernels.providers import not_built_reason
from k3_decode.stock import attn_res as stock_attn_res
from k3_decode.stock import gemm
from tests.k3_decode.kernels.test_attn_res_gpu import EPS, make_buffers, site_of
from tests.k3_decode.kernels.test_kda_in_proj_gpu import _graph_seconds_per_call, copy_bandwidth, operands
from tests.k3_decode.kernels.test_kda_o_proj_gpu import (
    AFTER_KINDS,
    EDGE,
    SAVE_KINDS,
    Chain,
    after_weights,
    bits,
    check_against_the_oracle,
    check_graph_replays,
    choice_on_and_off,
    run_back_to_back,
    served_choice_with,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not_built_reason() is not None, reason=f"the CuTe DSL kernels cannot run: {not_built_reason()}"),
]

DEV = "cuda"
CASES = (
    [(tp, b, k) for tp in (8, 16) for b in (9, 16, 17, 22, 32, 33, 48, 64) for k in EDGE]
    + [(16, 12, k) for k in AFTER_KINDS]
    + [(8, 64, k) for k in SAVE_KINDS]
)
SLOWER_LIMIT = 1.1  # where the wgmma build is served, against the faster of the mma.sync build and the stock pair


@pytest.mark.parametrize("tp, batch, kind", CASES, ids=[f"tp{t}-B{b}-{k.tag}" for t, b, k in CASES])
def test_the_wgmma_build_matches_the_oracle(tp: int, batch: int, kind: AttnResKind):
    check_against_the_oracle(tp, batch, kind, wgmma=True)


@pytest.mark.parametrize("tp", [8, 16])
def test_a_rows_o_proj_bits_do_not_depend_on_the_batch(tp: int):
    hidden, k = K3.shard(tp).kda_o_proj
    kind = AttnResKind.from_tag("n1-add-norm")
    o64, w, _, _ = operands(hidden, k, 64, tp)
    results = {}
    for batch in (9, 16, 17, 32, 33, 64):
        buffers, _, _ = make_buffers(batch, kind.num_blocks, torch.Generator().manual_seed(batch))
        o = o64[:batch].contiguous()
        results[batch], _ = kda_o_proj_op.apply(o, w, buffers, site_of(kind), after_weights(), EPS, wgmma=True)
    torch.cuda.synchronize()
    for batch, partial in results.items():
        assert torch.equal(bits(partial), bits(results[64][:batch])), f"TP{tp} B{batch}: rows differ from B64's"
    assert not torch.equal(bits(results[64][32:64]), bits(results[64][:32]))  # distinct rows, not one repeated


def test_back_to_back_launches_of_both_builds_share_the_arrival_word():
    """36 launches, three plans in turn (two wgmma, one mma.sync) with nothing between them (run_back_to_back)."""
    chains = [
        Chain.make(8, 64, AttnResKind.from_tag("n1-add-norm"), 12, seed=11, wgmma=True),
        Chain.make(8, 32, AttnResKind.from_tag("n4-add-norm"), 12, seed=12, wgmma=False),
        Chain.make(16, 17, AttnResKind.from_tag("n2-restart-norm"), 12, seed=13, wgmma=True),
    ]
    run_back_to_back(chains, 12, "wgmma o_proj")


def test_cuda_graph_replays_of_both_builds():
    """Two chained wgmma launches of TP8 B48, then an mma.sync TP16 B16, in a graph replayed 10 times
    (check_graph_replays)."""
    a = Chain.make(8, 48, AttnResKind.from_tag("n8-add-norm"), 2, seed=14, wgmma=True)
    b = Chain.make(16, 16, AttnResKind.from_tag("n1-restart-norm"), 1, seed=15, wgmma=False)
    check_graph_replays(a, b, 10, "wgmma o_proj")


def test_the_plan_the_op_picks_follows_the_choice_and_the_argument():
    hidden, k = K3.shard(8).kda_o_proj
    kind = AttnResKind.from_tag("n1-add-norm")
    o, w, _, _ = operands(hidden, k, 64, 0)
    buffers, _, _ = make_buffers(64, kind.num_blocks, torch.Generator().manual_seed(0))
    site, mix = site_of(kind), after_weights()
    assert isinstance(kda_o_proj_op.plan_for(o, w, buffers, site, mix, wgmma=True), OProjWgmmaPlan)
    assert not isinstance(kda_o_proj_op.plan_for(o, w, buffers, site, mix, wgmma=False), OProjWgmmaPlan)
    served = kda_o_proj_op.plan_for(o, w, buffers, site, mix)
    assert isinstance(served, OProjWgmmaPlan) == wgmma_at(64)


def two_per_sm_choice(tmp_path) -> Path:
    """kda_o_proj_choice.toml with the wgmma build's ring sized for two CTAs an SM."""
    text = kda_o_proj_plan.CHOICE.read_text()
    assert text.count("\nwgmma_ctas_per_sm = 3\n") == 1, "the served choice names its wgmma_ctas_per_sm"
    two = tmp_path / "kda_o_proj_choice-2-per-sm.toml"
    two.write_text(text.replace("\nwgmma_ctas_per_sm = 3\n", "\nwgmma_ctas_per_sm = 2\n"))
    return two


def test_the_driver_holds_fewer_clusters_than_the_sm_count_and_the_op_refuses_a_grid_that_could_hang(
    tmp_path, monkeypatch
):
    """On one H100 (b8e3e11) the wgmma build sized for two CTAs an SM finished at TP8 B21-B24 (21-24 epilogue
    clusters waiting) and hung at B32 and B64 (32), where the SM count gives 37 clusters at once. The driver's count
    (cluster_residency) must tell those apart, and the served builds must pass it; the op then refuses B32 at two an
    SM with those 32 epilogue clusters in one line before anything is compiled or launched (two-an-SM plans now wait
    on at most 24: TWO_PER_SM_EPILOGUE_CLUSTERS, test_two_ctas_an_sm_wait_on_at_most_24_epilogue_clusters...)."""
    hidden, k = K3.shard(8).kda_o_proj
    kind = AttnResKind.from_tag("n1-add-norm")
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count

    def at_once(p) -> int:
        return max_active_clusters(torch.cuda.current_device(), p.cluster, *p.residency)

    counts = {}
    for batch, per_sm in ((24, 2), (32, 2), (64, 2), (64, 3), (32, 3)):
        p = OProjWgmmaPlan.for_shape(hidden, k, batch, kind, sms, ctas_per_sm=per_sm, max_epilogue_clusters=32)
        counts[(batch, per_sm)] = n = at_once(p)
        print(
            f"METRIC wgmma o_proj TP8 B{batch}, {per_sm} CTAs an SM: {n} clusters at once by the driver, "
            f"{p.resident_clusters} by the SM count, {p.epilogue_clusters} wait"
        )
    mma = OProjPlan.for_shape(hidden, k, 64, kind, sms)
    print(f"METRIC mma.sync o_proj TP8 B64: {at_once(mma)} clusters at once, {mma.epilogue_clusters} wait")
    if sms == 132:  # the H100 SXM and H200 this was seen on; other parts have other GPCs
        assert counts[(24, 2)] > 24 and counts[(32, 2)] <= 32 and counts[(64, 2)] <= 32, counts
        assert counts[(64, 3)] > 32 and counts[(32, 3)] > 32 and at_once(mma) > mma.epilogue_clusters, counts
    if counts[(32, 2)] > 32:
        pytest.skip(f"this GPU ({sms} SMs) holds {counts[(32, 2)]} clusters of the two-a-SM ring: nothing to refuse")

    monkeypatch.setattr(kda_o_proj_plan, "CHOICE", two_per_sm_choice(tmp_path))
    monkeypatch.setattr(kda_o_proj_wgmma_plan, "TWO_PER_SM_EPILOGUE_CLUSTERS", 32)  # the grid that hung
    o, w, _, _ = operands(hidden, k, 32, 0)
    buffers, _, _ = make_buffers(32, kind.num_blocks, torch.Generator().manual_seed(0))
    before = kda_o_proj_op.launch_count()
    with pytest.raises(ValueError, match=r"could hang or crawl; size its ring for 3 CTAs an SM") as err:
        kda_o_proj_op.apply(o, w, buffers, site_of(kind), after_weights(), EPS, None, True)
    assert "\n" not in str(err.value) and kda_o_proj_op.launch_count() == before


@pytest.mark.parametrize("tp", [8, 16])
def test_two_ctas_an_sm_wait_on_at_most_24_epilogue_clusters_and_match_the_oracle(tp: int, tmp_path, monkeypatch):
    """At two CTAs an SM at most 24 epilogue clusters wait (TWO_PER_SM_EPILOGUE_CLUSTERS), which the driver holds
    with the margin where 32 hung: two rows each at B32 (16 clusters) and three at B64 (22, the last cluster's
    third row past the batch: exchanged, not stored), paired at B64 with one block (the three rows exchanged together)
    and not with eight. Not served (kda_o_proj_choice.toml wgmma_two_per_sm_batches); held to the oracle here."""
    monkeypatch.setattr(kda_o_proj_plan, "CHOICE", two_per_sm_choice(tmp_path))
    hidden, k = K3.shard(tp).kda_o_proj
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    for batch, rows in ((32, 2), (64, 3)):
        for tag in ("n1-add-norm", "n8-add-norm"):
            kind = AttnResKind.from_tag(tag)
            p = OProjWgmmaPlan.for_shape(hidden, k, batch, kind, sms)
            assert (p.ctas_per_sm, p.epilogue_rows, p.epilogue_clusters <= 24) == (2, rows, True), p.tag
            assert p.paired_rows == (batch == 64 and kind.num_blocks == 1), p.tag
            check_against_the_oracle(tp, batch, kind, wgmma=True)


@pytest.mark.parametrize("wgmma", [False, True], ids=["mma-sync", "wgmma"])
@pytest.mark.parametrize("tp", [8, 16])
def test_paired_rows_give_one_row_at_a_times_bits_and_are_timed_beside_it(tp: int, wgmma: bool, tmp_path, monkeypatch):
    """kda_o_proj_choice.toml's paired_rows (served at 48-64 rows where one block is mixed): above 32 rows each
    epilogue cluster reads all its rows' o_proj outputs at once and overlaps their exchanges (attn_res.py
    mix_and_store_rows) instead of one row after the other. The same arithmetic per row in the same order, so the
    same o_proj bits and MLP input at B33 (the last cluster's second row past the batch: exchanged, not stored) and
    B64, the one-block kinds, in both builds; timed beside each other for the layer benchmark to decide. Two rows a
    cluster, or three where the served ring holds two CTAs an SM from 49 rows (at most 24 epilogue clusters: TP8
    B64)."""

    def check(plan, on: bool) -> None:
        rows = 3 if plan.batch > 48 and getattr(plan, "ctas_per_sm", 0) == 2 else 2
        assert plan.paired_rows == on and plan.epilogue_rows == rows, plan.tag

    def serve(on: bool) -> None:
        served_choice_with(tmp_path, monkeypatch, "paired_rows", "{ batches = [33, 64], max_blocks = 1 }" if on else "")

    cases = [(batch, AttnResKind.from_tag(tag)) for batch in (33, 64) for tag in ("n1-add-norm", "n1-restart-norm")]
    choice_on_and_off(tp, cases, serve, check, "paired-rows wgmma" if wgmma else "paired-rows mma.sync", wgmma)
    serve(True)  # and held to the oracle where the last cluster's second row lies past the batch: nothing written there
    for _, kind in cases[:2]:
        check_against_the_oracle(tp, 33, kind, wgmma)


@pytest.mark.parametrize("late", [False, True], ids=["before-wait", "after-wait"])
@pytest.mark.parametrize("tp", [8, 16])
def test_w_to_l2_changes_no_bit_and_is_timed_beside_the_plain_ring(tp: int, late: bool, tmp_path, monkeypatch):
    """kda_o_proj_choice.toml's wgmma_w_l2_batches / wgmma_w_l2_late_batches (not served): the stream CTAs send the
    rest of their rows of W to L2 before (after) the wait, which changes when bytes arrive, never what is computed:
    the same o_proj bits and MLP input as the plain ring at B32, B48 and B64, the lightest and heaviest add kinds;
    timed beside it per call."""
    key = "wgmma_w_l2_late_batches" if late else "wgmma_w_l2_batches"

    def check(plan, on: bool) -> None:
        assert (plan.w_l2_late if late else plan.w_l2) == on and plan.l2_columns > 0, plan.tag

    def serve(on: bool) -> None:
        served_choice_with(tmp_path, monkeypatch, key, "[32, 64]" if on else "")

    cases = [(batch, AttnResKind.from_tag(tag)) for batch in (32, 48, 64) for tag in ("n1-add-norm", "n8-add-norm")]
    choice_on_and_off(tp, cases, serve, check, "w-l2-late wgmma" if late else "w-l2 wgmma", wgmma=True)


@pytest.mark.parametrize("tp", [8, 16])
def test_timing_against_the_mma_sync_build_and_the_stock_pair(tp: int, tmp_path, monkeypatch):
    """Per call; the wgmma build also with its ring sized for two CTAs an SM (kda_o_proj_choice.toml
    wgmma_ctas_per_sm = 2: more stages, the grid no longer resident at once at B64), printed beside the served one."""
    served, two = kda_o_proj_plan.CHOICE, two_per_sm_choice(tmp_path)
    copy = copy_bandwidth()
    l2 = torch.cuda.get_device_properties(DEV).L2_cache_size
    hidden, k = K3.shard(tp).kda_o_proj
    weight_bytes = hidden * k * 2
    copies = max(2, math.ceil(3 * l2 / weight_bytes))  # each call streams its weight from HBM, not from L2
    weights = [(torch.randn(hidden, k, device=DEV) * 0.02).bfloat16() for _ in range(copies)]
    mix = after_weights()
    slower = []
    for batch in (16, 32, 48, 64):
        for kind in (AttnResKind.from_tag(f"n{n}-add-norm") for n in ((1, 8) if batch >= 32 else (1,))):
            o = torch.randn(batch, k, device=DEV).bfloat16()
            buffers, _, _ = make_buffers(batch, kind.num_blocks, torch.Generator().manual_seed(batch))
            site = site_of(kind)
            attn_out = torch.empty(batch, hidden, dtype=torch.bfloat16, device=DEV)

            def build(wgmma: bool, o=o, ws=weights, buffers=buffers, site=site, attn_out=attn_out):
                def call(i: int) -> None:
                    kda_o_proj_op.apply(o, ws[i % copies], buffers, site, mix, EPS, attn_out, wgmma)

                return call

            def stock(i: int, o=o, ws=weights, buffers=buffers, site=site) -> None:
                partial = gemm.linear(o, ws[i % copies])
                stock_attn_res.apply(buffers, site, partial, mix, EPS, "triton")

            runs = (
                ("wgmma", build(True), served),
                ("wgmma2", build(True), two),
                ("mma", build(False), served),
                ("stock", stock, served),
            )
            us = {}
            for name, fn, choice_file in runs:  # the plan is made (and compiled) at the first call, inside the timing
                monkeypatch.setattr(kda_o_proj_plan, "CHOICE", choice_file)
                try:
                    us[name] = _graph_seconds_per_call(fn, 4 * copies) * 1e6
                except ValueError as refused:  # two an SM where the driver holds too few clusters (test above)
                    assert name == "wgmma2" and "could hang" in str(refused), (name, refused)
                    us[name] = math.nan
            monkeypatch.setattr(kda_o_proj_plan, "CHOICE", served)
            two_us = "refused" if math.isnan(us["wgmma2"]) else f"{us['wgmma2']:.1f} us"
            print(
                f"METRIC o_proj + AttnRes TP{tp} B{batch} {kind.tag} (graph replays, per call): wgmma "
                f"{us['wgmma']:.1f} us ({weight_bytes / (us['wgmma'] * 1e-6) / copy:.1%} of copy for W; two CTAs an "
                f"SM {two_us}), mma.sync {us['mma']:.1f} us, stock cuBLAS + Triton {us['stock']:.1f} us"
            )
            if wgmma_at(batch) and us["wgmma"] > SLOWER_LIMIT * min(us["mma"], us["stock"]):
                slower.append(f"B{batch} {kind.tag}: {us['wgmma']:.1f} us")
    del weights
    assert not slower, f"TP{tp}: the served wgmma build is over {SLOWER_LIMIT}x slower than the faster other: {slower}"
