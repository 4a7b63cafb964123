"""Tests for the absorbed MLA decode oracle against an unabsorbed, per-head formulation."""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from k3_decode.config import K3, K3_MINI, MlaDims
from k3_decode.reference import mla

F64 = torch.float64
EPS = 1e-5
MINI = K3_MINI.mla
MINI_HEADS = K3_MINI.shard(2).mla_heads  # 4 heads on a rank
UNUSED_PAGE = 10**9  # block-table padding: reading it would raise


# --- fixtures built independently of the oracle --------------------------------------------------------


def e4m3_bits(x: Tensor, scale: float) -> Tensor:
    return (x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)


def e4m3_values(bits: Tensor, scale: float) -> Tensor:
    return bits.view(torch.float8_e4m3fn).to(F64) * scale


def make_weights(dims: MlaDims, heads: int, gen: torch.Generator) -> mla.MlaWeights:
    def randn(*shape: int, fan_in: int) -> Tensor:
        return (torch.randn(*shape, generator=gen) / math.sqrt(fan_in)).bfloat16()

    return mla.MlaWeights(
        q_a_norm=(1 + 0.2 * torch.randn(dims.q_lora_rank, generator=gen)).bfloat16(),
        kv_a_norm=(1 + 0.2 * torch.randn(dims.kv_lora_rank, generator=gen)).bfloat16(),
        q_b=randn(heads * dims.qk_head_dim, dims.q_lora_rank, fan_in=dims.q_lora_rank),
        w_uk=randn(heads, dims.qk_nope_head_dim, dims.kv_lora_rank, fan_in=dims.qk_nope_head_dim),
        w_uv=randn(heads, dims.kv_lora_rank, dims.v_head_dim, fan_in=dims.kv_lora_rank),
    )


def make_projected(dims: MlaDims, heads: int, batch: int, gen: torch.Generator) -> Tensor:
    width = dims.q_lora_rank + dims.cache_row + heads * dims.v_head_dim
    return (2 * torch.randn(batch, width, generator=gen)).bfloat16()


@dataclass
class Paged:
    cache: Tensor  # [pages, page_size, row] uint8
    block_table: Tensor
    seq_lens: Tensor
    slot_mapping: Tensor  # newest token of each request, -1 for zero-length ones
    past: list[Tensor]  # per request, the contiguous bytes of the positions already in the cache

    @property
    def page_size(self) -> int:
        return self.cache.shape[1]


