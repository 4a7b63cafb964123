"""GPU: o_proj with the AttnRes after attention in one CuTe DSL launch (k3_decode/kernels/kda_o_proj.py) on an H200.

The o_proj provider (providers.py, CuteKdaOProjProvider) was registered after this passed on an H200. Every
test prints what it measured (METRIC lines), so a run's log says how close each case came.

The mma.sync build throughout (kda_o_proj_op's wgmma=False) but where a test times or runs what the tree serves;
the wgmma build, served at B16 and from 32 rows (kda_o_proj_choice.toml), has its own test
(test_kda_o_proj_wgmma_gpu.py).

- The fused launch against the FP64 oracle (exact o_proj, then the AttnRes after attention) at TP8 and TP16,
  B = 1..4 (the CUDA-core stream), 8 and 16 (tensor cores, two batch tiles), 22 and 32 (four tiles) and 33 and
  64 (two passes; epilogue clusters of two rows, 33's last cluster with one), every
  after-attention kind K3 uses (restart and add over banks of 1..8 blocks) at B = 3 and two kinds
  that save a block, the lightest and the heaviest at every other (TP, B). o_proj's output is held to the input
  projection's bound (one BF16 rounding of an FP32 sum, tests/k3_decode/kernels/test_kda_in_proj_gpu.py) and must
  equal cuBLAS's bits on >= 98% of outputs; the MLP input to the AttnRes tolerance (attention_tolerances.toml, the
  stock kernel's) both against the oracle fed the kernel's own o_proj output and end to end; the prefix and a saved
  block bit-equal to the oracle's; no other bank block, spare row or byte past o_proj's output changes; bank slots
  past the site's blocks hold NaN, which must not reach any output.
- Many back-to-back launches of two plans (TP8 and TP16 shapes) sharing the device's arrival word, with no sync
  between them, and a CUDA graph of three launches replayed 20 times: each launch must see all of its own grid's
  o_proj output (o_proj buffers start as NaN) and leave the arrival word's low 31 bits at zero; the launch counter
  counts every launch.
- The provider inside the stack executor (its two runner calls as one launch), against the teacher-forced
  oracle, eagerly and in graph replays the device counters confirm.
- Timing in CUDA-graph replays against the stock pair (cuBLAS + the Triton AttnRes) and the two-launch path (the
  weight-stream kernel, then the CuTe AttnRes kernel), printed; asserted only loosely, at the batches the provider
  serves (providers.toml; not 1.5x slower than the faster of the two): speed targets belong to the KDA layer
  benchmark (benchmarks/kda_layer_h200.py).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from functools import cache

import pytest
import torch
from torch import Tensor

from k3_decode.attn_res_state import AttnResBuffers, AttnResSite
from k3_decode.config import K3
from k3_decode.kernels import attn_res_op, kda_in_proj_op, kda_o_proj_op
from k3_decode.kernels.attn_res_plan import AttnResKind, site_kinds
from k3_decode.kernels.kda_o_proj_plan import OProjPlan
from k3_decode.kernels.providers import max_rows, not_built_reason
from k3_decode.reference import attn_res as ra
from k3_decode.stock import attn_res as stock_attn_res
from k3_decode.stock import gemm
from tests.k3_decode.kernels.helpers import compiled_cubin, ctas_per_sm
from tests.k3_decode.kernels.test_attn_res_gpu import CAPACITY, EPS, HIDDEN, TOL, make_buffers, site_of
from tests.k3_decode.kernels.test_kda_in_proj_gpu import (
    BIT_EQUAL_FLOOR,
    _graph_seconds_per_call,
    bound,
    copy_bandwidth,
    linear_fp32_reduction,
    operands,
)
from tests.k3_decode.stock.attention_helpers import assert_close, error_metrics, weights_for

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not_built_reason() is not None, reason=f"the CuTe DSL kernels cannot run: {not_built_reason()}"),
]

DEV = "cuda"
LOW_BITS = 0x7FFFFFFF
AFTER_KINDS = sorted(
    (k for k, sites in site_kinds(K3).items() if any(s.startswith("after attention") for s in sites)),
    key=lambda k: (k.num_blocks, k.tag),
)
SAVE_KINDS = [AttnResKind(3, "add", True, True), AttnResKind(5, "restart", True, True)]
EDGE = [AttnResKind.from_tag("n1-restart-norm"), AttnResKind.from_tag("n8-add-norm")]
N1_ADD = AttnResKind.from_tag("n1-add-norm")
# B = 1..4: the CUDA-core stream; 8 and 16: tensor cores in one pass of two batch tiles; 22 and 32: one pass of four
# tiles (22: a third tile of 6 rows, 2 masked, and a fourth past the batch); 33 and 64: two passes, and 17 and 32
# epilogue clusters of two rows each (33: the last cluster's second row past the batch).
CASES = (
    [(8, 3, k) for k in AFTER_KINDS + SAVE_KINDS]
    + [(tp, b, k) for tp in (8, 16) for b in (1, 2, 3, 4, 8, 16, 22, 32, 33, 64) for k in EDGE if (tp, b) != (8, 3)]
    + [(8, 64, k) for k in [*SAVE_KINDS, AttnResKind.from_tag("n3-add-norm"), AttnResKind.from_tag("n4-add-norm")]]
)
STOCK_MARGIN = 1.05  # end to end beyond the table: at most this much above the stock pair's error, same inputs
SLOWER_LIMIT = 1.5  # loose: the fused launch against the faster of the stock pair and the two-launch path


@cache
def after_weights(layer: int = 6) -> ra.MixWeights:
    """The AttnRes after attention's weights of a layer (replicated: the same at every TP)."""
    res = weights_for(K3, 8, DEV).residual(layer)
    return ra.MixWeights(res.mlp_res.norm, res.mlp_res.proj, res.post_attn_norm)


