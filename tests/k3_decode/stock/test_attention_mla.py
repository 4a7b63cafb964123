"""Stock MLA decode (torch-cpu path) against the oracle at k3-mini dims: the split-KV core on identical FP8 inputs,
the cache rows it inserts, the whole decode end to end, padding, and the errors. The Triton kernels are checked
under the interpreter (test_attention_interpreted.py) and on the GPU."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from k3_decode.config import K3, K3_MINI
from k3_decode.reference import mla as rm
from k3_decode.stock import mla as sm
from tests.k3_decode.stock.attention_helpers import (
    assert_close,
    load_tolerances,
    mla_layer,
    oracle_mla,
    projected_rows,
    random_paged_cache,
    weights_for,
)

TOL = load_tolerances()
TP = 2
DIMS = K3_MINI
WEIGHTS = weights_for(DIMS, TP, "cpu").attention(mla_layer(DIMS))
HEADS = WEIGHTS.w_uk.shape[0]
SEQ_LENS = [37, 1, 0, 130, 64, 200]  # one zero-length (padded) request


@pytest.mark.parametrize("num_splits", [1, 3, 7])
def test_split_core_matches_the_oracle_on_the_same_fp8_inputs(num_splits: int):
    gen = torch.Generator().manual_seed(num_splits)
    setup = random_paged_cache(DIMS, SEQ_LENS, 16, gen, "cpu", k_scale=0.5, q_scale=0.25)
    paged = setup.paged
    query = rm.quantize_e4m3(torch.randn(len(SEQ_LENS), HEADS, DIMS.mla.cache_row, generator=gen) * 2, 0.25)
    scale = rm.softmax_scale(DIMS.mla)
    got = sm._attend_torch(query, paged.bytes(), paged, DIMS.mla.kv_lora_rank, num_splits, scale)
    ref, _ = rm.attend(rm.dequantize_e4m3(query, 0.25), paged.cache, paged.block_table, paged.seq_lens, 0.5, scale, 64)
    live = paged.seq_lens > 0
    assert_close(got[live], ref[live], TOL["mla_core"], f"split-KV core, {num_splits} splits")
    assert not got[~live].any(), "a zero-length request attends to nothing"


def test_decode_end_to_end_and_the_rows_it_inserts():
    gen = torch.Generator().manual_seed(0)
    setup = random_paged_cache(DIMS, SEQ_LENS, 16, gen, "cpu", k_scale=0.5, q_scale=0.25)
    paged = setup.paged
    projected = projected_rows(WEIGHTS.qkv_a_g, (len(SEQ_LENS),), gen)
    ref_cache, start = paged.cache.clone(), paged.cache.clone()
    ref = oracle_mla(projected, WEIGHTS, DIMS, paged, ref_cache)
    splits = sm.choose_num_splits(len(SEQ_LENS), HEADS, setup.max_context)
    got = sm.mla_decode(projected, WEIGHTS, DIMS.mla, paged, DIMS.rms_norm_eps, num_splits=splits)

    assert got.dtype == torch.bfloat16 and got.shape == (len(SEQ_LENS), HEADS * DIMS.mla.v_head_dim)
    live = paged.seq_lens > 0
    assert_close(got[live], ref[live], TOL["mla_decode"], "MLA decode")
    assert not got[~live].any()
    # The inserted rows are bit-equal to the oracle's (same BF16 row, same E4M3 rounding); nothing else changes.
    assert torch.equal(paged.cache, ref_cache)
    changed = (paged.cache != start).any(dim=-1).flatten().nonzero().flatten().tolist()
    assert set(changed) <= set(paged.slot_mapping[live].tolist())


def test_split_counts_agree():
    """Split boundaries move the online-softmax tiles, not the result (beyond FP16/BF16 rounding)."""
    gen = torch.Generator().manual_seed(1)
    setup = random_paged_cache(DIMS, SEQ_LENS, 16, gen, "cpu", k_scale=1.0, q_scale=1.0)
    projected = projected_rows(WEIGHTS.qkv_a_g, (len(SEQ_LENS),), gen)
    outs = []
    for splits in (1, 2, 5):
        paged = dataclasses.replace(setup.paged, cache=setup.paged.cache.clone())
        outs.append(sm.mla_decode(projected, WEIGHTS, DIMS.mla, paged, DIMS.rms_norm_eps, num_splits=splits))
    live = setup.paged.seq_lens > 0
    for other in outs[1:]:
        assert_close(other[live], outs[0][live].float(), TOL["mla_core"], "split counts")


def test_choose_num_splits():
    """One wave of one-CTA-per-SM programs (the split kernel's occupancy, checked by the sm_90 compile test),
    whole 128-position tiles, at most MAX_SPLITS."""
    tp8, tp16 = K3.shard(8).mla_heads, K3.shard(16).mla_heads
    assert sm.choose_num_splits(1, tp8, 4096) == 32  # B1: one tile per split
    assert sm.choose_num_splits(1, tp8, 100_000) == 64  # capped
    assert sm.choose_num_splits(1, tp8, 1000) == 8  # 8 tiles
    assert sm.choose_num_splits(8, tp8, 4096) == 16  # 128 CTAs of 2 tiles
    assert sm.choose_num_splits(64, tp16, 4096) == 2  # 128 CTAs of 16 tiles
    assert sm.choose_num_splits(64, tp8, 10) == 1
    assert sm.choose_num_splits(67, tp8, 4096) == 1  # 134 programs already fill the SMs
    assert sm.choose_num_splits(2, 96, 4096) == 11  # 6 head blocks per request
    for batch in range(1, 140):
        splits = sm.choose_num_splits(batch, tp8, 131_072)
        assert batch * splits <= max(batch, sm.H200_SMS), f"B{batch}: {splits} splits overfill one wave"
    with pytest.raises(ValueError, match="must be"):
        sm.choose_num_splits(0, tp8, 10)


def test_merge_grid_fills_the_gpu_and_bounds_its_registers():
    from k3_decode.stock.triton_kernels.mla_attention import MERGE_ELEMENTS, merge_blocks

    assert merge_blocks(1, 12, 32, 512) == (64, 32)  # 96 programs, all 32 splits in one load
    assert merge_blocks(8, 12, 16, 512) == (128, 16)
    assert merge_blocks(64, 12, 2, 512) == (512, 2)
    assert merge_blocks(4, 4, 3, 64) == (64, 4)  # k3-mini: never below 64 columns
    for batch, heads, splits in [(1, 6, 64), (3, 12, 64), (64, 6, 2), (200, 12, 1)]:
        block_l, block_s = merge_blocks(batch, heads, splits, 512)
        assert block_l * block_s <= MERGE_ELEMENTS and block_s >= 2 and 512 % block_l == 0


def test_bad_input_is_rejected_with_the_reason():
    gen = torch.Generator().manual_seed(2)
    paged = random_paged_cache(DIMS, [5, 9], 16, gen, "cpu", 1.0, 1.0).paged
    projected = projected_rows(WEIGHTS.qkv_a_g, (2,), gen)
    eps = DIMS.rms_norm_eps
    with pytest.raises(ValueError, match="1-byte"):
        sm.mla_decode(projected, WEIGHTS, DIMS.mla, dataclasses.replace(paged, cache=paged.cache.float()), eps)
    with pytest.raises(ValueError, match="projection must be"):
        sm.mla_decode(projected[:, 1:], WEIGHTS, DIMS.mla, paged, eps)
    with pytest.raises(ValueError, match=r"seq_lens has shape \(3,\)"):
        sm.mla_decode(projected, WEIGHTS, DIMS.mla, dataclasses.replace(paged, seq_lens=torch.ones(3)), eps)
    with pytest.raises(ValueError, match="num_splits 0 outside"):
        sm.mla_decode(projected, WEIGHTS, DIMS.mla, paged, eps, num_splits=0)
    bf16_gate = dataclasses.replace(DIMS.mla, cache_dtype="bfloat16")
    with pytest.raises(ValueError, match="FP8 E4M3 cache"):
        sm.mla_decode(projected, WEIGHTS, bf16_gate, paged, eps)
    wrong = dataclasses.replace(WEIGHTS, q_b=WEIGHTS.q_b[:, 1:])
    with pytest.raises(ValueError, match="MLA weight q_b: shape"):
        sm.mla_decode(projected, wrong, DIMS.mla, paged, eps)
    assert math.isfinite(float(sm.mla_decode(projected, WEIGHTS, DIMS.mla, paged, eps).float().sum()))
