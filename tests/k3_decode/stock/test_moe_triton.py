"""The stock MoE's Triton kernels under Triton's CPU interpreter, at k3-mini dims (the same kernels run compiled on
the GPU in test_moe_gpu.py).

Triton decides at import whether its own library functions (tl.sum, tl.sigmoid, ...) are interpreted, so these
tests need TRITON_INTERPRET=1 before anything imports triton. A plain test run skips them here and
test_moe_triton_launch.py runs this module in a fresh process with the variable set.
"""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace

import pytest
import torch

from k3_decode.config import K3_MINI
from k3_decode.reference import moe as ref
from k3_decode.reference.mxfp import MxTensor
from k3_decode.reference.norms import rms_norm
from k3_decode.stock import moe as stock_moe
from k3_decode.stock.moe import StockMoeOps, StockRouting, as_reference
from k3_decode.stock.triton_moe.limits import MAX_SCALE_BYTE, MIN_EXACT_SCALE_BYTE, WEIGHT_SHIFT
from k3_decode.stock.triton_moe.tiles import default_tiles
from tests.k3_decode.stock.test_moe_helpers import assert_matches, hidden, moe_weights, oracle_moe

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(
    not INTERPRETED, reason="needs TRITON_INTERPRET=1 from process start; test_moe_triton_launch.py runs it so"
)
triton = pytest.importorskip("triton")
tl = triton.language
from k3_decode.stock.triton_moe.common import bf16_rne  # noqa: E402 - after the importorskip of triton

DIMS = K3_MINI
MOE = DIMS.moe
# Wide tiles keep the interpreter's program count (and so its run time) low at k3-mini sizes; 64-wide K steps give
# FC1 two steps over the 128-wide latent and FC2 a ragged step at TP8 (K = 32, the EVEN_K = False masks).
FAST = dataclasses.replace(
    default_tiles().for_batch(1), max_batch=10**6, fc1_block_n=32, fc1_block_k=64, fc2_block_n=64, fc2_block_k=64
)


@pytest.fixture(scope="module")
def k():
    from triton.runtime.interpreter import InterpretedFunction

    from k3_decode.stock.triton_moe import common, elementwise, experts, routing

    assert isinstance(routing.k3_moe_route, InterpretedFunction), "triton was imported before TRITON_INTERPRET=1"
    return SimpleNamespace(common=common, routing=routing, experts=experts, elementwise=elementwise)


@triton.jit
def _bf16_rne_kernel(x_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, bf16_rne(tl.load(x_ptr + offs)))


def test_bf16_rounding_is_round_to_nearest_even(k) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, generator=g) * torch.logspace(-40, 38, 1024)
    ties = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 2**-130 * 1.5, 3.4e38, float("inf"), -0.0])
    x[: len(ties)] = ties
    out = torch.empty(1024, dtype=torch.bfloat16)
    _bf16_rne_kernel[(1,)](x, out, 1024)
    assert torch.equal(out.view(torch.int16), x.bfloat16().view(torch.int16))
    nan = torch.full((1024,), float("nan"))
    _bf16_rne_kernel[(1,)](nan, out, 1024)
    assert bool(out.isnan().all())


# --- routing and grouping --------------------------------------------------------------------------------------


def test_route_kernel_matches_the_oracle_with_ties(k) -> None:
    g = torch.Generator().manual_seed(1)
    levels = torch.tensor([-1.0, 0.0, 0.5, 2.0])
    logits = levels[torch.randint(0, 4, (9, MOE.num_experts), generator=g)]  # many exact ties
    logits[0] = 0.0
    bias = torch.tensor([0.0, 0.25])[torch.randint(0, 2, (MOE.num_experts,), generator=g)]
    ids, weights = k.routing.route(logits, bias, MOE.top_k, MOE.routing_denominator_eps, 1.0)
    oracle = ref.route(logits, bias, top_k=MOE.top_k)
    assert ids.dtype == torch.int32 and torch.equal(ids.long(), oracle.ids)
    assert_matches("moe_route_weights.float32", weights, oracle.weights, rel_l2=None)
    assert ids[0].tolist()[:2] == sorted(ids[0].tolist()[:2])


def test_route_kernel_poisons_a_nan_token_but_keeps_ids_in_range(k) -> None:
    logits = torch.zeros(2, MOE.num_experts)
    logits[1, :] = float("nan")
    ids, weights = k.routing.route(logits, torch.zeros(MOE.num_experts), MOE.top_k, 1e-20, 1.0)
    assert bool(((ids >= 0) & (ids < MOE.num_experts)).all())
    assert bool(weights[1].isnan().all()) and bool(weights[0].isfinite().all())


