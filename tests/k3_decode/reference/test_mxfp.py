"""MXFP4 / MXFP8 codecs: hand-computed codes, layout, exactness, error bounds and special values."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from k3_decode.reference.mxfp import (
    BLOCK,
    MxTensor,
    dequantize_mxfp4,
    dequantize_mxfp8,
    e2m1_decode,
    e2m1_encode,
    e8m0_to_float32,
    exp2_exact,
    pack_fp4,
    quantize_mxfp4,
    quantize_mxfp8,
    unpack_fp4,
)

HYP = settings(max_examples=150, deadline=None)


def block(*head: float, n: int = BLOCK) -> torch.Tensor:
    """A float32 block whose first elements are `head`, zero elsewhere."""
    x = torch.zeros(n)
    x[: len(head)] = torch.tensor(head)
    return x


# --- hand-computed codes -----------------------------------------------------------------------------------------


def test_hand_block_scale_one() -> None:
    # amax 6: floor(log2 6) = 2, minus emax(E2M1) = 2 -> exponent 0 -> scale byte 127.
    # 6 -> 0b0111, -0.5 -> 0b1001, 1.5 -> 0b0011; byte 0 = low 0x7 | high 0x9 = 0x97, byte 1 = 0x03.
    q = quantize_mxfp4(block(6.0, -0.5, 1.5))
    assert q.scales.tolist() == [127]
    assert q.data.tolist() == [0x97, 0x03] + [0] * 14
    assert q.dequantize()[:4].tolist() == [6.0, -0.5, 1.5, 0.0]


def test_hand_block_with_scale() -> None:
    # amax 0.75: floor(log2 0.75) = -1 -> exponent -3 (X = 1/8) -> byte 124.
    # y = [6, -1.5, 4, 0.1875 * 8 = 1.5]: codes 7, 0b1011, 6, 3 -> bytes 0xB7, 0x36.
    q = quantize_mxfp4(block(0.75, -0.1875, 0.5, 0.1875))
    assert q.scales.tolist() == [124]
    assert q.data[:3].tolist() == [0xB7, 0x36, 0x00]


def test_e2m1_ties_to_even_and_saturation() -> None:
    # Midpoints go to the neighbour with the even code (mantissa bit 0); above 6 saturates to code 7.
    y = [0.25, 0.26, 0.75, 1.25, 1.26, 1.75, 2.5, 2.51, 3.5, 5.0, 5.01, 6.0, 7.9, 1e30]
    want = [0, 1, 2, 2, 3, 4, 4, 5, 6, 6, 7, 7, 7, 7]
    assert e2m1_encode(torch.tensor(y)).tolist() == want
    assert e2m1_encode(-torch.tensor(y)).tolist() == [c | 8 for c in want]


def test_e2m1_decode_all_codes() -> None:
    mags = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    got = e2m1_decode(torch.arange(16, dtype=torch.uint8))
    assert got.tolist() == mags + [-m for m in mags]
    assert torch.signbit(got[8])  # code 0b1000 is -0


def test_floor_rule_saturates_block_max_ceil_rule_does_not() -> None:
    # amax 7: floor rule gives exponent 0, so 7 clamps to 6; ceil rule picks X = 2 and 7/2 = 3.5 -> 4 (even).
    floor_q = quantize_mxfp4(block(7.0, 1.0))
    assert floor_q.scales.tolist() == [127]
    assert floor_q.dequantize()[:2].tolist() == [6.0, 1.0]
    ceil_q = quantize_mxfp4(block(7.0, 1.0), scale_rule="ceil")
    assert ceil_q.scales.tolist() == [128]
    assert ceil_q.dequantize()[:2].tolist() == [8.0, 1.0]
    # amax exactly 6 * 2^k needs no headroom under either rule.
    assert quantize_mxfp4(block(12.0), scale_rule="ceil").scales.tolist() == [128]
    assert quantize_mxfp4(block(12.0)).scales.tolist() == [128]


def test_hand_mxfp8() -> None:
    # amax 3: floor(log2 3) = 1, minus emax(E4M3) = 8 -> exponent -7 -> byte 120; y = 3 * 128 = 384 = 1.5 * 2^8
    # -> E4M3 0 1111 100 = 0x7C. -0.01 * 128 = -1.28 -> nearest -1.25 = 1 0111 010 = 0xBA.
    q = quantize_mxfp8(block(3.0, -0.01))
    assert q.scales.tolist() == [120]
    assert q.data.view(torch.uint8)[:3].tolist() == [0x7C, 0xBA, 0x00]
    assert q.dequantize()[:2].tolist() == [3.0, -1.25 / 128]
    # Saturation: 3.9 * 128 = 499.2 clamps to 448 (0x7E) -> 3.5; never the NaN code 0x7F.
    sat = quantize_mxfp8(block(3.9))
    assert sat.data.view(torch.uint8)[0].item() == 0x7E
    assert sat.dequantize()[0].item() == 3.5
    # The ceil rule scales 3.9 by 2^6 instead: 249.6 -> 256 (E4M3 spacing is 16 in [128, 256)).
    ceil_q = quantize_mxfp8(block(3.9), scale_rule="ceil")
    assert ceil_q.scales.tolist() == [121]
    assert ceil_q.dequantize()[0].item() == 256 / 64


def _e4m3_table() -> tuple[torch.Tensor, torch.Tensor]:
    """All finite non-negative E4M3 (fn) values and their codes, decoded from the bit layout by hand."""
    codes, values = [], []
    for code in range(0x7F):  # 0x7F is NaN
        e, m = code >> 3, code & 7
        values.append(m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
        codes.append(code)
    return torch.tensor(codes), torch.tensor(values, dtype=torch.float64)


@HYP
@given(st.lists(st.floats(-448, 448, allow_nan=False, width=32), min_size=31, max_size=31), st.booleans())
def test_e4m3_elements_round_to_nearest_even(vals: list[float], midpoints: bool) -> None:
    codes, table = _e4m3_table()
    y = torch.tensor(vals, dtype=torch.float64)
    if midpoints:  # push every value onto an exact midpoint between neighbours to exercise ties
        idx = torch.searchsorted(table, y.abs()).clamp(1, len(table) - 1)
        y = torch.sign(y) * (table[idx - 1] + table[idx]) / 2
    x = torch.cat([torch.tensor([448.0], dtype=torch.float64), y])  # 448 pins the scale to 2^0
    q = quantize_mxfp8(x)
    assert q.scales.tolist() == [127]
    dist = (y.abs().unsqueeze(1) - table.unsqueeze(0)).abs()
    best = dist.min(dim=1, keepdim=True).values
    tied = dist == best
    # Among equally near values pick the even code (mantissa LSB 0).
    pick = torch.where(tied & (codes % 2 == 0), 0, torch.where(tied, 1, 2)).argmin(dim=1)
    want = table[pick] * torch.where(torch.signbit(y), -1.0, 1.0)
    assert torch.equal(q.dequantize(torch.float64)[1:], want)


# --- layout ------------------------------------------------------------------------------------------------------


def test_pack_low_nibble_first() -> None:
    codes = torch.tensor([0x1, 0x2, 0xF, 0x0, 0x8, 0x7], dtype=torch.uint8)
    assert pack_fp4(codes).tolist() == [0x21, 0x0F, 0x78]


@HYP
@given(st.lists(st.integers(0, 15), min_size=2, max_size=64).filter(lambda v: len(v) % 2 == 0))
def test_pack_unpack_inverse(vals: list[int]) -> None:
    codes = torch.tensor(vals, dtype=torch.uint8)
    assert torch.equal(unpack_fp4(pack_fp4(codes)), codes)


def test_element_and_scale_positions() -> None:
    # Row 1, element 33 is in block 1 and byte 16's high nibble; each block's scale tracks its own max.
    x = torch.zeros(2, 96)
    x[1, 33] = 3.0  # block 1: amax 3 -> exponent -1 -> byte 126; y = 6 -> code 7
    x[0, 64] = 0.75  # block 2 of row 0: amax 0.75 -> exponent -3 -> byte 124; y = 6 -> code 7
    q = quantize_mxfp4(x)
    assert q.data.shape == (2, 48) and q.scales.shape == (2, 3)
    assert q.scales.tolist() == [[0, 0, 124], [0, 126, 0]]
    assert q.data[1, 16].item() == 0x70
    assert q.data[0, 32].item() == 0x07
    assert q.shape == x.shape
    assert torch.equal(q.dequantize(), x)


def test_leading_dims_and_input_dtypes() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 64, generator=g).to(torch.bfloat16)
    q = quantize_mxfp4(x)
    assert q.data.shape == (2, 3, 32) and q.scales.shape == (2, 3, 2)
    flat = quantize_mxfp4(x.float().reshape(6, 64))
    assert torch.equal(q.data.reshape(6, 32), flat.data) and torch.equal(q.scales.reshape(6, 2), flat.scales)
    assert q.dequantize(torch.bfloat16).dtype == torch.bfloat16
    q8 = quantize_mxfp8(x.to(torch.float16))
    assert q8.data.dtype == torch.float8_e4m3fn and q8.data.shape == x.shape


# --- exactness ---------------------------------------------------------------------------------------------------


@st.composite
def mxfp4_blocks(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed codes and scales for 1..3 blocks, each with a top-binade element (|code| 4 or 6) so the floor rule
    recovers the same scale."""
    n = draw(st.integers(1, 3))
    codes = torch.tensor(draw(st.lists(st.integers(0, 15), min_size=n * BLOCK, max_size=n * BLOCK)))
    for b in range(n):
        codes[b * BLOCK + draw(st.integers(0, BLOCK - 1))] = draw(st.sampled_from([6, 7, 14, 15]))
    # Above byte 252 the block maximum 4 * X overflows float32 (documented in the module).
    scales = torch.tensor(draw(st.lists(st.integers(0, 252), min_size=n, max_size=n)))
    return pack_fp4(codes.to(torch.uint8)), scales.to(torch.uint8)