def oracle(kind: AttnResKind, prefix: Tensor, bank: Tensor, delta: Tensor) -> tuple[Tensor, Tensor]:
    """(FP64 MLP input, BF16 new prefix) of the AttnRes after attention with `delta` as the attention output."""
    p = ra.add_to_prefix(prefix, delta) if kind.delta == "add" else delta.to(ra.STATE_DTYPE)
    sources = torch.cat([bank[:, : kind.num_blocks], p.unsqueeze(1)], dim=1)
    return ra.mix(sources, after_weights(), EPS, torch.float64), p


def bits(t: Tensor) -> Tensor:
    """BF16 bit patterns, so that NaN slots compare equal to themselves."""
    return t.contiguous().view(torch.int16)


def nan_unused_slots(bank: Tensor, kind: AttnResKind) -> None:
    """Every bank block the site neither reads nor saves holds NaN: reading one poisons the output."""
    bank[:, kind.num_blocks + kind.save :] = float("nan")


def arrival_low_bits() -> int:
    return int(kda_o_proj_op.arrival_word(torch.device(DEV)).item()) & LOW_BITS


@pytest.mark.parametrize("tp, batch, kind", CASES, ids=[f"tp{t}-B{b}-{k.tag}" for t, b, k in CASES])
def test_the_fused_launch_matches_the_oracle(tp: int, batch: int, kind: AttnResKind):
    check_against_the_oracle(tp, batch, kind, wgmma=False)  # the wgmma build: test_kda_o_proj_wgmma_gpu.py


def check_against_the_oracle(tp: int, batch: int, kind: AttnResKind, wgmma: bool | None = None) -> None:
    """One launch (`wgmma`: which build, kda_o_proj_op.plan_for) against the FP64 oracle: see the module's doc."""
    hidden, k = K3.shard(tp).kda_o_proj
    seed = tp * 1000 + batch * 100 + kind.num_blocks * 2 + kind.save
    o, w, attn_out, obuf = operands(hidden, k, batch, seed)  # NaN rows after o and W, a NaN tail after attn_out
    buffers, prefix_all, bank_all = make_buffers(batch, kind.num_blocks, torch.Generator().manual_seed(seed))
    nan_unused_slots(bank_all, kind)
    prefix_before, bank_before, tail = prefix_all.clone(), bank_all.clone(), obuf[batch * hidden :].clone()
    launches = kda_o_proj_op.launch_count()

    partial, got = kda_o_proj_op.apply(o, w, buffers, site_of(kind), after_weights(), EPS, attn_out, wgmma)
    torch.cuda.synchronize()
    what = f"fused o_proj{' (wgmma)' * bool(wgmma)} TP{tp} B{batch} {kind.tag}"

    # o_proj: one BF16 rounding of an FP32 sum, nearly always cuBLAS's bits, nothing written past it.
    assert partial.data_ptr() == attn_out.data_ptr() and torch.isfinite(partial).all(), what
    exact, tol = bound(o, w)
    worst = float(((partial.double() - exact).abs() / tol).max())
    same = float((partial == linear_fp32_reduction(o, w)).double().mean())
    assert torch.equal(bits(obuf[batch * hidden :]), bits(tail)), f"{what}: wrote past o_proj's output"
    # AttnRes: from the kernel's own o_proj output (the AttnRes kernel's contract), and end to end.
    ref, p_ref = oracle(kind, prefix_before[:batch], bank_before[:batch], partial)
    rms, peak = assert_close(got, ref, TOL, what)
    e2e_ref, _ = oracle(kind, prefix_before[:batch], bank_before[:batch], exact)
    e2e_tol = TOL
    if any(e > t for e, t in zip(error_metrics(got, e2e_ref), (TOL.rms_rel, TOL.peak_rel), strict=True)):
        # End to end includes o_proj's own BF16 rounding, which the stock pair makes as well (cuBLAS's output is
        # BF16): beyond the table, the launch is held to the stock pair's error on the same inputs.
        stock_rms, stock_peak = stock_end_to_end(o, w, kind, seed, e2e_ref)
        e2e_tol = dataclasses.replace(
            TOL,
            rms_rel=max(TOL.rms_rel, STOCK_MARGIN * stock_rms),
            peak_rel=max(TOL.peak_rel, STOCK_MARGIN * stock_peak),
        )
        print(
            f"METRIC {what}: end to end beyond the table; the stock pair's on the same inputs: rms_rel "
            f"{stock_rms:.2e} peak_rel {stock_peak:.2e}"
        )
    e2e_rms, e2e_peak = assert_close(got, e2e_ref, e2e_tol, f"{what}, end to end")
    print(
        f"METRIC {what}: o_proj error/bound max {worst:.3f}, bit-equal to cuBLAS {same:.4f}; MLP input rms_rel "
        f"{rms:.2e} peak_rel {peak:.2e} (end to end {e2e_rms:.2e} / {e2e_peak:.2e})"
    )
    assert worst <= 1.0, f"{what}: o_proj error reaches {worst:.2f}x the bound"
    assert same >= BIT_EQUAL_FLOOR, f"{what}: only {same:.4f} of o_proj outputs equal cuBLAS's bits"
    assert got.dtype == torch.bfloat16 and got.shape == (batch, HIDDEN)
    assert torch.equal(prefix_all[:batch], p_ref), f"{what}: the prefix must be bit-equal (one FP32 add, RTNE)"
    expected_bank = bank_before.clone()
    if kind.save:
        expected_bank[:batch, kind.num_blocks] = p_ref
        assert buffers.num_blocks == kind.num_blocks + 1
    assert torch.equal(bits(bank_all), bits(expected_bank)), f"{what}: the bank changed outside the saved block"
    assert torch.equal(prefix_all[batch:], prefix_before[batch:]), f"{what}: a row outside the batch changed"
    assert kda_o_proj_op.launch_count() - launches == 1, "the device counter must count the launch once"


