"""StockAttentionOps on the CPU: a whole KDA and MLA attention side against the oracle chain, the dispatch records
the ledger reads, and the op table's launch counts (the GPU test checks those against the profiler)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from k3_decode.config import K3_MINI
from k3_decode.reference import attn_res as ra
from k3_decode.reference import kda as rk
from k3_decode.stock import AttnResBuffers, OpRecord, StockAttentionOps, op_info
from k3_decode.stock.dispatch import check_implementation, op_names
from tests.k3_decode.stock.attention_helpers import (
    assert_close,
    clone_cache,
    kda_layer,
    load_tolerances,
    mla_layer,
    oracle_mla,
    random_kda_cache,
    random_paged_cache,
    reference_kda_weights,
    weights_for,
)

TOL = load_tolerances()
TP = 2
KDA_SIDE = ("attn_res", "kda_in_proj", "kda_f_b", "kda_decode", "kda_o_proj", "attn_res")
MLA_SIDE = (
    "attn_res",
    "mla_qkv_a_g",
    "mla_qkv_norm",
    "mla_q_b",
    "mla_w_uk",
    "mla_query_insert",
    "mla_attention",
    "mla_w_uv",
    "mla_gate",
    "mla_o_proj",
    "attn_res",
)


def test_kda_attention_side_matches_the_oracle_chain_and_is_recorded():
    gen = torch.Generator().manual_seed(0)
    sw = weights_for(K3_MINI, TP, "cpu")
    layer = kda_layer(K3_MINI)
    weights, residual = sw.attention(layer), sw.residual(layer)
    spec = rk.KdaSpec.for_rank(K3_MINI, TP)
    seen: list[OpRecord] = []
    ops = StockAttentionOps(K3_MINI, TP, listener=seen.append)
    batch, hidden = 4, K3_MINI.hidden_size
    bank = torch.randn(batch, 1, hidden, generator=gen).bfloat16()
    state = ra.AttnResState(torch.randn(batch, hidden, generator=gen).bfloat16(), bank)
    buffers = AttnResBuffers.from_state(state, K3_MINI.num_attn_res_blocks)
    delta = torch.randn(batch, hidden, generator=gen).bfloat16()
    cache = random_kda_cache(spec, 9, 0, gen, "cpu")
    ref_cache = clone_cache(cache)
    slots = torch.tensor([4, 0, 8, 2])

    x = ops.attn_res_before(buffers, layer, delta, residual)
    attn = ops.kda_attention(x, weights, cache, slots)
    mlp_in = ops.attn_res_after(buffers, layer, attn, residual)

    # Oracle chain with the model's BF16 rounding points: attention input, in_proj output, o_proj input/output.
    eps = K3_MINI.rms_norm_eps
    mix = ra.MixWeights(residual.attn_res.norm, residual.attn_res.proj, residual.input_norm)
    ref_x, state = ra.before_attention(state, layer, delta, mix, K3_MINI.attn_res_block_size, eps, torch.float64)
    packed = (ref_x.to(torch.bfloat16).double() @ weights.in_proj.double().T).to(torch.bfloat16)
    o = rk.kda_decode_step(spec, reference_kda_weights(weights), packed, ref_cache, slots)
    ref_attn = o.to(torch.bfloat16).double() @ weights.o_proj.double().T
    live = slots > 0
    assert_close(attn[live], ref_attn[live], TOL["kda_attention"], "KDA attention side")
    assert not attn[~live].any()
    assert mlp_in.dtype == torch.bfloat16 and mlp_in.shape == (batch, hidden)

    assert [r.op for r in ops.records] == list(KDA_SIDE)
    assert seen == ops.records
    assert all(r.implementation == "torch-cpu" and r.launches == 0 and r.batch == batch for r in seen)


def test_mla_attention_side_matches_the_oracle():
    gen = torch.Generator().manual_seed(1)
    sw = weights_for(K3_MINI, TP, "cpu")
    weights = sw.attention(mla_layer(K3_MINI))
    setup = random_paged_cache(K3_MINI, [40, 0, 17], 16, gen, "cpu", 1.0, 1.0)
    ops = StockAttentionOps(K3_MINI, TP)
    x = torch.randn(3, K3_MINI.hidden_size, generator=gen).bfloat16()
    ref_cache = setup.paged.cache.clone()
    got = ops.mla_attention(x, weights, setup.paged, ops.mla_num_splits(3, setup.max_context))
    projected = torch.nn.functional.linear(x, weights.qkv_a_g)
    ref = oracle_mla(projected, weights, K3_MINI, setup.paged, ref_cache).to(torch.bfloat16).double()
    ref = ref @ weights.o_proj.double().T
    live = setup.paged.seq_lens > 0
    assert_close(got[live], ref[live], TOL["mla_decode"], "MLA attention side")
    assert [r.op for r in ops.records] == list(MLA_SIDE[1:-1])


def test_op_table_launch_counts():
    """About 7 launches per KDA attention side and 12 per MLA side (k3_facts section 2), from the data file."""
    ops = StockAttentionOps(K3_MINI, TP)
    assert ops.expected_launches(KDA_SIDE) == 6
    assert ops.expected_launches(MLA_SIDE) == 12
    assert set(op_names()) == set(KDA_SIDE) | set(MLA_SIDE) | {"kda_verify"}
    for op in op_names():
        cuda, cpu = op_info(op, "cuda"), op_info(op, "cpu")
        assert cuda.implementation in {"triton", "cublas", "fla-core+triton"} and cuda.launches >= 1
        assert (cpu.implementation, cpu.launches, cpu.kernels) == ("torch-cpu", 0, ())
        assert cuda.vllm and cuda.fair_because
        assert (cuda.implementation == "cublas") == (cuda.kernels == ())


def test_bad_configuration_is_rejected():
    with pytest.raises(ValueError, match="needs CUDA tensors; use 'torch-cpu' on the CPU"):
        StockAttentionOps(K3_MINI, TP, implementation="triton")
    with pytest.raises(ValueError, match="unknown stock implementation 'cuda'"):
        check_implementation("cuda", "cpu")
    with pytest.raises(ValueError, match="TP=3 is not supported"):
        StockAttentionOps(K3_MINI, 3)
    with pytest.raises(ValueError, match=r"unknown stock op 'kda' in attention_ops\.toml"):
        op_info("kda", "cpu")
    assert dataclasses.is_dataclass(StockAttentionOps)