@HYP
@given(mxfp4_blocks())
def test_mxfp4_round_trip_exact_for_representable(packed_scales: tuple[torch.Tensor, torch.Tensor]) -> None:
    packed, scales = packed_scales
    x = dequantize_mxfp4(packed, scales)
    q = quantize_mxfp4(x)
    assert torch.equal(q.data, packed) and torch.equal(q.scales, scales)
    assert torch.equal(q.dequantize(), x)


@HYP
@given(
    st.lists(st.integers(0, 0xFE).filter(lambda c: c & 0x7F != 0x7F), min_size=BLOCK, max_size=BLOCK),
    st.integers(0, BLOCK - 1),
    st.integers(0x78, 0x7E),
    st.integers(0, 246),  # 448 * 2^(246 - 127) is the largest block that stays finite in float32
)
def test_mxfp8_round_trip_exact_for_representable(codes: list[int], where: int, top: int, scale: int) -> None:
    bits = torch.tensor(codes, dtype=torch.uint8)
    bits[where] = top  # an element in [256, 448] keeps the floor-rule exponent
    data = bits.view(torch.float8_e4m3fn)
    scales = torch.tensor([scale], dtype=torch.uint8)
    x = dequantize_mxfp8(data, scales)
    q = quantize_mxfp8(x)
    assert torch.equal(q.scales, scales)
    assert torch.equal(q.dequantize(), x)