def stock_end_to_end(o: Tensor, w: Tensor, kind: AttnResKind, seed: int, ref: Tensor) -> tuple[float, float]:
    """(rms_rel, peak_rel) of the stock pair's MLP input (cuBLAS, then the Triton AttnRes) against `ref`, from the
    buffers check_against_the_oracle started from (the same seed)."""
    buffers, _, bank = make_buffers(o.shape[0], kind.num_blocks, torch.Generator().manual_seed(seed))
    nan_unused_slots(bank, kind)
    got = stock_attn_res.apply(buffers, site_of(kind), gemm.linear(o, w), after_weights(), EPS, "triton")
    return error_metrics(got, ref)


@pytest.mark.parametrize("tp", [8, 16])
def test_a_rows_o_proj_bits_do_not_depend_on_the_batch_on_tensor_cores(tp: int):
    """Two batch tiles (B8, B16), four (B22, B32) or two passes of four (B33, B64): the same K split and summation
    order for every batch row, so a row's o_proj output is the same bits at every tensor-core batch it is part of."""
    hidden, k = K3.shard(tp).kda_o_proj
    kind = AttnResKind.from_tag("n1-add-norm")
    o64, w, _, _ = operands(hidden, k, 64, tp)
    results = {}
    for batch in (8, 16, 22, 32, 33, 64):
        buffers, _, _ = make_buffers(batch, kind.num_blocks, torch.Generator().manual_seed(batch))
        o, site = o64[:batch].contiguous(), site_of(kind)
        partial, _ = kda_o_proj_op.apply(o, w, buffers, site, after_weights(), EPS, wgmma=False)
        results[batch] = partial
    torch.cuda.synchronize()
    for batch, partial in results.items():
        assert torch.equal(bits(partial), bits(results[64][:batch])), f"TP{tp} B{batch}: rows differ from B64's"
    assert not torch.equal(bits(results[64][32:64]), bits(results[64][:32]))  # distinct rows, not one repeated


@dataclasses.dataclass
class Chain:
    """One plan's operands for a sequence of launches: fresh o per launch, o_proj buffers starting as NaN."""

    tp: int
    batch: int
    kind: AttnResKind
    w: Tensor
    os: list[Tensor]
    partials: list[Tensor]
    buffers: AttnResBuffers
    prefix0: Tensor
    bank0: Tensor
    wgmma: bool | None = None  # the build (kda_o_proj_op.plan_for); None: what the choice file serves

    @classmethod
    def make(cls, tp: int, batch: int, kind: AttnResKind, launches: int, seed: int, wgmma: bool | None = None) -> Chain:
        hidden, k = K3.shard(tp).kda_o_proj
        gen = torch.Generator().manual_seed(seed)
        _, w, _, _ = operands(hidden, k, batch, seed)
        os = [torch.randn(batch, k, generator=gen).bfloat16().to(DEV) for _ in range(launches)]
        partials = [torch.full((batch, hidden), float("nan"), dtype=torch.bfloat16, device=DEV) for _ in os]
        buffers, _, bank = make_buffers(batch, kind.num_blocks, gen)
        nan_unused_slots(bank, kind)
        return cls(tp, batch, kind, w, os, partials, buffers, buffers.prefix.clone(), buffers.blocks.clone(), wgmma)

    def launch(self, i: int) -> Tensor:
        site = site_of(self.kind)
        self.buffers.num_blocks = self.kind.num_blocks
        o, w, mix = self.os[i], self.w, after_weights()
        return kda_o_proj_op.apply(o, w, self.buffers, site, mix, EPS, self.partials[i], self.wgmma)[1]

    def check(self, outputs: list[Tensor], what: str) -> float:
        """Every launch against the oracle, the prefix carried from launch to launch; returns the worst rms_rel."""
        prefix, worst = self.prefix0, 0.0
        for i, got in enumerate(outputs):
            exact, tol = bound(self.os[i], self.w)
            partial = self.partials[i]
            assert torch.isfinite(partial).all(), f"{what} launch {i}: o_proj output incomplete"
            assert bool(((partial.double() - exact).abs() <= tol).all()), f"{what} launch {i}: o_proj beyond its bound"
            ref, prefix = oracle(self.kind, prefix, self.bank0, partial)
            rms, _ = assert_close(got, ref, TOL, f"{what} launch {i}")
            worst = max(worst, rms)
        assert torch.equal(self.buffers.prefix, prefix), f"{what}: the prefix after the chain"
        return worst


