"""Tests for the two-shot all-reduce oracle: rank-order FP32 sum, one BF16 rounding, identical bits."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from k3_decode.config import K3, K3_MINI
from k3_decode.reference import allreduce as ar

BF16 = torch.bfloat16


def row(value: float, width: int = 8) -> Tensor:
    return torch.full((1, width), value, dtype=BF16)


def fp32_sequential_reference(partials: list[Tensor]) -> Tensor:
    """Rank-order FP32 sum emulated in FP64: one FP64 add of two FP32 values rounded to FP32 is the correctly
    rounded FP32 add (53 >= 2·24 + 2 makes the double rounding harmless), then one rounding to BF16."""
    acc = partials[0].double()
    for p in partials[1:]:
        acc = (acc + p.double()).float().double()
    out = acc.float().bfloat16()
    return torch.where(out == 0, torch.zeros_like(out), out)


# --- ownership -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("width", [K3.hidden_size, K3.moe.latent_size, K3_MINI.hidden_size])
@pytest.mark.parametrize("tp", [1, 2, 4, 8, 16])
def test_owned_columns_partition_the_row_in_rank_order(width: int, tp: int) -> None:
    if (width // tp) % ar.FRAGMENT_COLS:
        pytest.skip("not a two-shot shape")
    cols = [ar.owned_columns(width, tp, r) for r in range(tp)]
    assert cols[0].start == 0 and cols[-1].stop == width
    assert all(a.stop == b.start for a, b in itertools.pairwise(cols))
    assert {c.stop - c.start for c in cols} == {width // tp}


def test_k3_chunk_sizes() -> None:
    assert ar.owned_columns(K3.hidden_size, 16, 1) == slice(448, 896)
    assert ar.owned_columns(K3.hidden_size, 8, 7) == slice(7 * 896, 7168)


@pytest.mark.parametrize(("width", "tp", "rank"), [(100, 4, 0), (48, 4, 0), (64, 4, 4), (64, 4, -1), (64, 0, 0)])
def test_owned_columns_rejects_bad_splits(width: int, tp: int, rank: int) -> None:
    with pytest.raises(ValueError):
        ar.owned_columns(width, tp, rank)


# --- the reduction rule --------------------------------------------------------------------------------


@st.composite
def bf16_partials(draw: st.DrawFn) -> list[Tensor]:
    """BF16 partials m·2^e (|m| <= 255, so exact in BF16) whose sums hit ties, carries and cancellation."""
    tp = draw(st.integers(1, 8))
    rows, chunks = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    lo = draw(st.integers(-40, 0))
    spread = draw(st.integers(0, 30))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    shape = (tp, rows, tp * ar.FRAGMENT_COLS * chunks)
    mant = torch.randint(-255, 256, shape, generator=gen).double()
    expo = torch.randint(lo, lo + spread + 1, shape, generator=gen).double()
    return list((mant * torch.exp2(expo)).to(BF16).unbind(0))


@settings(max_examples=150, deadline=None)
@given(bf16_partials())
def test_two_shot_is_fp32_rank_order_sum_rounded_once(partials: list[Tensor]) -> None:
    outs = ar.two_shot_all_reduce(partials)
    want = ar.bf16_bits(fp32_sequential_reference(partials))
    assert len(outs) == len(partials)
    for out in outs:
        assert torch.equal(ar.bf16_bits(out), want)
    ar.verify_two_shot(outs, partials)


@pytest.mark.parametrize("tp", [2, 4, 8, 16])
def test_two_shot_chunks_reassemble_the_one_shot_row(tp: int) -> None:
    gen = torch.Generator().manual_seed(tp)
    partials = [torch.randn(5, K3.hidden_size, generator=gen).to(BF16) for _ in range(tp)]
    one_shot = ar.reduce_rank_order(partials)
    for out in ar.two_shot_all_reduce(partials):
        assert torch.equal(ar.bf16_bits(out), ar.bf16_bits(one_shot))


def test_single_rounding_differs_from_a_bf16_running_sum() -> None:
    # 2^-9 is a quarter of the BF16 ulp at 1: each BF16 add drops it, the FP32 sum keeps 3/8 ulp and rounds up.
    partials = [row(1.0), row(2**-9), row(2**-9), row(2**-9)]
    assert torch.all(ar.reduce_rank_order(partials) == 1 + 2**-7)
    assert torch.all(ar.naive_bf16_sum(partials) == 1.0)
    with pytest.raises(ar.TwoShotMismatch, match="rank 0"):
        ar.verify_two_shot([ar.naive_bf16_sum(partials)] * 4, partials)


def test_rank_order_changes_the_bits() -> None:
    # In rank order the three 2^-25 add up before meeting 1 and push 1 + 2^-8 over the BF16 tie;
    # in reverse order each is lost against 1 and the tie rounds to even (1.0).
    partials = [row(2**-25, 64)] * 3 + [row(2**-8, 64), row(1.0, 64)] + [row(0.0, 64)] * 3
    for out in ar.two_shot_all_reduce(partials):
        assert torch.all(out == 1 + 2**-7)
    reverse = ar.two_shot_all_reduce(partials[::-1])
    assert torch.all(reverse[0] == 1.0)
    with pytest.raises(ar.TwoShotMismatch):
        ar.verify_two_shot(reverse, partials)


def test_bf16_running_sum_differs_on_ordinary_data() -> None:
    gen = torch.Generator().manual_seed(0)
    partials = [torch.randn(64, K3.hidden_size, generator=gen).to(BF16) for _ in range(8)]
    two_shot = ar.two_shot_all_reduce(partials)[0]
    naive = ar.naive_bf16_sum(partials)
    exact = sum(p.double() for p in partials)
    assert (two_shot != naive).float().mean() > 0.2  # the order/rounding rule decides a large share of bits
    assert (two_shot.double() - exact).abs().mean() < 0.6 * (naive.double() - exact).abs().mean()
    # One rounding of a near-exact FP32 sum: for this data it is the correctly rounded BF16 sum everywhere.
    assert torch.equal(two_shot, exact.float().to(BF16))


def test_negative_zero_becomes_positive_zero() -> None:
    partials = [row(-0.0, 16), row(-0.0, 16)]
    out = ar.two_shot_all_reduce(partials)[0]
    assert torch.all(ar.bf16_bits(out) == 0)
    assert torch.all(ar.bf16_bits(ar.naive_bf16_sum(partials)) == ar.bf16_bits(row(-0.0, 16)))
    with pytest.raises(ar.TwoShotMismatch):
        ar.verify_two_shot([ar.naive_bf16_sum(partials)] * 2, partials)


def test_tp1_is_the_identity_on_bits() -> None:
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1)).to(BF16)
    assert torch.equal(ar.bf16_bits(ar.two_shot_all_reduce([x])[0]), ar.bf16_bits(x))


def test_nan_stays_in_its_column() -> None:
    a, b = row(1.0, 16), row(2.0, 16)
    a[0, 9] = float("nan")
    out = ar.two_shot_all_reduce([a, b])[1]
    assert torch.isnan(out[0, 9]) and not torch.isnan(out[0, torch.arange(16) != 9]).any()


def test_inputs_are_not_modified() -> None:
    partials = [row(-0.0, 16), row(3.0, 16)]
    before = [p.clone() for p in partials]
    ar.two_shot_all_reduce(partials)
    assert all(torch.equal(ar.bf16_bits(p), ar.bf16_bits(q)) for p, q in zip(partials, before, strict=True))


# --- verify_two_shot and input checks ------------------------------------------------------------------


def test_verify_names_the_rank_and_owner_of_a_one_ulp_error() -> None:
    gen = torch.Generator().manual_seed(2)
    partials = [torch.randn(2, 64, generator=gen).to(BF16) for _ in range(4)]
    outs = ar.two_shot_all_reduce(partials)
    ar.verify_two_shot(outs, partials)
    bad = [o.clone() for o in outs]
    bad[2].view(torch.int16)[1, 37] += 1  # one ulp, one value, one rank
    with pytest.raises(
        ar.TwoShotMismatch, match=r"rank 2: 1 values differ; first at row 1, column 37 \(owned by rank 2\)"
    ):
        ar.verify_two_shot(bad, partials)
    with pytest.raises(ar.TwoShotMismatch):
        ar.verify_two_shot(outs[:3], partials)
    with pytest.raises(ar.TwoShotMismatch):
        ar.verify_two_shot([o.float() for o in outs], partials)


def test_rejects_non_bf16_or_ragged_partials() -> None:
    with pytest.raises(TypeError):
        ar.two_shot_all_reduce([row(1.0).float(), row(1.0).float()])
    with pytest.raises(ValueError):
        ar.two_shot_all_reduce([row(1.0, 16), row(1.0, 32)])
    with pytest.raises(ValueError):
        ar.two_shot_all_reduce([])
    with pytest.raises(ValueError):
        ar.two_shot_all_reduce([row(1.0, 12), row(1.0, 12)])  # chunks of 6 columns are not whole fragments