def make_paged(
    lens: list[int], page_size: int, row: int, k_scale: float, gen: torch.Generator, fill_all: bool = False
) -> Paged:
    """Scatter each request's pages over a shuffled pool of garbage-filled pages (NaN bytes included).

    The first len - 1 positions hold known FP8 rows; the newest one is left for the insert unless
    `fill_all` (then every position is known and nothing is to be inserted).
    """
    need = [-(-n // page_size) for n in lens]
    pool = torch.randperm(sum(need) + 3, generator=gen)
    cache = torch.randint(0, 256, (len(pool), page_size, row), generator=gen, dtype=torch.uint8)
    table = torch.full((len(lens), max([*need, 1]) + 1), UNUSED_PAGE, dtype=torch.int32)
    slots = torch.full((len(lens),), -1, dtype=torch.long)
    past = []
    start = 0
    for b, n in enumerate(lens):
        table[b, : need[b]] = pool[start : start + need[b]].to(torch.int32)
        start += need[b]
        known = n if fill_all else max(n - 1, 0)
        rows = e4m3_bits(torch.randn(known, row, generator=gen), k_scale)
        for pos in range(known):
            cache[table[b, pos // page_size], pos % page_size] = rows[pos]
        past.append(rows)
        if n > 0:
            slots[b] = int(table[b, (n - 1) // page_size]) * page_size + (n - 1) % page_size
    return Paged(cache, table, torch.tensor(lens, dtype=torch.int32), slots, past)


def reference_decode(
    projected: Tensor, weights: mla.MlaWeights, dims: MlaDims, paged: Paged, k_scale: float
) -> tuple[Tensor, list[Tensor]]:
    """Unabsorbed MLA in FP64: per head, K = [kv_c W_UK[h]^T | k_pe] and V = kv_c W_UV[h], plain attention.

    Returns the gated output [B, H*v] and the cache bytes it expects for each new token.
    """
    heads, v_dim, lat = weights.num_heads, dims.v_head_dim, dims.kv_lora_rank
    x = projected.to(F64)
    q_a = x[:, : dims.q_lora_rank]
    kv_c = x[:, dims.q_lora_rank : dims.q_lora_rank + lat]
    k_pe = x[:, dims.q_lora_rank + lat : dims.q_lora_rank + dims.cache_row]
    gate = x[:, dims.q_lora_rank + dims.cache_row :]
    out = torch.zeros(len(paged.seq_lens), heads * v_dim, dtype=F64)
    new_rows = []
    for b, n in enumerate(paged.seq_lens.tolist()):
        kv_n = kv_c[b] / torch.sqrt(kv_c[b].square().mean() + EPS) * weights.kv_a_norm.to(F64)
        new_rows.append(e4m3_bits(torch.cat([kv_n, k_pe[b]]), k_scale))
        if n == 0:
            continue
        ctx = e4m3_values(torch.cat([paged.past[b], new_rows[b][None]]), k_scale)
        assert ctx.shape[0] == n
        qa_n = q_a[b] / torch.sqrt(q_a[b].square().mean() + EPS) * weights.q_a_norm.to(F64)
        q = (weights.q_b.to(F64) @ qa_n).view(heads, dims.qk_head_dim)
        for h in range(heads):
            k_nope = ctx[:, :lat] @ weights.w_uk[h].to(F64).T  # [n, nope]
            keys = torch.cat([k_nope, ctx[:, lat:]], dim=1)  # [n, nope + rope]
            values = ctx[:, :lat] @ weights.w_uv[h].to(F64)  # [n, v]
            probs = torch.softmax(keys @ q[h] / math.sqrt(dims.qk_nope_head_dim + dims.qk_rope_head_dim), dim=0)
            g = torch.sigmoid(gate[b, h * v_dim : (h + 1) * v_dim])
            out[b, h * v_dim : (h + 1) * v_dim] = (probs @ values) * g
    return out, new_rows


def run_decode(projected, weights, dims, paged: Paged, k_scale: float, **kw) -> Tensor:
    return mla.mla_decode(
        projected,
        weights,
        dims,
        paged.cache,
        paged.block_table,
        paged.seq_lens,
        paged.slot_mapping,
        k_scale,
        EPS,
        **kw,
    )


def assert_insert(before: Tensor, paged: Paged, new_rows: list[Tensor]) -> None:
    """The cache changed exactly at the new tokens' slots, to the expected bytes."""
    after = paged.cache.view(-1, paged.cache.shape[-1])
    expected = before.view(-1, before.shape[-1]).clone()
    for b, slot in enumerate(paged.slot_mapping.tolist()):
        if slot >= 0:
            expected[slot] = new_rows[b]
    assert torch.equal(after, expected)


lens_st = st.lists(st.integers(0, 40), min_size=1, max_size=5)


# --- FP8 -----------------------------------------------------------------------------------------------

# (value, scale, E4M3 bits worked out by hand: sign | exponent (bias 7) | 3 mantissa bits)
E4M3_TABLE = [
    (1.0, 1.0, 0x38),  # 0 0111 000
    (-1.0, 1.0, 0xB8),
    (0.5, 1.0, 0x30),  # 0 0110 000
    (2.0, 1.0, 0x40),  # 0 1000 000
    (3.0, 1.0, 0x44),  # 1.5 * 2: 0 1000 100
    (1.125, 1.0, 0x39),  # 0 0111 001
    (1.0625, 1.0, 0x38),  # tie between 1.0 and 1.125: to even (1.0)
    (1.1875, 1.0, 0x3A),  # tie between 1.125 and 1.25: to even (1.25)
    (240.0, 1.0, 0x77),  # 1.875 * 2^7: 0 1110 111
    (448.0, 1.0, 0x7E),  # the largest finite: 0 1111 110
    (464.0, 1.0, 0x7E),  # saturates (no infinity in E4M3FN; 0x7F is NaN)
    (-1000.0, 1.0, 0xFE),
    (2.0**-9, 1.0, 0x01),  # the smallest subnormal
    (2.0**-10, 1.0, 0x00),  # tie between 0 and 2^-9: to even (0)
    (3 * 2.0**-10, 1.0, 0x02),  # tie between 2^-9 and 2^-8: to even (2^-8)
    (0.0, 1.0, 0x00),
    (-0.0, 1.0, 0x80),
    (3.0, 2.0, 0x3C),  # 1.5: 0 0111 100
    (0.75, 0.25, 0x44),  # 3.0
    (200.0, 1.0, 0x74),  # 1.5625 * 2^7 is a tie between 1.5 and 1.625: to even (192)
]


def test_e4m3_bits_hand_computed():
    for value, scale, bits in E4M3_TABLE:
        got = int(mla.quantize_e4m3(torch.tensor([value]), scale)[0])
        assert got == bits, f"{value} / {scale}: got {got:#04x}, want {bits:#04x}"
    # Exact round trip for the representable entries.
    for value, scale, bits in E4M3_TABLE[:6]:
        back = mla.dequantize_e4m3(torch.tensor([bits], dtype=torch.uint8), scale, F64)
        assert float(back[0]) == value


def test_insert_known_bytes_and_nothing_else():
    # kv_c of +-1 has RMS exactly 1, so the normed row is kv_a_norm * sign * (1 + eps)^-1/2, which rounds
    # to the same E4M3 value as kv_a_norm * sign / k_scale; k_pe goes in unnormed.
    k_scale = 0.5
    norm_w = torch.tensor([2.0, 2.0, 0.5, 3.0, 3.0, 1.125, 448.0, 1.0])
    signs = torch.tensor([1.0, -1.0, 1.0, 1.0, -1.0, 1.0, 1.0, 1.0])
    k_pe = torch.tensor([0.25, -0.375, 100.0, 0.0])
    # 4, -4, 1, 6, -6, 2.25, 896 (saturates to 448), 2 | 0.5, -0.75, 200 (tie, to 192), 0
    want = [0x48, 0xC8, 0x38, 0x4C, 0xCC, 0x41, 0x7E, 0x40, 0x30, 0xB4, 0x74, 0x00]
    kv_c = torch.stack([signs, -signs, signs]).bfloat16()
    rows = mla.kv_cache_row(kv_c, k_pe.expand(3, 4), norm_w, EPS)
    gen = torch.Generator().manual_seed(0)
    for cache_dtype in (torch.uint8, torch.float8_e4m3fn):
        cache = torch.randint(0, 256, (4, 3, 12), generator=gen, dtype=torch.uint8)
        before = cache.clone()
        cache = cache.view(cache_dtype)
        mla.insert_kv(cache, rows, torch.tensor([7, 0, -1]), k_scale)  # slot 7 = page 2, offset 1
        got = cache.view(torch.uint8)
        assert got[2, 1].tolist() == want
        assert got[0, 0].tolist() == [b ^ 0x80 for b in want[:8]] + want[8:]
        untouched = torch.ones(4, 3, dtype=torch.bool)
        untouched[2, 1] = untouched[0, 0] = False
        assert torch.equal(got[untouched], before[untouched])  # the padded request (-1) wrote nothing


def test_insert_bf16_row_rounding_changes_a_tie():
    # 1.0625 + 2^-12 is just above an E4M3 tie (1.125); rounded to BF16 first it lands on the tie (1.0).
    row = torch.tensor([[1.0625 + 2.0**-12]], dtype=F64)
    direct, via_bf16 = torch.zeros(1, 1, 1, dtype=torch.uint8), torch.zeros(1, 1, 1, dtype=torch.uint8)
    mla.insert_kv(direct, row, torch.tensor([0]), 1.0)
    mla.insert_kv(via_bf16, row, torch.tensor([0]), 1.0, kv_row_dtype=torch.bfloat16)
    assert (int(direct), int(via_bf16)) == (0x39, 0x38)


def test_insert_rejects_bad_slots():
    cache = torch.zeros(2, 4, 3, dtype=torch.uint8)
    rows = torch.ones(2, 3)
    with pytest.raises(ValueError, match="same slot"):
        mla.insert_kv(cache, rows, torch.tensor([5, 5]), 1.0)
    with pytest.raises(ValueError, match="outside"):
        mla.insert_kv(cache, rows, torch.tensor([8, -1]), 1.0)
    with pytest.raises(ValueError, match="row width"):
        mla.insert_kv(cache, torch.ones(1, 4), torch.tensor([0]), 1.0)
    assert not cache.any()


def test_decode_slot_mapping_by_hand():
    table = torch.tensor([[5, 2], [7, 0], [3, 9]])
    # request 0: position 5 -> page index 1 (page 2), offset 1; request 1: padding; request 2: position 3.
    got = mla.decode_slot_mapping(table, torch.tensor([6, 0, 4]), page_size=4)
    assert got.tolist() == [2 * 4 + 1, -1, 3 * 4 + 3]


# --- absorbed vs unabsorbed ----------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    lens=lens_st,
    page_size=st.sampled_from([1, 3, 16, 64]),
    num_splits=st.sampled_from([1, 4]),
    k_scale=st.sampled_from([1.0, 0.02, 0.37]),
    seed=st.integers(0, 2**31),
)
def test_absorbed_matches_unabsorbed(lens, page_size, num_splits, k_scale, seed):
    gen = torch.Generator().manual_seed(seed)
    weights = make_weights(MINI, MINI_HEADS, gen)
    projected = make_projected(MINI, MINI_HEADS, len(lens), gen)
    paged = make_paged(lens, page_size, MINI.cache_row, k_scale, gen)
    before = paged.cache.clone()
    got = run_decode(projected, weights, MINI, paged, k_scale, num_splits=num_splits, dtype=F64)
    want, new_rows = reference_decode(projected, weights, MINI, paged, k_scale)
    assert_insert(before, paged, new_rows)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    # Padding requests produce exact zeros.
    assert not got[torch.tensor(lens) == 0].any()


def test_fp32_oracle_close_to_fp64_reference():
    gen = torch.Generator().manual_seed(11)
    lens = [33, 1, 0, 17, 64]
    weights = make_weights(MINI, MINI_HEADS, gen)
    projected = make_projected(MINI, MINI_HEADS, len(lens), gen)
    paged = make_paged(lens, 16, MINI.cache_row, 0.05, gen)
    got = run_decode(projected, weights, MINI, paged, 0.05)
    want, _ = reference_decode(projected, weights, MINI, paged, 0.05)
    assert got.dtype == torch.float32 and got.shape == (5, MINI_HEADS * MINI.v_head_dim)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


def test_q_scale_rounds_the_latent_query_through_fp8():
    gen = torch.Generator().manual_seed(5)
    lens = [9, 30]
    weights = make_weights(MINI, MINI_HEADS, gen)
    projected = make_projected(MINI, MINI_HEADS, 2, gen)
    paged = make_paged(lens, 8, MINI.cache_row, 0.05, gen)
    q_scale = 0.03
    got = run_decode(projected, weights, MINI, paged, 0.05, q_scale=q_scale)
    exact = run_decode(projected, weights, MINI, paged, 0.05)
    # The same step built by hand from the public pieces, with the query rounded explicitly.
    parts = mla.split_qkv_a_g(projected, MINI, MINI_HEADS)
    query = mla.absorbed_query(parts.q_a, weights, MINI, EPS)
    rounded = e4m3_values(e4m3_bits(query, q_scale), q_scale).float()
    assert not torch.equal(rounded, query)
    latent, _ = mla.attend(
        rounded, paged.cache, paged.block_table, paged.seq_lens, 0.05, mla.softmax_scale(MINI), MINI.kv_lora_rank
    )
    torch.testing.assert_close(got, mla.value_and_gate(latent, weights.w_uv, parts.gate), rtol=1e-6, atol=1e-6)
    assert not torch.allclose(got, exact, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got, exact, rtol=0.1, atol=0.05)


# --- split-KV and the DCP combine ----------------------------------------------------------------------


def random_query(batch: int, heads: int, row: int, gen: torch.Generator) -> Tensor:
    return 0.3 * torch.randn(batch, heads, row, generator=gen, dtype=F64)


@settings(max_examples=60, deadline=None)
@given(
    lens=lens_st,
    page_size=st.sampled_from([1, 4, 16]),
    num_splits=st.integers(1, 70),
    page_aligned=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_split_kv_merge_matches_unsplit(lens, page_size, num_splits, page_aligned, seed):
    gen = torch.Generator().manual_seed(seed)
    paged = make_paged(lens, page_size, MINI.cache_row, 0.05, gen, fill_all=True)
    q = random_query(len(lens), MINI_HEADS, MINI.cache_row, gen)
    args = (q, paged.cache, paged.block_table, paged.seq_lens, 0.05, mla.softmax_scale(MINI), MINI.kv_lora_rank)
    whole, whole_lse = mla.attend(*args, dtype=F64)
    split, split_lse = mla.attend(*args, num_splits=num_splits, page_aligned_splits=page_aligned, dtype=F64)
    torch.testing.assert_close(split, whole, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(split_lse, whole_lse, rtol=1e-12, atol=1e-12)
    # The LSE is the natural log of the summed exponentiated scaled scores.
    for b, n in enumerate(lens):
        if n:
            scores = q[b] @ e4m3_values(paged.past[b], 0.05).T * mla.softmax_scale(MINI)
            torch.testing.assert_close(whole_lse[b], scores.exp().sum(-1).log(), rtol=1e-12, atol=1e-12)
        else:
            assert torch.isneginf(whole_lse[b]).all()


@given(lens=lens_st, num_splits=st.integers(1, 50), page_size=st.sampled_from([None, 1, 8]))
def test_split_bounds_tile_the_context(lens, num_splits, page_size):
    bounds = mla.split_bounds(torch.tensor(lens), num_splits, page_size)
    assert bounds.shape == (num_splits, len(lens), 2)
    for b, n in enumerate(lens):
        ranges = bounds[:, b].tolist()
        assert ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(lo <= hi for lo, hi in ranges)
        assert all(ranges[j][1] == ranges[j + 1][0] for j in range(num_splits - 1))
        if page_size:
            assert all(lo % page_size == 0 for lo, hi in ranges if hi > lo)
    if num_splits > max(lens):
        assert (bounds[..., 0] == bounds[..., 1]).any()  # some splits are empty


@settings(max_examples=30, deadline=None)
@given(lens=lens_st, ranks=st.sampled_from([2, 3, 4, 8]), seed=st.integers(0, 2**31))
def test_dcp_interleaved_shards_merge_like_splits(lens, ranks, seed):
    """Each rank holds positions r, r + R, ... in its own paged cache; merging the rank partials with
    `merge_partials` gives the single-rank result."""
    gen = torch.Generator().manual_seed(seed)
    whole = make_paged(lens, 4, MINI.cache_row, 0.05, gen, fill_all=True)
    q = random_query(len(lens), MINI_HEADS, MINI.cache_row, gen)
    common = (0.05, mla.softmax_scale(MINI), MINI.kv_lora_rank)
    want, want_lse = mla.attend(q, whole.cache, whole.block_table, whole.seq_lens, *common, dtype=F64)
    outs, lses = [], []
    for r in range(ranks):
        local_lens = [len(range(r, n, ranks)) for n in lens]
        shard = make_paged(local_lens, 4, MINI.cache_row, 0.05, gen, fill_all=True)
        for b in range(len(lens)):  # overwrite the random rows with this rank's share of the context
            for i, pos in enumerate(range(r, lens[b], ranks)):
                page = shard.block_table[b, i // 4]
                shard.cache[page, i % 4] = whole.past[b][pos]
        o, lse = mla.attend(q, shard.cache, shard.block_table, shard.seq_lens, *common, dtype=F64)
        outs.append(o)
        lses.append(lse)
    got, got_lse = mla.merge_partials(torch.stack(outs), torch.stack(lses))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_lse, want_lse, rtol=1e-12, atol=1e-12)


def test_merge_empty_and_single_splits():
    gen = torch.Generator().manual_seed(2)
    out = torch.randn(2, 3, 4, generator=gen)
    lse = torch.randn(2, 3, generator=gen)
    empty_out, empty_lse = torch.zeros(2, 3, 4), torch.full((2, 3), -math.inf)
    merged, merged_lse = mla.merge_partials(torch.stack([empty_out, empty_out]), torch.stack([empty_lse] * 2))
    assert not merged.isnan().any() and not merged.any() and torch.isneginf(merged_lse).all()
    merged, merged_lse = mla.merge_partials(
        torch.stack([empty_out, out, empty_out]), torch.stack([empty_lse, lse, empty_lse])
    )
    assert torch.equal(merged, out) and torch.equal(merged_lse, lse)
    # Two partials of equal mass average.
    merged, merged_lse = mla.merge_partials(torch.stack([out, -out]), torch.stack([lse, lse]))
    torch.testing.assert_close(merged, torch.zeros_like(out), rtol=0, atol=1e-6)
    torch.testing.assert_close(merged_lse, lse + math.log(2))


# --- cache layout --------------------------------------------------------------------------------------


@settings(max_examples=20, deadline=None)
@given(lens=lens_st, page_size=st.sampled_from([1, 2, 5, 16]), seed=st.integers(0, 2**31))
def test_paged_equals_contiguous(lens, page_size, seed):
    gen = torch.Generator().manual_seed(seed)
    weights = make_weights(MINI, MINI_HEADS, gen)
    projected = make_projected(MINI, MINI_HEADS, len(lens), gen)
    paged = make_paged(lens, page_size, MINI.cache_row, 0.05, gen)
    # One page per request, as long as the longest context, in request order.
    width = max([*lens, 1])
    contiguous = Paged(
        cache=torch.zeros(len(lens), width, MINI.cache_row, dtype=torch.uint8),
        block_table=torch.arange(len(lens), dtype=torch.int32)[:, None],
        seq_lens=paged.seq_lens,
        slot_mapping=torch.tensor([b * width + n - 1 if n else -1 for b, n in enumerate(lens)]),
        past=paged.past,
    )
    for b, rows in enumerate(paged.past):
        contiguous.cache[b, : len(rows)] = rows
    got = run_decode(projected, weights, MINI, paged, 0.05, num_splits=3)
    want = run_decode(projected, weights, MINI, contiguous, 0.05, num_splits=3)
    assert torch.equal(got, want)


# --- real shapes ---------------------------------------------------------------------------------------


def test_k3_tp8_shapes_small_context():
    shapes = K3.shard(8)
    dims, heads = K3.mla, shapes.mla_heads
    assert heads == 12 and dims.cache_row == shapes.mla_cache_row == 576
    assert mla.softmax_scale(dims) == 1 / math.sqrt(192)
    gen = torch.Generator().manual_seed(8)
    weights = make_weights(dims, heads, gen)
    assert (weights.w_uk.shape, weights.w_uv.shape) == (shapes.mla_w_uk, shapes.mla_w_uv)
    assert weights.q_b.shape == shapes.mla_q_b
    lens = [37, 0, 5]
    projected = make_projected(dims, heads, len(lens), gen)
    assert projected.shape[1] == shapes.mla_qkv_a_g_rows == 3648
    paged = make_paged(lens, 64, dims.cache_row, 0.05, gen)
    start = time.perf_counter()
    got = run_decode(projected, weights, dims, paged, 0.05, num_splits=2)
    elapsed = time.perf_counter() - start
    assert elapsed < 2.0, f"oracle took {elapsed:.2f} s at K3 TP8 shapes"
    assert got.shape == (3, shapes.mla_o_proj[1]) == (3, 1536)
    want, _ = reference_decode(projected, weights, dims, paged, 0.05)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


def test_rejects_wrong_projection_width_and_gate():
    with pytest.raises(ValueError, match="projection width"):
        mla.split_qkv_a_g(torch.zeros(1, 10), MINI, MINI_HEADS)
    gen = torch.Generator().manual_seed(0)
    paged = make_paged([3], 4, MINI.cache_row, 1.0, gen)
    silu = dataclasses.replace(MINI, output_gate="silu")
    with pytest.raises(ValueError, match="sigmoid"):
        run_decode(make_projected(MINI, 4, 1, gen), make_weights(MINI, 4, gen), silu, paged, 1.0)