def run_back_to_back(chains: list[Chain], launches: int, label: str) -> None:
    """`launches` launches of each chain in turn with nothing between them (PDL lets each start while the previous
    one finishes): each must apply AttnRes only once its own grid's o_proj output is complete, the arrival word's low
    bits end at 0, and the launch counter counts every launch."""
    for c in chains:  # compile outside the timed sequence, then restore the state
        c.launch(0)
        c.partials[0].fill_(float("nan"))
        c.buffers.prefix.copy_(c.prefix0)
    torch.cuda.synchronize()
    count = kda_o_proj_op.launch_count()
    outputs: list[list[Tensor]] = [[] for _ in chains]
    for i in range(launches):
        for c, out in zip(chains, outputs, strict=True):
            out.append(c.launch(i))
    torch.cuda.synchronize()
    worst = [c.check(out, f"back-to-back TP{c.tp} B{c.batch}") for c, out in zip(chains, outputs, strict=True)]
    word = arrival_low_bits()
    total = len(chains) * launches
    print(f"METRIC {label} back to back: {total} launches, worst MLP-input rms_rel {max(worst):.2e}")
    assert word == 0, f"the arrival word's low 31 bits are {word:#x} after whole launches, not 0"
    assert kda_o_proj_op.launch_count() - count == total


def check_graph_replays(a: Chain, b: Chain, replays: int, label: str) -> None:
    """A graph of three launches (two of chain `a`, one of `b`) replayed `replays` times, never reset, o_proj's
    outputs set to NaN before each: every replay gives the eager run's bits, the launch counter counts 3 per replay,
    and the arrival word's top bit flips once per launch (an odd number of times per replay), its low bits back at
    0."""

    def sequence() -> list[Tensor]:
        a.buffers.prefix.copy_(a.prefix0)
        b.buffers.prefix.copy_(b.prefix0)
        return [a.launch(0), a.launch(1), b.launch(0)]

    eager = [t.clone() for t in sequence()]
    torch.cuda.synchronize()
    a.check(eager[:2], f"graph sequence, eager TP{a.tp} B{a.batch}")
    b.check(eager[2:], f"graph sequence, eager TP{b.tp} B{b.batch}")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = sequence()
    top = int(kda_o_proj_op.arrival_word(torch.device(DEV)).item()) < 0
    count = kda_o_proj_op.launch_count()
    for replay in range(replays):
        for t in [*captured, *a.partials, *b.partials]:  # a launch that read o_proj's output early would see NaN
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for i, (got, want) in enumerate(zip(captured, eager, strict=True)):
            assert torch.equal(got, want), f"replay {replay}, launch {i}: differs from the eager run"
        word = int(kda_o_proj_op.arrival_word(torch.device(DEV)).item())
        assert word & LOW_BITS == 0, f"replay {replay}: arrival word {word & 0xFFFFFFFF:#x}"
        top = not top  # three flips
        assert (word < 0) == top, f"replay {replay}: the top bit did not flip once per launch"
    launches = kda_o_proj_op.launch_count() - count
    print(f"METRIC {label} graph: {replays} replays of 3 launches bit-equal to eager, device counter {launches}")
    assert launches == 3 * replays


def test_back_to_back_launches_of_two_plans_share_the_arrival_word():
    """40 launches, alternating a TP8 and a TP16 plan (run_back_to_back)."""
    chains = [
        Chain.make(8, 4, AttnResKind.from_tag("n4-add-norm"), 20, seed=1),
        Chain.make(16, 3, AttnResKind.from_tag("n2-restart-norm"), 20, seed=2),
    ]
    run_back_to_back(chains, 20, "fused o_proj")


def test_cuda_graph_replays_keep_the_arrival_word_right():
    """Two layers of one plan and one of another in a graph, replayed 20 times (check_graph_replays)."""
    a = Chain.make(8, 3, AttnResKind.from_tag("n8-add-norm"), 2, seed=3)
    b = Chain.make(16, 1, AttnResKind.from_tag("n1-restart-norm"), 1, seed=4)
    check_graph_replays(a, b, 20, "fused o_proj")


