"""The stock latent MoE on the CPU ("torch-cpu") at k3-mini dims against the oracles, op by op and whole."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from k3_decode.config import K3, K3_MINI
from k3_decode.reference import allreduce
from k3_decode.reference import moe as ref
from k3_decode.reference.mxfp import MxTensor
from k3_decode.reference.norms import rms_norm
from k3_decode.stock import moe as stock_moe
from k3_decode.stock.moe import MOE_OPS, StockMoeOps, StockRouting, as_reference, moe_op_info, rank_order_all_reduce
from k3_decode.stock.triton_moe.tiles import default_tiles, parse_tiles
from k3_decode.weights import DenseMlpWeights, MoeWeights, SyntheticWeights
from tests.k3_decode.stock.test_moe_helpers import assert_matches, failures, hidden, moe_weights, oracle_moe

DIMS = K3_MINI
MOE = DIMS.moe


@pytest.fixture(scope="module")
def tp1():
    return moe_weights(1)


# --- routing -------------------------------------------------------------------------------------------------


def tie_cases() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    e = MOE.num_experts
    zero = torch.zeros(e)
    staircase = torch.tensor([float(i // 4) for i in range(e)]).flip(0)  # groups of 4 equal logits
    straddle = torch.zeros(e)
    straddle[[1, 6, 9, 13]] = 2.0
    straddle[[3, 5, 11, 12, 15]] = 1.0  # 4 winners; then 5 tied for nothing
    straddle2 = torch.zeros(e)
    straddle2[[2, 14]] = 3.0
    straddle2[[4, 7, 8, 10]] = 1.0  # two winners, then 4 tied for 2 slots: 4 and 7 must win
    return {
        "all equal": (torch.zeros(2, e), zero),
        "staircase": (staircase.expand(2, e).clone(), zero),
        "straddle": (straddle[None], zero),
        "tie at the k-th slot": (straddle2[None], zero),
        "bias makes the tie": (torch.zeros(1, e), torch.tensor([0.5, 0.0] * (e // 2))),
    }


@pytest.mark.parametrize("case", list(tie_cases()))
def test_routing_ties_go_to_the_lower_id_exactly_as_the_oracle(case: str) -> None:
    logits, bias = tie_cases()[case]
    ids, weights = stock_moe._route_torch(logits.float(), bias.float(), MOE.top_k, MOE.routing_denominator_eps, 1.0)
    oracle = ref.route(logits.float(), bias.float(), top_k=MOE.top_k)
    assert torch.equal(ids.long(), oracle.ids)  # the slot order too: descending key, equal keys ascending id
    assert_matches("moe_route_weights.float32", weights, oracle.weights, rel_l2=None)


def test_tie_at_the_k_th_slot_picks_4_and_7() -> None:
    logits, bias = tie_cases()["tie at the k-th slot"]
    ids, _ = stock_moe._route_torch(logits, bias, MOE.top_k, MOE.routing_denominator_eps, 1.0)
    assert ids.tolist() == [[2, 14, 4, 7]]


@settings(max_examples=60, deadline=None)
@given(
    levels=st.lists(st.sampled_from([-2.0, -0.5, 0.0, 0.5, 3.0]), min_size=MOE.num_experts, max_size=MOE.num_experts),
    bias_levels=st.lists(st.sampled_from([0.0, 0.25]), min_size=MOE.num_experts, max_size=MOE.num_experts),
)
def test_routing_with_many_ties_matches_the_oracle(levels: list[float], bias_levels: list[float]) -> None:
    logits, bias = torch.tensor([levels]), torch.tensor(bias_levels)
    ids, weights = stock_moe._route_torch(logits, bias, MOE.top_k, MOE.routing_denominator_eps, 1.0)
    oracle = ref.route(logits, bias, top_k=MOE.top_k)
    assert torch.equal(ids.long(), oracle.ids)
    assert torch.allclose(weights, oracle.weights, rtol=1e-6, atol=0)


def test_routing_rejects_nan_keys() -> None:
    logits = torch.zeros(1, MOE.num_experts)
    logits[0, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        stock_moe._route_torch(logits, torch.zeros(MOE.num_experts), MOE.top_k, 1e-20, 1.0)


# --- op by op and whole, TP 1 / 2 / 8 ------------------------------------------------------------------------


@pytest.mark.parametrize("tp", [1, 2, 8])
@pytest.mark.parametrize("batch", [1, 7])
def test_each_op_and_the_whole_moe_match_the_oracle(tp: int, batch: int) -> None:
    weights = moe_weights(tp, rank=tp - 1)
    ops = StockMoeOps(DIMS, tp)
    ops.check_weights(weights)
    x = hidden(batch, seed=tp * 10 + batch)
    out = ops.moe(x, weights)
    lw = as_reference(weights)
    partial, trace = oracle_moe(x, lw, DIMS)

    assert torch.equal(out.routing.ids.long(), trace.routing.ids)
    assert_matches("moe_router_logits.float32", out.routing.logits, trace.routing.logits, rel_l2=None)
    assert_matches("moe_route_weights.float32", out.routing.weights, trace.routing.weights, rel_l2=None)
    assert_matches("moe_latent_down.bfloat16", out.latent, partial.latent)
    # Each op against the oracle fed the stock path's own (BF16) inputs, so errors do not carry over.
    experts = ref.routed_experts(out.latent.float(), trace.routing.ids, trace.routing.weights, lw.experts)
    assert_matches("moe_experts.bfloat16", out.routed, experts)
    assert_matches("moe_shared.bfloat16", out.shared, ref.gated_ffn(x, lw.shared))
    normed = rms_norm(out.routed, weights.latent_norm, DIMS.rms_norm_eps)
    assert_matches("moe_latent_tail.bfloat16", out.out, normed @ weights.latent_up.float().T + out.shared.float())
    assert_matches("moe.bfloat16", out.out, trace.out)
    assert out.out.dtype == out.routed.dtype == out.shared.dtype == out.latent.dtype == torch.bfloat16


@pytest.mark.parametrize("tp", [2, 4])
def test_rank_partials_all_reduced_match_the_tp_oracle(tp: int) -> None:
    """Every rank's stock partials, reduced by latent_tail, against the oracle's simulation of TP ranks."""
    x = hidden(5, seed=tp)
    outs = []
    for rank in range(tp):
        ops, weights = StockMoeOps(DIMS, tp), moe_weights(tp, rank)
        outs.append((ops.moe(x, weights), weights))
    routed = [o.routed for o, _ in outs]
    shared = [o.shared for o, _ in outs]
    out = StockMoeOps(DIMS, tp).latent_tail(routed, shared, outs[0][1])
    trace = ref.latent_moe(x, as_reference(moe_weights(1)), DIMS, tp=tp)
    assert_matches("moe.bfloat16", out, trace.out)
    for o, _ in outs:
        assert torch.equal(o.routing.ids.long(), trace.routing.ids)


def test_rank_order_all_reduce_has_the_two_shot_bits() -> None:
    g = torch.Generator().manual_seed(3)
    partials = [(torch.randn(4, 64, generator=g) * 10 ** (r - 2)).bfloat16() for r in range(4)]
    partials[1][0, :8] = -partials[0][0, :8]  # exact cancellations: -0.0 must come out +0.0
    got = rank_order_all_reduce(partials)
    allreduce.verify_two_shot([got] * 4, partials)
    assert not torch.equal(allreduce.bf16_bits(got), allreduce.bf16_bits(allreduce.naive_bf16_sum(partials)))


def test_latent_tail_without_the_norm_skips_it(tp1) -> None:
    dims = dataclasses.replace(DIMS, moe=dataclasses.replace(MOE, latent_norm=False))
    routed = hidden(3, seed=1)[:, : MOE.latent_size].contiguous()
    shared = hidden(3, seed=2)
    out = StockMoeOps(dims, 1).latent_tail(routed, shared, tp1)
    expected = routed.float() @ tp1.latent_up.float().T + shared.float()
    assert_matches("moe_latent_tail.bfloat16", out, expected)


# --- the tolerances catch plausible bugs -----------------------------------------------------------------------


def test_tolerances_reject_a_dropped_expert_a_bad_scale_and_zeros(tp1) -> None:
    ops = StockMoeOps(DIMS, 1)
    x = hidden(7, seed=5)
    out = ops.moe(x, tp1)
    lw = as_reference(tp1)
    expected = ref.routed_experts(out.latent.float(), out.routing.ids.long(), out.routing.weights, lw.experts)
    assert not failures("moe_experts.bfloat16", out.routed, expected)
    dropped = dataclasses.replace(out.routing, weights=out.routing.weights * torch.tensor([1.0, 1, 1, 0]))
    assert failures("moe_experts.bfloat16", ops.experts(out.latent, dropped, tp1), expected)
    scales = tp1.w13.scales.clone()
    scales[:, :, 1] += 1  # one 32-wide scale block of every w13 row doubled
    bad = dataclasses.replace(tp1, w13=MxTensor("mxfp4", tp1.w13.data, scales))
    assert failures("moe_experts.bfloat16", ops.experts(out.latent, out.routing, bad), expected)
    assert failures("moe_experts.bfloat16", torch.zeros_like(out.routed), expected)


# --- ledger, launches, data files --------------------------------------------------------------------------------


def test_every_call_is_a_ledger_record(tp1) -> None:
    seen = []
    ops = StockMoeOps(DIMS, 1, listener=seen.append)
    ops.moe(hidden(3), tp1)
    dense = SyntheticWeights(DIMS, 1, 0).mlp(0)
    assert isinstance(dense, DenseMlpWeights)
    ops.dense(hidden(3), dense)
    assert [r.op for r in ops.records] == [*MOE_OPS, "dense"]
    assert seen == ops.records
    assert {r.implementation for r in ops.records} == {"torch-cpu"}
    assert {r.launches for r in ops.records} == {0} and {r.batch for r in ops.records} == {3}


def test_launch_plan_is_thirteen_per_moe_and_counts_expert_chunks() -> None:
    ops = StockMoeOps(DIMS, 1)
    assert ops.expected_launches(batch=1) == 13
    assert sum(moe_op_info(op, "cuda").launches for op in MOE_OPS) == 13
    pairs_per_chunk = stock_moe.MAX_PAIRS // MOE.top_k
    assert ops.expected_launches(batch=pairs_per_chunk) == 13
    assert ops.expected_launches(batch=pairs_per_chunk + 1) == 18
    info = moe_op_info("experts", "cuda")
    assert info.kernels == ("k3_moe_align", "k3_moe_fc1", "k3_moe_situ", "k3_moe_fc2", "k3_moe_sum")
    assert moe_op_info("experts", "cpu").implementation == "torch-cpu"
    with pytest.raises(ValueError, match=r"unknown stock op 'router' in moe_ops\.toml"):
        moe_op_info("router", "cuda")


def test_moe_op_kernel_names_exist_in_the_triton_modules() -> None:
    pytest.importorskip("triton")
    from k3_decode.stock.triton_moe import elementwise, experts, routing

    defined = {n for m in (routing, experts, elementwise) for n in vars(m)}
    for op in [*MOE_OPS, "dense"]:
        for name in moe_op_info(op, "cuda").kernels:
            assert name in defined, (op, name)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"block_m": 8}, "block_m = 8 must be a power of two >= 16"),
        ({"block_m": 32}, "the expert kernels take 16 tokens per block"),
        ({"fc1_block_k": 48}, "fc1_block_k = 48 must be a power of two >= 32"),
        ({"fc2_block_k": 16}, "fc2_block_k = 16 must be a power of two >= 32"),
        ({"fc2_warps": 0}, "fc2_warps = 0 must be a positive integer"),
        ({"fc1_splits": 0}, "fc1_splits = 0 must be a positive integer"),
        ({"situ_block_n": 96}, "situ_block_n = 96 must be a power of two"),
    ],
)
def test_bad_tile_rows_are_rejected(row: dict, message: str) -> None:
    good = dict(
        max_batch=8, block_m=16, fc1_block_n=32, fc1_block_k=512, fc1_warps=4, fc1_stages=1, fc1_splits=2,
        fc2_block_n=64, fc2_block_k=128, fc2_warps=4, fc2_stages=1, fc2_splits=1, situ_block_n=512, sum_block_n=512,
    )  # fmt: skip
    with pytest.raises(ValueError, match=message):
        parse_tiles({"experts": [{**good, **row}]})
    with pytest.raises(ValueError, match="strictly increasing max_batch"):
        parse_tiles({"experts": [good, good]})
    with pytest.raises(ValueError, match="missing or unknown key"):
        parse_tiles({"experts": [{**good, "tile": 1}]})
    assert parse_tiles({"experts": [good]}).for_batch(8).block_m == 16
    with pytest.raises(ValueError, match=r"no tiles\.toml row covers batch 9"):
        parse_tiles({"experts": [good]}).for_batch(9)


def test_the_shipped_tiles_pick_a_row_per_batch() -> None:
    """Each row covers the batches from the previous row's bound + 1 to its own (inclusive), and every K3 shape
    divides the chosen steps (the kernels' EVEN_K path: no K masks in the main loop at real shapes); small batches
    split FC1's K loop, large ones do not (tiles.toml says why)."""
    table = default_tiles()
    low = 1
    for row in table.rows[:-1]:
        assert table.for_batch(low) == table.for_batch(row.max_batch) == row
        assert table.for_batch(row.max_batch + 1) != row
        low = row.max_batch + 1
    assert table.for_batch(64) == table.for_batch(4096) == table.rows[-1]
    assert table.for_batch(1).fc1_splits > 1 and table.for_batch(64).fc1_splits == 1
    for tp in (8, 16):
        rows, lat = K3.shard(tp).expert_w13
        for t in table.rows:
            assert lat % t.fc1_block_k == 0 and (rows // 2) % t.fc2_block_k == 0, (tp, t)
            assert (rows // 2) % t.fc1_block_n == 0 and lat % t.fc2_block_n == 0, (tp, t)


# --- bad input: one line naming the problem and the fix --------------------------------------------------------


def test_bad_weights_are_rejected_at_load(tp1) -> None:
    ops = StockMoeOps(DIMS, 1)
    subset = SyntheticWeights(DIMS, 1, 0).mlp(1, experts=[0, 1, 2])
    assert isinstance(subset, MoeWeights)
    with pytest.raises(ValueError, match="all 16 experts in id order; load the layer with experts=None"):
        ops.check_weights(subset)
    scales = tp1.w2.scales.clone()
    scales[0, 0, 0] = 255
    with pytest.raises(ValueError, match=r"scale byte 255 .* fix the checkpoint"):
        ops.check_weights(dataclasses.replace(tp1, w2=MxTensor("mxfp4", tp1.w2.data, scales)))
    with pytest.raises(ValueError, match=r"MoE router is torch\.float32, .* load with dtype=torch\.bfloat16"):
        ops.check_weights(dataclasses.replace(tp1, router=tp1.router.float()))
    with pytest.raises(ValueError, match=r"MoE shared\.gate_up is \(512, 256\), want \(256, 256\) at TP=2; load this"):
        StockMoeOps(DIMS, 2).check_weights(tp1)
    with pytest.raises(ValueError, match="router_bias must be FP32"):
        ops.check_weights(dataclasses.replace(tp1, router_bias=tp1.router_bias.bfloat16()))


def test_bad_inputs_name_the_problem(tp1, monkeypatch) -> None:
    ops = StockMoeOps(DIMS, 1)
    with pytest.raises(ValueError, match=r"route: hidden must be BF16 \[B, 256\], got torch.float32"):
        ops.route(hidden(2).float(), tp1)
    with pytest.raises(ValueError, match=r"hidden must be BF16 \[B, 256\]"):
        ops.shared(hidden(2)[:, :128], tp1)
    routing = ops.route(hidden(2), tp1)
    with pytest.raises(ValueError, match=r"routing ids \(2, 4\) .* are not \[B=3, k=4\]"):
        ops.experts(hidden(3)[:, :128].contiguous(), routing, tp1)
    with pytest.raises(ValueError, match="are not \\[B, 128\\] and \\[B, 256\\]"):
        ops.latent_tail(hidden(2)[:, :128].contiguous(), hidden(3), tp1)
    with pytest.raises(ValueError, match="unknown stock implementation 'cuda'"):
        StockMoeOps(DIMS, 1, implementation="cuda")  # type: ignore[arg-type]
    monkeypatch.setattr(stock_moe, "_kernels_interpreted", lambda: False)
    with pytest.raises(ValueError, match=r"needs a CUDA device .* use 'torch-cpu' on the CPU"):
        StockMoeOps(DIMS, 1, implementation="triton")
    groups = dataclasses.replace(DIMS, moe=dataclasses.replace(MOE, num_expert_group=2))
    with pytest.raises(ValueError, match="one-group sigmoid router"):
        StockMoeOps(groups, 1)
    with pytest.raises(ValueError, match="TP=3 is not supported"):
        StockMoeOps(DIMS, 3)


def test_oracle_container_dequantizes_exactly(tp1) -> None:
    lw = as_reference(tp1, torch.bfloat16)
    assert torch.equal(lw.experts.gate_up.float(), tp1.w13.dequantize())
    assert isinstance(StockRouting(torch.zeros(1), torch.zeros(1), torch.zeros(1)), StockRouting)


# --- the expert kernels' inline PTX, emulated -------------------------------------------------------------------


def _run_decode_ptx(text: str, regs: dict[str, int]) -> dict[str, int]:
    """Executes the PTX block of experts._DECODE_PTX on 32-bit integers: prmt.b32, and.b32, mul.lo.u32 and
    mul.rn.bf16x2 (exact here: the products are representable), as the PTX ISA defines them."""
    import struct

    def bf16(bits: int) -> float:
        return struct.unpack("<f", struct.pack("<I", (bits & 0xFFFF) << 16))[0]

    def to_bf16(value: float) -> int:
        bits = struct.unpack("<I", struct.pack("<f", value))[0]
        assert bits & 0xFFFF == 0, f"{value} is not a BF16 value: the emulated multiply would have to round"
        return bits >> 16

    def val(tok: str) -> int:
        tok = tok.strip()
        return regs[tok] if tok in regs else int(tok, 0)

    for line in text.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        dst, *src = [t.strip() for t in rest.split(",")]
        a = [val(t) for t in src]
        if op == "prmt.b32":
            pool = (a[1] << 32) | a[0]
            out = 0
            for i in range(4):
                sel = (a[2] >> (4 * i)) & 0xF
                byte = (pool >> (8 * (sel & 7))) & 0xFF
                if sel & 8:  # sign-replicate mode
                    byte = 0xFF if byte & 0x80 else 0
                out |= byte << (8 * i)
        elif op == "and.b32":
            out = a[0] & a[1]
        elif op == "mul.lo.u32":
            out = (a[0] * a[1]) & 0xFFFFFFFF
        elif op == "mul.rn.bf16x2":
            lo = to_bf16(bf16(a[0]) * bf16(a[1]))
            hi = to_bf16(bf16(a[0] >> 16) * bf16(a[1] >> 16))
            out = lo | (hi << 16)
        else:
            raise AssertionError(f"the emulator does not know {op}")
        regs[dst] = out & 0xFFFFFFFF
    return regs


def test_the_inline_ptx_decodes_every_byte_like_the_reference() -> None:
    """The GPU's decode (experts._DECODE_PTX), emulated: for every byte value in every byte position of the packed
    word and scale bytes from MIN_EXACT_SCALE_BYTE to MAX_SCALE_BYTE, its four BF16 pairs are the even and odd
    elements of the 4 bytes times 2^-WEIGHT_SHIFT, exactly as the reference codec dequantizes them. (That Triton
    hands the asm byte i of a pack of 4 as byte i of $4 is checked on the GPU, test_moe_gpu.py.)"""
    pytest.importorskip("triton")
    import struct

    from k3_decode.stock.triton_moe import experts
    from k3_decode.stock.triton_moe.limits import MAX_SCALE_BYTE, MIN_EXACT_SCALE_BYTE, WEIGHT_SHIFT

    text = str(experts._DECODE_PTX.value)
    g = torch.Generator().manual_seed(3)
    words = torch.stack([torch.roll(torch.arange(256), 37 * pos) for pos in range(4)], dim=1)  # every byte value
    words[:128] = torch.randint(0, 256, (128, 4), generator=g)  # at every position, and random words

    def factor(scale: int) -> int:
        bits = (scale - (WEIGHT_SHIFT + 1) + 127) << 7
        return bits | (bits << 16)

    scales = (MIN_EXACT_SCALE_BYTE, 90, 121, 127, 150, MAX_SCALE_BYTE)
    for lo_scale, hi_scale in zip(scales, scales[::-1], strict=True):
        # $5 scales the elements of bytes 0 and 1, $6 those of bytes 2 and 3 (one scale block in practice; two here
        # so that a pair multiplied by the wrong register shows)
        padded = torch.zeros(256, 16, dtype=torch.uint8)  # the 4 bytes, padded to one 32-element block
        padded[:, :4] = words.to(torch.uint8)
        expected = [
            MxTensor("mxfp4", padded, torch.full((256, 1), sc, dtype=torch.uint8)).dequantize(torch.float64)
            for sc in (lo_scale, hi_scale)
        ]
        for row in range(256):
            q = sum(int(b) << (8 * i) for i, b in enumerate(words[row].tolist()))
            regs = _run_decode_ptx(text, {"$4": q, "$5": factor(lo_scale), "$6": factor(hi_scale)})
            got = []
            for reg in ("$0", "$1", "$2", "$3"):
                for half in (regs[reg] & 0xFFFF, regs[reg] >> 16):
                    got.append(struct.unpack("<f", struct.pack("<I", half << 16))[0] * 2.0**WEIGHT_SHIFT)
            lo, hi = expected[0][row, :8].tolist(), expected[1][row, :8].tolist()
            want_even = [lo[0], lo[2], hi[4], hi[6]]
            want_odd = [lo[1], lo[3], hi[5], hi[7]]
            assert got[:4] == want_even and got[4:] == want_odd, (lo_scale, row, got, lo, hi)