@pytest.mark.parametrize("pairwise", [True, False])
@pytest.mark.parametrize(("batch", "block_m"), [(1, 16), (5, 16), (13, 16), (13, 32)])
def test_align_lays_out_every_pair_once_by_expert(k, batch: int, block_m: int, pairwise: bool) -> None:
    g = torch.Generator().manual_seed(batch)
    ids = torch.stack([torch.randperm(MOE.num_experts, generator=g)[: MOE.top_k] for _ in range(batch)])
    ids[-1] = ids[0]  # a repeated expert set, so some experts get several pairs
    ids = ids.to(torch.int32)
    group = k.routing.align(ids, MOE.num_experts, block_m, pairwise=pairwise)
    pairs = batch * MOE.top_k
    flat = ids.flatten().tolist()
    layout = group.sorted_pairs.view(-1, block_m).tolist()
    used = int(group.num_blocks[0])
    counts = torch.bincount(ids.flatten().long(), minlength=MOE.num_experts)
    assert used == int(((counts + block_m - 1) // block_m).sum())
    assert group.block_expert[used:].tolist() == [-1] * (group.max_blocks - used)
    seen = []
    for b, row in enumerate(layout[:used]):
        e = int(group.block_expert[b])
        real = [p for p in row if p != pairs]
        assert real and all(flat[p] == e for p in real), (b, e, row)
        assert row == real + [pairs] * (block_m - len(real))  # padding only at a block's end
        seen += real
    assert sorted(seen) == list(range(pairs))
    for e in range(MOE.num_experts):  # each expert's pairs in ascending pair order, in consecutive blocks
        mine = [p for p in seen if flat[p] == e]
        assert mine == sorted(mine)
    assert all(p == pairs for row in layout[used:] for p in row)
    other = k.routing.align(ids, MOE.num_experts, block_m, pairwise=not pairwise)  # both ways, one layout
    assert torch.equal(other.sorted_pairs, group.sorted_pairs) and torch.equal(other.block_expert, group.block_expert)
    assert int(other.num_blocks[0]) == used
    with pytest.raises(ValueError, match="split the batch"):
        k.routing.align(torch.zeros(1025, 4, dtype=torch.int32), MOE.num_experts, 16)


# --- experts -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("tp", "batch"), [(1, 3), (8, 5)])
def test_experts_kernel_matches_torch_and_the_oracle(k, tp: int, batch: int) -> None:
    """TP8 of k3-mini pads the intermediate 16 -> 32: K = 32 is shorter than one K step of the FC2 tile."""
    weights = moe_weights(tp, rank=tp - 1)
    x = hidden(batch, seed=tp)
    cpu = StockMoeOps(DIMS, tp, implementation="torch-cpu")
    routing = cpu.route(x, weights)
    latent = cpu.latent_down(x, weights)
    out = k.experts.experts(
        latent, routing.ids, routing.weights, weights.w13, weights.w2, beta=4.0, beta_lin=25.0, tiles=FAST
    )
    mirror = cpu.experts(latent, routing, weights)
    # Same rounding points: only FP32 summation order differs, so nearly every element has the same BF16 bits.
    assert float((out.float() - mirror.float()).abs().max()) <= 2 * 2**-8 * float(mirror.float().abs().max())
    assert float((out != mirror).float().mean()) < 0.02
    oracle = ref.routed_experts(latent.float(), routing.ids.long(), routing.weights, as_reference(weights).experts)
    assert_matches("moe_experts.bfloat16", out, oracle)


def test_experts_kernel_is_exact_over_the_bf16_activation_range(k) -> None:
    """The activations enter the MMA as BF16 (exact products, FP32 sums): latent rows with peaks 1e4 and 7e4 (the
    previous FP16 kernel returned NaN at or above 65520) or scaled down to 1e-3 (its SiTU output ~1e-6) give what
    the torch mirror gives, and an all-zero row gives zeros."""
    weights = moe_weights(1)
    latent = hidden(5, seed=9)[:, : MOE.latent_size].float()
    latent[0] *= 1e4 / float(latent[0].abs().max())
    latent[2] *= 1e-3
    latent[3] = 0.0
    latent[4, 7] = 7e4
    latent = latent.bfloat16()
    ids = torch.tensor([[0, 3, 5, 9]] * 5, dtype=torch.int32)
    w = torch.full((5, 4), 0.25)
    out = k.experts.experts(latent, ids, w, weights.w13, weights.w2, beta=4.0, beta_lin=25.0, tiles=FAST)
    mirror = StockMoeOps(DIMS, 1, implementation="torch-cpu").experts(latent, StockRouting(w, ids, w), weights)
    assert bool(out.isfinite().all())
    for row in range(5):
        peak = float(mirror[row].float().abs().max())
        assert float((out[row].float() - mirror[row].float()).abs().max()) <= 2**-8 * peak, row
    assert bool((out[3] == 0).all()) and 0 < float(out[2].float().abs().max()) < 1e-3


def test_experts_kernel_masks_ragged_tiles(k) -> None:
    """Shapes that no tile divides: latent 96 and intermediate 96 against 64-wide column tiles and K steps, so FC1
    and FC2 each end on a half-empty column tile and a half-empty K step (the EVEN_K = False path); expert ids span
    three experts with 2, 3 and 3 pairs. The kernels match the torch mirror (same rounding points) element for
    element up to FP32 summation order."""
    g = torch.Generator().manual_seed(11)
    experts_n, lat, inter = 3, 96, 96

    def mx(rows: int, cols: int) -> MxTensor:
        data = torch.randint(0, 256, (experts_n, rows, cols // 2), dtype=torch.uint8, generator=g)
        scales = torch.randint(116, 124, (experts_n, rows, cols // 32), dtype=torch.uint8, generator=g)
        return MxTensor("mxfp4", data, scales)

    w13, w2 = mx(2 * inter, lat), mx(lat, inter)
    latent = torch.randn(4, lat, generator=g).bfloat16()
    ids = torch.tensor([[0, 1], [1, 2], [2, 2], [2, 1]], dtype=torch.int32)
    ids[2] = torch.tensor([2, 0])
    route_w = torch.rand(4, 2, generator=g) + 0.1
    tiles = dataclasses.replace(FAST, fc1_block_n=64, fc1_block_k=64, fc2_block_n=64, fc2_block_k=64)
    out = k.experts.experts(latent, ids, route_w, w13, w2, beta=4.0, beta_lin=25.0, tiles=tiles)
    mirror = stock_moe._experts_torch(latent, ids, route_w, w13, w2, DIMS)
    peak = float(mirror.float().abs().max())
    assert float((out.float() - mirror.float()).abs().max()) <= 2 * 2**-8 * peak
    assert float((out != mirror).float().mean()) < 0.02
    full = dataclasses.replace(tiles, fc1_block_n=128, fc1_block_k=128, fc2_block_n=128, fc2_block_k=128)
    again = k.experts.experts(latent, ids, route_w, w13, w2, beta=4.0, beta_lin=25.0, tiles=full)
    assert float((again.float() - mirror.float()).abs().max()) <= 2 * 2**-8 * peak  # one tile, one K step
    for splits in (1, 2, 3, 7):  # K splits of 3 steps of 32: 1 (3 steps), 2 and 3 (1 + 1 + 1), 7 (also 3: even only)
        split = dataclasses.replace(tiles, fc1_block_k=32, fc1_splits=splits, fc2_block_k=32, fc2_splits=splits)
        out = k.experts.experts(latent, ids, route_w, w13, w2, beta=4.0, beta_lin=25.0, tiles=split)
        assert float((out.float() - mirror.float()).abs().max()) <= 2 * 2**-8 * peak, splits
        assert float((out != mirror).float().mean()) < 0.02, splits


def test_experts_split_a_batch_above_the_pair_limit(k, monkeypatch) -> None:
    weights = moe_weights(2, 1)
    x = hidden(5, seed=4)
    cpu = StockMoeOps(DIMS, 2, implementation="torch-cpu")
    routing, latent = cpu.route(x, weights), cpu.latent_down(x, weights)
    monkeypatch.setattr(k.experts, "MAX_PAIRS", 2 * MOE.top_k)  # chunks of 2 tokens: 3 chunks
    out = k.experts.experts(
        latent, routing.ids, routing.weights, weights.w13, weights.w2, beta=4.0, beta_lin=25.0, tiles=FAST
    )
    oracle = ref.routed_experts(latent.float(), routing.ids.long(), routing.weights, as_reference(weights).experts)
    assert_matches("moe_experts.bfloat16", out, oracle)


def test_fp4_decode_covers_every_code_and_scale_edge(k) -> None:
    """FC2's FP32 outputs (no BF16 rounding) for weight rows holding all 16 E2M1 codes, in four groups of rows whose
    scale bytes span 54..56 (the smallest whose weights stay normal BF16 numbers in the MMA), 118..122, 160..180
    (the kernels' limit) and one block 2^30 below its row's largest (the previous kernel dropped such a block; now it
    counts). Token b is non-zero only in scale block b. Two 64-wide K steps cover K = 128."""
    latent, inter = 64, 128
    codes = torch.arange(16, dtype=torch.uint8).repeat(latent, inter // 16)
    codes = codes ^ (torch.arange(latent, dtype=torch.uint8)[:, None] % 16)  # every row a different code order
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    groups = [[54, 55, 56, 54], [120, 119, 122, 118], [180, 170, 160, 180], [130, 100, 130, 130]]
    assert max(map(max, groups)) == MAX_SCALE_BYTE and min(map(min, groups)) == MIN_EXACT_SCALE_BYTE
    scales = torch.tensor(groups, dtype=torch.uint8).repeat_interleave(16, dim=0)
    w2 = MxTensor("mxfp4", packed[None].contiguous(), scales[None].contiguous())
    g = torch.Generator().manual_seed(6)
    a = torch.zeros(4, inter, dtype=torch.float64)
    for b, size in enumerate([2.0**14, 1.0, 2.0**-10, 4.0]):  # BF16-exact values: multiples of size / 8
        a[b, 32 * b : 32 * (b + 1)] = torch.randint(-8, 9, (32,), generator=g).double() / 8 * size
    a = a.bfloat16()
    route_w = torch.tensor([1.0, 0.5, 2.0, 0.25])
    out = torch.full((4, latent), float("nan"))
    group = k.routing.align(torch.zeros(4, 1, dtype=torch.int32), 1, 16)
    k.experts.k3_moe_fc2[(group.max_blocks, 1)](
        a, w2.data, w2.scales, group.sorted_pairs, group.block_expert, route_w, out, 4, latent, inter, a.stride(0),
        w2.data.stride(0), w2.data.stride(1), w2.scales.stride(0), w2.scales.stride(1), 0, out.stride(0),
        BM=16, BN=64, BK=64, STEPS=2, SHIFT=WEIGHT_SHIFT, EVEN_K=True, ASM=False,
    )  # fmt: skip
    expected = (a.double() @ w2.dequantize(torch.float64)[0].T) * route_w.double()[:, None]
    for b in range(4):
        for grp in range(4):
            rows = slice(16 * grp, 16 * (grp + 1))
            err = (out[b, rows].double() - expected[b, rows]).abs().max() / expected[b, rows].abs().max()
            assert float(err) < 1e-6, (b, grp, float(err))
    assert float(expected[0, :16].abs().max()) < 1e-15 < 1e7 < float(expected[2, 32:48].abs().max())


# --- elementwise and the whole provider ---------------------------------------------------------------------------


def test_rms_norm_and_situ_kernels_match_the_oracle(k) -> None:
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(3, MOE.latent_size, generator=g) * 3).bfloat16()
    w = (1 + 0.1 * torch.randn(MOE.latent_size, generator=g)).bfloat16()
    assert_matches("moe_latent_norm.bfloat16", k.elementwise.rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5), rel_l2=None)
    gate_up = (torch.randn(4, 96, generator=g) * 20).bfloat16()
    out = k.elementwise.situ_and_mul(gate_up, 4.0, 25.0, block=16)
    assert_matches("situ_and_mul.bfloat16", out, ref.situ_and_mul(gate_up.double()), rel_l2=None)
    small = (gate_up.float() / 4).bfloat16()
    out = k.elementwise.situ_and_mul(small, 4.0, None, block=16)
    assert_matches("situ_and_mul.bfloat16", out, ref.situ_and_mul(small.double(), beta_lin=None), rel_l2=None)
    tiny = (gate_up.float() * 1e-6).bfloat16()  # tanh near 0 must keep its relative precision (no 1 - exp cancel)
    out = k.elementwise.situ_and_mul(tiny, 4.0, 25.0, block=16).double()
    expected = ref.situ_and_mul(tiny.double())
    peak = expected.abs().max()
    assert_matches("situ_and_mul.bfloat16", out / peak, expected / peak, rel_l2=None)
    with pytest.raises(ValueError, match="laid out"):
        k.elementwise.situ_and_mul(gate_up[:, :5], 4.0, 25.0)


def test_triton_provider_matches_the_oracle_and_records_its_kernels(k) -> None:
    tp, batch = 2, 4
    weights = moe_weights(tp, 0)
    ops = StockMoeOps(DIMS, tp, implementation="triton", tiles=dataclasses.replace(default_tiles(), rows=(FAST,)))
    x = hidden(batch, seed=8)
    out = ops.moe(x, weights)
    _, trace = oracle_moe(x, as_reference(weights), DIMS)
    assert torch.equal(out.routing.ids.long(), trace.routing.ids)
    assert_matches("moe.bfloat16", out.out, trace.out)
    assert [r.implementation for r in ops.records] == [
        "cublas+triton",
        "cublas",
        "triton",
        "cublas+triton",
        "triton+cublas",
    ]
    assert sum(r.launches for r in ops.records) == 13