def test_inputs_the_kernel_cannot_take_are_refused():
    hidden, k = K3.shard(8).kda_o_proj
    w = torch.zeros(hidden, k, dtype=torch.bfloat16, device=DEV)
    site, weights = AttnResSite("add", None, 1, 1), after_weights()

    def o(rows: int, dtype: torch.dtype = torch.bfloat16) -> Tensor:
        return torch.zeros(rows, k, dtype=dtype, device=DEV)

    def bank(rows: int) -> AttnResBuffers:
        buffers = AttnResBuffers.allocate(rows, HIDDEN, CAPACITY, DEV)
        buffers.num_blocks = 1
        return buffers

    with pytest.raises(ValueError, match=r"1\.\.64 rows"):
        kda_o_proj_op.apply(o(65), w, bank(65), site, weights, EPS)
    with pytest.raises(ValueError, match=r"must be torch\.bfloat16"):
        kda_o_proj_op.apply(o(2, torch.float32), w, bank(2), site, weights, EPS)
    with pytest.raises(ValueError, match="contiguous"):
        kda_o_proj_op.apply(torch.zeros(k, 2, dtype=torch.bfloat16, device=DEV).t(), w, bank(2), site, weights, EPS)
    with pytest.raises(ValueError, match="add or restart"):
        kda_o_proj_op.apply(o(2), w, bank(2), AttnResSite("none", None, 1, 1), weights, EPS)
    with pytest.raises(ValueError, match="must be o_proj's output"):
        kda_o_proj_op.apply(o(2), w[:4096], bank(2), site, weights, EPS)
    with pytest.raises(ValueError, match="expects 8"):
        kda_o_proj_op.apply(o(2), w, bank(2), site_of(EDGE[1]), weights, EPS)


@pytest.mark.parametrize("tp", [8, 16])
def test_a_capped_launch_holds_four_ctas_an_sm_where_registers_allow_five(tp: int):
    """kda_o_proj_choice.toml's cap (OProjPlan.launch_smem_bytes): the driver's occupancy calculator, given the n1
    build at B32 (91 registers), fits five CTAs an SM at the kernel's own shared memory, the crowding the phase trace
    found on o_proj's slowest SMs, and four at the capped request; the n8 build (126-128 registers) four either
    way, so capping it changes nothing on the SM."""
    from k3_decode.kernels.kda_o_proj import KdaOProjKernel, compile_args

    hidden, k = K3.shard(tp).kda_o_proj
    for tag, want in (("n1-add-norm", 5), ("n8-add-norm", 4)):
        plan = OProjPlan.for_shape(hidden, k, 32, AttnResKind.from_tag(tag), capped=True)
        own = plan.cta_smem_bytes - 1024  # the kernel's allocation, without the driver's reserve
        cubin, entry = compiled_cubin(KdaOProjKernel(plan), compile_args(plan, CAPACITY))
        plain, capped = ctas_per_sm(cubin, entry, plan.threads, [own, plan.launch_smem_bytes])
        print(f"METRIC o_proj TP{tp} B32 {tag}: {plain} CTAs per SM at {own} B, {capped} at {plan.launch_smem_bytes} B")
        assert (plain, capped) == (want, plan.ctas_per_sm), (tag, plain, capped)


def one_pass_choice(tmp_path, monkeypatch, one_pass: bool) -> None:
    """Serve the one-pass stream at B33-B64 for the one-block kinds, or nowhere, through a choice file of the test's
    own (whatever kda_o_proj_choice.toml serves)."""
    from k3_decode.kernels import kda_o_proj_plan

    choice = tmp_path / f"kda_o_proj_choice-{int(one_pass)}.toml"
    rules = "{ batches = [33, 64], max_blocks = 1 }" if one_pass else ""
    choice.write_text(f"cap_batches = []\none_pass = [{rules}]\n")
    monkeypatch.setattr(kda_o_proj_plan, "CHOICE", choice)