finite32 = st.floats(allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 2).flatmap(lambda n: st.lists(finite32, min_size=n * BLOCK, max_size=n * BLOCK)))
def test_requantization_is_idempotent(vals: list[float]) -> None:
    x = torch.tensor(vals)
    for quant in (quantize_mxfp4, quantize_mxfp8):
        q1 = quant(x)
        q2 = quant(q1.dequantize())
        assert torch.equal(q1.data.view(torch.uint8), q2.data.view(torch.uint8))
        assert torch.equal(q1.scales, q2.scales)
        # The ceil rule may shrink the scale on requantization, but the values are a fixed point. (Near the
        # float32 maximum its rounded-up block max overflows float32 on dequantization, so stay below 2^120.)
        c1 = quant(x.clamp(-(2.0**120), 2.0**120), scale_rule="ceil").dequantize()
        assert torch.equal(quant(c1, scale_rule="ceil").dequantize(), c1)


# --- error bounds ------------------------------------------------------------------------------------------------


def _random_blocks(seed: int, rows: int = 256) -> torch.Tensor:
    """Gaussian blocks with per-block magnitudes spread over 2^-40 .. 2^40 and a few outliers."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 4 * BLOCK, generator=g, dtype=torch.float64)
    x *= torch.exp2(torch.randint(-40, 41, (rows, 1), generator=g).double())
    x[::7, 5] *= 30
    return x.float()


def _scale_of(q: MxTensor) -> torch.Tensor:
    return e8m0_to_float32(q.scales).repeat_interleave(BLOCK, dim=-1).double()


def _e2m1_half_gap(y: torch.Tensor) -> torch.Tensor:
    a = y.abs()
    return torch.where(a < 2, 0.25, torch.where(a < 4, 0.5, 1.0)).double()


def _e4m3_half_ulp(y: torch.Tensor) -> torch.Tensor:
    a = y.abs().clamp(min=2.0**-6)
    return torch.exp2(torch.floor(torch.log2(a)) - 4)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("rule", ["floor", "ceil"])
def test_mxfp4_elementwise_error_bound(seed: int, rule: str) -> None:
    x = _random_blocks(seed)
    q = quantize_mxfp4(x, scale_rule=rule)
    scale = _scale_of(q)
    y = x.double() / scale
    # Round-to-nearest error is at most half the grid gap; beyond 6 the error is the clamp distance.
    bound = torch.maximum(_e2m1_half_gap(y), y.abs() - 6) * scale
    err = (q.dequantize(torch.float64) - x.double()).abs()
    assert bool((err <= bound).all())
    amax = x.double().abs().unflatten(-1, (-1, BLOCK)).amax(-1)
    block_scale = e8m0_to_float32(q.scales).double()
    if rule == "floor":
        assert bool(((amax >= 4 * block_scale) & (amax < 8 * block_scale)).all())
    else:
        assert bool(((amax <= 6 * block_scale) & (amax > 3 * block_scale)).all())
        assert bool((y.abs() <= 6).all())


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("rule", ["floor", "ceil"])
def test_mxfp8_elementwise_error_bound(seed: int, rule: str) -> None:
    x = _random_blocks(seed)
    q = quantize_mxfp8(x, scale_rule=rule)
    scale = _scale_of(q)
    y = x.double() / scale
    bound = torch.maximum(_e4m3_half_ulp(y), y.abs() - 448) * scale
    err = (q.dequantize(torch.float64) - x.double()).abs()
    assert bool((err <= bound).all())


def test_gaussian_relative_rms_error() -> None:
    # Expected levels for N(0, 1) blocks of 32: MXFP4 ~0.1-0.2, MXFP8 E4M3 ~0.02-0.04 (3 mantissa bits).
    g = torch.Generator().manual_seed(7)
    x = torch.randn(4096, 128, generator=g)

    def rel(q: MxTensor) -> float:
        return ((q.dequantize() - x).norm() / x.norm()).item()

    assert 0.05 < rel(quantize_mxfp4(x)) < 0.2
    assert 0.005 < rel(quantize_mxfp8(x)) < 0.04


# --- special values ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("quant", [quantize_mxfp4, quantize_mxfp8])
def test_non_finite_poisons_only_its_block(bad: float, quant) -> None:
    x = torch.ones(2, 64)
    x[0, 40] = bad
    q = quant(x)
    ones = 127 - (2 if quant is quantize_mxfp4 else 8)  # amax 1: exponent 0 - emax_elem
    assert q.scales.tolist() == [[ones, 255], [ones, ones]]
    out = q.dequantize()
    assert bool(out[0, 32:].isnan().all())
    assert torch.equal(out[0, :32], torch.ones(32)) and torch.equal(out[1], torch.ones(64))
    assert bool((q.data.view(torch.uint8)[0, q.data.shape[-1] // 2 :] == 0).all())


@pytest.mark.parametrize("quant", [quantize_mxfp4, quantize_mxfp8])
def test_zero_blocks(quant) -> None:
    q = quant(torch.zeros(64))
    assert q.scales.tolist() == [0, 0]
    assert bool((q.data.view(torch.uint8) == 0).all())
    assert torch.equal(q.dequantize(), torch.zeros(64))
    neg = quant(torch.full((32,), -0.0)).dequantize()
    assert torch.equal(neg, torch.zeros(32)) and bool(torch.signbit(neg).all())


def test_scale_range_extremes() -> None:
    # Below the UE8M0 range the exponent clamps to -127: 2^-126 is exact (y = 2), 2^-130 underflows to 0.
    q = quantize_mxfp4(block(2.0**-126, 2.0**-130))
    assert q.scales.tolist() == [0]
    assert q.dequantize()[:2].tolist() == [2.0**-126, 0.0]
    # The largest float32 has floor(log2) = 127 -> exponent 125 -> byte 252; it saturates to 6 * 2^125.
    big = torch.finfo(torch.float32).max
    q = quantize_mxfp4(block(big))
    assert q.scales.tolist() == [252]
    assert q.dequantize()[0].item() == 6 * 2.0**125
    assert quantize_mxfp8(block(big)).dequantize()[0].item() == 448 * 2.0**119


def test_e8m0_and_exp2_decoding() -> None:
    b = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
    got = e8m0_to_float32(b)
    assert got[:-1].tolist() == [2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127]
    assert math.isnan(got[-1].item())
    e = torch.arange(-149, 128)
    assert torch.equal(exp2_exact(e).double(), torch.exp2(e.double()))
    with pytest.raises(ValueError, match="float32 range"):
        exp2_exact(torch.tensor([128]))


# --- rejected inputs ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(33,), (16,), (2, 48), (0,), ()])
@pytest.mark.parametrize("quant", [quantize_mxfp4, quantize_mxfp8])
def test_bad_shapes_rejected(shape: tuple[int, ...], quant) -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        quant(torch.zeros(shape))


def test_bad_inputs_rejected() -> None:
    with pytest.raises(TypeError, match="floating"):
        quantize_mxfp4(torch.zeros(32, dtype=torch.int32))
    with pytest.raises(ValueError, match="unknown scale rule"):
        quantize_mxfp4(torch.ones(32), scale_rule="round")  # type: ignore[arg-type]
    packed = torch.zeros(2, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="needs scales of shape"):
        dequantize_mxfp4(packed, torch.zeros(2, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="needs scales of shape"):
        dequantize_mxfp4(torch.zeros(2, 8, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.uint8))
    with pytest.raises(TypeError, match="uint8"):
        dequantize_mxfp4(packed.float(), torch.zeros(2, 1, dtype=torch.uint8))
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        dequantize_mxfp8(torch.zeros(32), torch.zeros(1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="even"):
        pack_fp4(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="4-bit"):
        pack_fp4(torch.tensor([16, 0], dtype=torch.uint8))