def choice_on_and_off(
    tp: int, cases: list, serve: Callable[[bool], None], check: Callable, label: str, wgmma: bool = False
) -> None:
    """A choice of kda_o_proj_choice.toml off and on (`serve(on)` serves a choice file; `check(plan, on)` asserts
    the plan took it) at each case (batch, kind): the same o_proj bits and MLP input both ways, and both timed per
    call in graph replays (W from HBM), printed for the layer benchmark to confirm (speed is not asserted here).
    `wgmma`: of the wgmma build instead of the mma.sync one."""
    from k3_decode.kernels.kda_o_proj_wgmma_plan import OProjWgmmaPlan

    hidden, k = K3.shard(tp).kda_o_proj
    copy = copy_bandwidth()
    l2 = torch.cuda.get_device_properties(DEV).L2_cache_size
    copies = max(2, math.ceil(3 * l2 / (hidden * k * 2)))
    weights = [(torch.randn(hidden, k, device=DEV) * 0.02).bfloat16() for _ in range(copies)]
    mix = after_weights()
    results: dict[tuple[int, str, bool], tuple[Tensor, Tensor]] = {}
    timed: dict[tuple[int, str, bool], float] = {}
    for on in (False, True):
        serve(on)
        for batch, kind in cases:
            o, _, _, _ = operands(hidden, k, batch, tp + batch)
            check((OProjWgmmaPlan if wgmma else OProjPlan).for_shape(hidden, k, batch, kind), on)
            buffers, _, _ = make_buffers(batch, kind.num_blocks, torch.Generator().manual_seed(batch))
            site = site_of(kind)
            results[(batch, kind.tag, on)] = kda_o_proj_op.apply(o, weights[0], buffers, site, mix, EPS, wgmma=wgmma)
            attn_out = torch.empty(batch, hidden, dtype=torch.bfloat16, device=DEV)

            def fused(i: int, o=o, ws=weights, buffers=buffers, site=site, attn_out=attn_out) -> None:
                kda_o_proj_op.apply(o, ws[i % len(ws)], buffers, site, mix, EPS, attn_out=attn_out, wgmma=wgmma)

            timed[(batch, kind.tag, on)] = _graph_seconds_per_call(fused, 4 * copies)
    torch.cuda.synchronize()
    for (batch, tag, on), (partial, out) in results.items():
        if on:
            off_partial, off_out = results[(batch, tag, False)]
            what = f"{label} o_proj TP{tp} B{batch} {tag}"
            assert torch.equal(bits(partial), bits(off_partial)), f"{what}: o_proj bits differ from the plan without it"
            assert torch.equal(bits(out), bits(off_out)), f"{what}: the MLP input differs from the plan's without it"
            us, off_us = timed[(batch, tag, True)] * 1e6, timed[(batch, tag, False)] * 1e6
            share = hidden * k * 2 / (us * 1e-6) / copy
            print(f"METRIC {what} (graph replays, per call): {us:.1f} us ({share:.1%} of copy) against {off_us:.1f} us")
    del weights


@pytest.mark.parametrize("tp", [8, 16])
def test_one_pass_gives_the_two_pass_streams_bits_and_is_timed_beside_it(tp: int, tmp_path, monkeypatch):
    """kda_o_proj_choice.toml's one_pass (served at B33-B64 where one block is mixed): above 32 rows one pass of up
    to eight batch tiles instead of two of four, the same K split and summation order, so the same o_proj bits and
    MLP input as two passes at B33 and B64 (both one-block kinds); both timed."""

    def check(plan: OProjPlan, on: bool) -> None:
        assert plan.one_pass == on and len(plan.mma.passes) == (1 if on else 2), plan.tag

    cases = [(batch, AttnResKind.from_tag(tag)) for batch in (33, 64) for tag in ("n1-add-norm", "n1-restart-norm")]
    choice_on_and_off(tp, cases, lambda on: one_pass_choice(tmp_path, monkeypatch, on), check, "one-pass")


def served_choice_with(tmp_path, monkeypatch, key: str, ranges: str) -> None:
    """The served choice file with its `key` line (a list of batch ranges) set to `ranges`, as a choice file of the
    test's own."""
    from k3_decode.kernels import kda_o_proj_plan

    served = kda_o_proj_plan.CHOICE.read_text()
    text, lines = re.subn(rf"(?m)^{key} = .*$", f"{key} = [{ranges}]", served)
    assert lines == 1, f"kda_o_proj_choice.toml has no {key} line to set"
    path = tmp_path / f"kda_o_proj_choice-{key}-{len(ranges)}.toml"
    path.write_text(text)
    monkeypatch.setattr(kda_o_proj_plan, "CHOICE", path)


def warm_choice(tmp_path, monkeypatch, warm: bool) -> None:
    """The served choice file with its warm_batches line set to every batch or none."""
    served_choice_with(tmp_path, monkeypatch, "warm_batches", "[1, 64]" if warm else "")


@pytest.mark.parametrize("tp", [8, 16])
def test_warming_l2_changes_no_bit_and_is_timed_beside_the_plain_stream(tp: int, tmp_path, monkeypatch):
    """kda_o_proj_choice.toml's warm_batches: the CTA prefetches into L2 the runs of W it loads after its wait
    (OProjPlan.late_runs), which changes when bytes arrive, never what is computed: the same o_proj bits and MLP
    input as the plain stream at every batch whose one-pass stream has late runs (both streams, both epilogue sizes).
    Here the kernel before each timed call is the previous call, so the layer benchmark, where the KDA step runs
    before it, decides."""
    hidden, k = K3.shard(tp).kda_o_proj
    cases = [
        (batch, kind)
        for batch in (1, 4, 8, 16, 32, 64)
        for kind in EDGE
        if OProjPlan.for_shape(hidden, k, batch, kind, warm=False).warmable
    ]
    want = [1, 4, 8, 16, 32, 64] if tp == 8 else [32, 64]
    assert sorted({b for b, _ in cases}) == want and len(cases) == 2 * len(want) - 1  # B64 n8: two passes

    def check(plan: OProjPlan, on: bool) -> None:
        assert plan.warm_l2 == on, plan.tag

    choice_on_and_off(tp, cases, lambda on: warm_choice(tmp_path, monkeypatch, on), check, "warm")


@pytest.mark.parametrize("tp", [8, 16])
def test_w_in_shared_memory_changes_no_bit_and_is_timed_beside_the_plain_stream(tp: int, tmp_path, monkeypatch):
    """kda_o_proj_choice.toml's w_smem_batches: the CTA's rows of W bulk-copied into shared memory before the wait
    and the stream's slots filled from there, which changes where W is read from, never what is computed: the same
    o_proj bits and MLP input as the plain stream at B1-B64 (CUDA cores; one and two tensor-core passes; both
    epilogue sizes), both timed.
    Speed is the layer benchmark's to judge (the KDA step runs before o_proj there)."""
    cases = [(batch, kind) for batch in (1, 4, 8, 16, 32, 64) for kind in (N1_ADD, EDGE[-1])]

    def check(plan: OProjPlan, on: bool) -> None:
        assert plan.w_smem == on and (not plan.tensor_cores or plan.mma.w_smem == on), plan.tag

    serve = lambda on: served_choice_with(tmp_path, monkeypatch, "w_smem_batches", "[1, 64]" if on else "")  # noqa: E731
    choice_on_and_off(tp, cases, serve, check, "w-smem")


@pytest.mark.parametrize("tp", [8, 16])
def test_w_sent_to_l2_alone_changes_no_bit_and_is_timed_beside_the_plain_stream(tp: int, tmp_path, monkeypatch):
    """kda_o_proj_choice.toml's w_l2_batches: the CTA's rows of W prefetched whole into L2 before the wait and its
    first group loaded only after it, which changes when W moves, never what is computed: the same o_proj bits and
    MLP input as the plain stream at B1, B2 and B4 (both epilogue sizes), both timed. Per call it can only lose (the
    previous kernel here is the previous call); what it is for, the KDA step running beside o_proj's CTAs without
    their weight loads, only the layer benchmark shows."""
    cases = [(batch, kind) for batch in (1, 2, 4) for kind in (N1_ADD, EDGE[-1])]

    def check(plan: OProjPlan, on: bool) -> None:
        assert plan.w_l2 == on and plan.l2_prefetched == on, plan.tag

    serve = lambda on: served_choice_with(tmp_path, monkeypatch, "w_l2_batches", "[1, 4]" if on else "")  # noqa: E731
    choice_on_and_off(tp, cases, serve, check, "w-l2")


@pytest.mark.parametrize("tp", [8, 16])
def test_the_driver_fits_the_w_smem_plans_resident_ctas_an_sm(tp: int):
    """OProjPlan.resident_ctas_per_sm, which the plan's refusal of a grid that could never finish rests on: the
    driver's occupancy calculator, given the staged build at B64 and its own shared memory, fits exactly that many
    CTAs an SM (three at TP8, where W takes 48 KB a CTA; four at TP16)."""
    from k3_decode.kernels.kda_o_proj import KdaOProjKernel, compile_args

    hidden, k = K3.shard(tp).kda_o_proj
    plan = OProjPlan.for_shape(hidden, k, 64, N1_ADD, w_smem=True)
    own = plan.cta_smem_bytes - 1024  # the kernel's allocation, without the driver's reserve
    cubin, entry = compiled_cubin(KdaOProjKernel(plan), compile_args(plan, CAPACITY))
    (fits,) = ctas_per_sm(cubin, entry, plan.threads, [own])
    print(f"METRIC o_proj TP{tp} B64 w-smem: {fits} CTAs per SM at {own} B")
    assert fits == plan.resident_ctas_per_sm == (3 if tp == 8 else 4), (fits, plan.resident_ctas_per_sm)


# --- the provider inside the stack executor -------------------------------------------------------------


@pytest.mark.parametrize("tp", [8, 16])
def test_the_provider_serves_o_proj_and_its_attn_res_in_one_launch_in_the_executor(tp: int):
    """The executor with the o_proj provider registered and o_proj specialized in a private op table: one step of
    3 rows against the teacher-forced oracle layer by layer, the op log showing the provider on both runner calls
    and one launch, and graph replays whose device counters match the ledger's claims."""
    from k3_decode.executor import StackExecutor, load_stack
    from k3_decode.executor.audit import op_log_mismatches
    from k3_decode.kernels.providers import PROVIDERS
    from k3_decode.runtime.backend import ProviderRegistry
    from k3_decode.runtime.ledger import count_delta
    from k3_decode.runtime.optable import OpTable, load_op_table
    from tests.k3_decode.executor.helpers import decode_requests, oracle_failures

    torch.backends.cuda.matmul.allow_tf32 = False  # the oracle's FP32 GEMMs must be IEEE FP32
    table = load_op_table()
    kda = dataclasses.replace(table.parts["kda"], specialized=table.parts["kda"].specialized | {"o_proj"})
    registry = ProviderRegistry()
    for provider in PROVIDERS:
        registry.register(provider)
    config = load_stack("k3-kda-mla", tp, max_requests=8, max_context=1024, graph_batches=(3,))
    ex = StackExecutor.start(
        config,
        {"decode_backend": "latency_specialized"},
        device="cuda",
        registry=registry,
        table=OpTable({**table.parts, "kda": kda}),
        log=lambda line: None,
    )
    ex.state.fill_synthetic(range(8), 600, seed=0)
    start = ex.device_counts()
    assert oracle_failures(ex, decode_requests(ex, [0, 1, 2], seed=1), dtype=torch.float32) == []
    step = ex.ledger.records()[-1].step
    layer = config.kda_layers[0]
    paths = {(r.layer, r.op): r.path for r in ex.ledger.records() if r.step == step}
    assert paths[(layer, "o_proj")] == "specialized"
    calls = [(e.ops, e.record.launches) for e in ex.op_log if e.step == step and e.record.op == "cute-kda-o-proj"]
    assert calls == [(("o_proj",), 1), (("o_proj",), 0)] * len(config.kda_layers)  # kda_o_proj, attn_res_after
    assert op_log_mismatches(ex) == []

    name = ex.capture(3)
    for seed in range(3):
        ex.step(decode_requests(ex, [3, 4, 5], seed=10 + seed), mode="graph")
    torch.cuda.synchronize()
    counts = count_delta(start, ex.device_counts())
    assert counts is not None
    print(f"METRIC o_proj provider TP{tp}: device counts over an eager step, capture and 3 replays {counts}")
    assert ex.ledger.summary()["graphs"][name]["replays"] == 3
    ex.ledger.report_device_counts(counts)
    assert ex.ledger.check_execution(ex.kernel_catalog()) == []
    assert arrival_low_bits() == 0


# --- timing (measured, printed, asserted loosely) ---------------------------------------------------------------


@pytest.mark.parametrize("tp", [8, 16])
def test_timing_against_the_stock_pair_and_the_two_launch_path(tp: int):
    copy = copy_bandwidth()
    l2 = torch.cuda.get_device_properties(DEV).L2_cache_size
    hidden, k = K3.shard(tp).kda_o_proj
    weight_bytes = hidden * k * 2
    copies = max(2, math.ceil(3 * l2 / weight_bytes))  # each call streams its weight from HBM, not from L2
    weights = [(torch.randn(hidden, k, device=DEV) * 0.02).bfloat16() for _ in range(copies)]
    mix = after_weights()
    slower = []
    for batch in (1, 2, 4, 8, 16, 32, 64):  # the CUDA-core stream to 4 rows, tensor cores above
        # The lightest and the heaviest bank; every bank size from 32 rows, where the stock pair's AttnRes time,
        # which grows with the blocks it mixes, decides which layers the provider serves (providers.toml).
        banks = (1, 8) if batch < 32 else range(1, 9)
        for kind in (AttnResKind.from_tag(f"n{n}-add-norm") for n in banks):
            o = torch.randn(batch, k, device=DEV).bfloat16()
            buffers, _, _ = make_buffers(batch, kind.num_blocks, torch.Generator().manual_seed(batch))
            site = site_of(kind)
            attn_out = torch.empty(batch, hidden, dtype=torch.bfloat16, device=DEV)

            def fused(i: int, o=o, ws=weights, buffers=buffers, site=site, attn_out=attn_out) -> None:
                kda_o_proj_op.apply(o, ws[i % len(ws)], buffers, site, mix, EPS, attn_out=attn_out)

            def stock(i: int, o=o, ws=weights, buffers=buffers, site=site) -> None:
                partial = gemm.linear(o, ws[i % len(ws)])
                stock_attn_res.apply(buffers, site, partial, mix, EPS, "triton")

            def two_launches(i: int, o=o, ws=weights, buffers=buffers, site=site, attn_out=attn_out) -> None:
                kda_in_proj_op.linear(o, ws[i % len(ws)], attn_out)
                attn_res_op.apply(buffers, site, attn_out, mix, EPS)

            timed = {name: _graph_seconds_per_call(fn, 4 * copies) for name, fn in (
                ("fused", fused), ("stock", stock), ("two", two_launches)
            )}  # fmt: skip
            us = {name: t * 1e6 for name, t in timed.items()}
            fraction = weight_bytes / timed["fused"] / copy
            print(
                f"METRIC o_proj + AttnRes TP{tp} B{batch} {kind.tag} (graph replays, per call): fused "
                f"{us['fused']:.1f} us ({fraction:.1%} of copy {copy / 1e12:.2f} TB/s for W); stock cuBLAS + Triton "
                f"{us['stock']:.1f} us ({us['stock'] / us['fused']:.2f}x); weight stream + CuTe AttnRes "
                f"{us['two']:.1f} us ({us['two'] / us['fused']:.2f}x)"
            )
            served = batch <= max_rows("o_proj", "cute-kda-o-proj", tp, kind.num_blocks)[0]  # else printed only
            if served and timed["fused"] > SLOWER_LIMIT * min(timed["stock"], timed["two"]):
                slower.append(f"B{batch} {kind.tag}: {us['fused']:.1f} us")
    del weights
    assert not slower, f"TP{tp}: the fused launch is over {SLOWER_LIMIT}x slower than the faster pair: {slower}"
