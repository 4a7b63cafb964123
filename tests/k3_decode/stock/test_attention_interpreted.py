"""The stock path's Triton kernels (and fla-core's recurrent KDA kernel) run under Triton's CPU interpreter at
k3-mini dims and are compared with the oracles.

The interpreter must be chosen before Triton is imported, so the one test collected in a normal run starts a
subprocess that runs this file with TRITON_INTERPRET=1; the kernel tests are skipped everywhere else. Two
interpreter defects (Triton 3.9) shape the checks, see the [interpreter] table of attention_tolerances.toml:
FP32 -> BF16 conversions truncate, and an E4M3 conversion that rounds up across a power of two loses the carry,
so the FP8 kernels get E4M3-representable inputs here and bit-exactness on random inputs is checked on the GPU.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from k3_decode.config import K3_MINI
from k3_decode.reference import attn_res as ra
from k3_decode.reference import kda as rk
from k3_decode.reference import mla as rm
from k3_decode.reference.norms import rms_norm
from k3_decode.stock import attn_res as sa
from k3_decode.stock import kda as sk
from tests.k3_decode.stock.attention_helpers import (
    assert_close,
    clone_cache,
    kda_layer,
    load_tolerances,
    projected_rows,
    random_kda_cache,
    random_paged_cache,
    reference_kda_weights,
    weights_for,
)

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
REPO = Path(__file__).resolve().parents[3]
TOL = load_tolerances()
TOLI = load_tolerances("interpreter")
TP = 2
interpreted = pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 subprocess")
INTERPRETED_TESTS = 11  # kernel tests (parametrized cases counted) the interpreted run must pass


@pytest.mark.slow
@pytest.mark.skipif(INTERPRETED, reason="this is the launcher of the interpreted run")
def test_triton_kernels_under_the_cpu_interpreter():
    pytest.importorskip("triton", reason="Triton is needed for its CPU interpreter")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", str(Path(__file__))]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    report = f"{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, f"interpreted kernel tests failed:\n{report}"
    passed = re.search(r"(\d+) passed", proc.stdout)
    # Every kernel test must have run there; only this launcher is skipped in the child.
    assert passed and int(passed.group(1)) == INTERPRETED_TESTS, report


@interpreted
def test_interpreted_attn_res_kernel(monkeypatch):
    from k3_decode.stock.triton_kernels import attn_res as kernel

    monkeypatch.setattr(kernel, "BLOCK_H_MAX", 64)  # 4 chunks per row, as a K3 row takes 7
    gen = torch.Generator().manual_seed(0)
    sw = weights_for(K3_MINI, TP, "cpu")
    tokens, hidden, bs, eps = 3, K3_MINI.hidden_size, K3_MINI.attn_res_block_size, K3_MINI.rms_norm_eps
    state = ra.init_state(torch.randn(tokens, hidden, generator=gen).bfloat16())
    buffers = sa.AttnResBuffers.from_state(state, K3_MINI.num_attn_res_blocks)
    delta = None
    for layer in range(5):  # block writes at 0 and 3, a restart after each
        res = sw.residual(layer)
        before = ra.MixWeights(res.attn_res.norm, res.attn_res.proj, res.input_norm)
        ref, state = ra.before_attention(state, layer, delta, before, bs, eps, torch.float64)
        got = sa.before_attention(buffers, layer, delta, before, bs, eps, implementation="triton")
        assert_close(got, ref, TOLI["attn_res"], f"interpreted AttnRes before layer {layer}")
        assert_close(buffers.prefix, state.prefix, TOLI["prefix"], "prefix")
        assert buffers.num_blocks == state.num_blocks
        attn_out = torch.randn(tokens, hidden, generator=gen).bfloat16()
        after = ra.MixWeights(res.mlp_res.norm, res.mlp_res.proj, res.post_attn_norm)
        ref, state = ra.after_attention(state, layer, attn_out, after, bs, eps, torch.float64)
        got = sa.after_attention(buffers, layer, attn_out, after, bs, eps, implementation="triton")
        assert_close(got, ref, TOLI["attn_res"], f"interpreted AttnRes after layer {layer}")
        assert_close(buffers.blocks[:, : buffers.num_blocks], state.blocks, TOLI["prefix"], "bank")
        delta = torch.randn(tokens, hidden, generator=gen).bfloat16()
    # Stop the stack after layer 4 (a bank of 2 blocks) and run the final mixing, which has no output norm.
    final_res = sw.model().final_res
    final = ra.MixWeights(final_res.norm, final_res.proj, None)
    ref = ra.final(state, delta, 5, final, bs, eps, torch.float64)
    got = sa.final(buffers, delta, 5, final, bs, eps, implementation="triton")
    assert_close(got, ref, TOLI["attn_res"], "interpreted final AttnRes")


@interpreted
def test_interpreted_kda_decode_kernel(monkeypatch):
    from k3_decode.stock.triton_kernels import kda_decode

    monkeypatch.setattr(kda_decode, "STATE_ROWS", 8)  # 4 state chunks per head, as a K3 head takes 4
    gen = torch.Generator().manual_seed(1)
    spec = rk.KdaSpec.for_rank(K3_MINI, TP)
    weights = weights_for(K3_MINI, TP, "cpu").attention(kda_layer(K3_MINI))
    cache = random_kda_cache(spec, 8, 0, gen, "cpu")
    start, ref_cache = clone_cache(cache), clone_cache(cache)
    slots = torch.tensor([6, 0, 3, -1, 1])
    packed = projected_rows(weights.in_proj, (5,), gen)
    ref = rk.kda_decode_step(spec, reference_kda_weights(weights), packed, ref_cache, slots)
    got = sk.kda_decode_step(spec, weights, packed, cache, slots, implementation="triton")
    live = slots > 0
    assert_close(got[live], ref[live], TOLI["kda_decode"], "interpreted KDA decode")
    assert not got[~live].any()
    assert_close(cache.recurrent[slots[live]], ref_cache.recurrent[slots[live]], TOL["kda_decode_state"], "state")
    assert torch.equal(cache.conv, ref_cache.conv)
    for s in (0, 2, 4, 5, 7):
        assert torch.equal(cache.recurrent[s], start.recurrent[s]) and torch.equal(cache.conv[s], start.conv[s])


@interpreted
def test_interpreted_kda_verify_kernels_with_fla(monkeypatch):
    pytest.importorskip("fla", reason="fla-core provides the verify recurrence")
    from k3_decode.stock.triton_kernels import kda_verify

    monkeypatch.setattr(kda_verify, "SCATTER_BLOCK", 256)  # 4 chunks per head state, as a K3 head takes 4
    gen = torch.Generator().manual_seed(2)
    spec = rk.KdaSpec.for_rank(K3_MINI, TP)
    weights = weights_for(K3_MINI, TP, "cpu").attention(kda_layer(K3_MINI))
    q, batch, num_slots = 3, 3, 16
    cache = random_kda_cache(spec, num_slots, q - 1, gen, "cpu")
    start, ref_cache = clone_cache(cache), clone_cache(cache)
    slots = torch.tensor([[4, 9, 2], [-1, 13, 14], [7, 11, 0]])  # request 1 is NULL: 13 and 14 stay untouched
    accepted = torch.tensor([3, 1, 2])
    packed = projected_rows(weights.in_proj, (batch, q), gen)
    ref = rk.kda_verify_step(spec, reference_kda_weights(weights), packed, ref_cache, slots, accepted)
    got = sk.kda_verify_step(spec, weights, packed, cache, slots, accepted, implementation="triton")
    assert_close(got[[0, 2]], ref[[0, 2]], TOLI["kda_verify"], "interpreted KDA verify")
    assert not got[1].any()
    states = [4, 9, 2, 7, 11]
    assert_close(cache.recurrent[states], ref_cache.recurrent[states], TOLI["kda_verify_state"], "verify states")
    assert torch.equal(cache.conv, ref_cache.conv)
    for s in set(range(num_slots)) - set(states):
        assert torch.equal(cache.recurrent[s], start.recurrent[s]), f"state slot {s} changed"


def _split_kv(query, paged, num_splits: int, heads: int):
    from k3_decode.stock.triton_kernels.mla_attention import launch_split_kv

    mla = K3_MINI.mla
    batch = query.shape[0]
    part_out = torch.full((batch, num_splits, heads, mla.kv_lora_rank), float("nan"))
    part_lse = torch.full((batch, num_splits, heads), float("nan"))
    launch_split_kv(
        query,
        paged.cache,
        paged.block_table,
        paged.seq_lens,
        part_out,
        part_lse,
        kv_lora_rank=mla.kv_lora_rank,
        score_scale=0.25 * 0.5 * rm.softmax_scale(mla),
        value_scale=0.5,
    )
    return part_out, part_lse


# Contexts of 1, of exactly one page and one tile, one past a tile, a padded request (0), and long ones whose
# splits start and end inside pages and tiles; with 16-position tiles (the kernel's 128 shrunk, so a request takes
# as many tiles as a K3 context) and pages of 1, 8 (two per tile), 16 and 32 (two tiles per page).
MLA_LENS = [1, 16, 17, 0, 200, 33, 129]


@interpreted
@pytest.mark.parametrize(
    ("page_size", "num_splits", "block_h"),
    [(8, 1, 16), (8, 3, 16), (32, 5, 16), (16, 2, 2), (1, 64, 16)],
)
def test_interpreted_mla_split_kv_partials_and_merge(monkeypatch, page_size: int, num_splits: int, block_h: int):
    """Every split's partial (out, lse) against the oracle over the split's own positions, the split ranges
    taken from the torch mirror's rule (so kernel and mirror cannot drift apart), empty splits exactly (0, -inf),
    and the merged latent against the oracle; block_h 2 runs the TP=2 heads in two head blocks."""
    from k3_decode.stock import mla as sm
    from k3_decode.stock.triton_kernels import mla_attention as ka

    monkeypatch.setattr(ka, "BLOCK_N", 16)
    monkeypatch.setattr(ka, "BLOCK_H", block_h)
    monkeypatch.setattr(sm, "POSITIONS_PER_TILE", 16)
    gen = torch.Generator().manual_seed(3 + page_size + num_splits)
    mla = K3_MINI.mla
    heads = K3_MINI.shard(TP).mla_heads
    lens = [page_size if n == 33 else n for n in MLA_LENS]  # one request of exactly one page
    paged = random_paged_cache(K3_MINI, lens, page_size, gen, "cpu", k_scale=0.5, q_scale=0.25).paged
    query = rm.quantize_e4m3(torch.randn(len(lens), heads, mla.cache_row, generator=gen) * 2, 0.25)
    part_out, part_lse = _split_kv(query, paged, num_splits, heads)
    dequant = rm.dequantize_e4m3(query, 0.25)
    scale = rm.softmax_scale(mla)
    starts, ends = sm._split_ranges(paged.seq_lens, num_splits)  # [B, S]
    got, want, got_lse, want_lse = [], [], [], []
    for j in range(num_splits):
        bounds = torch.stack([starts[:, j], ends[:, j]], dim=-1)
        out_j, lse_j = rm.attend_partial(
            dequant, paged.cache, paged.block_table, paged.seq_lens, 0.5, scale, mla.kv_lora_rank, bounds
        )
        live = ends[:, j] > starts[:, j]
        assert torch.equal(part_out[~live, j], torch.zeros_like(part_out[~live, j])), f"empty split {j}: out != 0"
        assert torch.isneginf(part_lse[~live, j]).all(), f"empty split {j}: lse != -inf"
        got.append(part_out[live, j])
        want.append(out_j[live])
        got_lse.append(part_lse[live, j])
        want_lse.append(lse_j[live])
    assert_close(torch.cat(got), torch.cat(want), TOL["mla_core"], f"split partials, {num_splits} splits")
    torch.testing.assert_close(torch.cat(got_lse), torch.cat(want_lse), rtol=1e-5, atol=1e-5)
    assert int(sum(len(g) for g in got)) >= min(num_splits, 13) * 2, "the cells must have several live splits"

    merged = torch.empty(heads, len(lens), mla.kv_lora_rank, dtype=torch.bfloat16)
    ka.launch_merge(part_out, part_lse, merged)
    ref, _ = rm.attend(dequant, paged.cache, paged.block_table, paged.seq_lens, 0.5, scale, mla.kv_lora_rank)
    live = paged.seq_lens > 0
    got_merged = merged.transpose(0, 1)
    assert_close(got_merged[live], ref[live], TOLI["mla_core"], f"interpreted split-KV, {num_splits} splits")
    assert not got_merged[~live].any()


@interpreted
def test_interpreted_mla_merge_is_a_fixed_order_lse_merge(monkeypatch):
    """The merge on synthetic partials: 37 splits read in chunks of 8 (a partial last chunk) and a 256-wide latent
    in 64-wide programs; empty splits (-inf) anywhere, one request with every split empty (exactly 0), LSEs near
    800 (exp without the max subtracted overflows FP32), the winning split last; bit-identical on a rerun."""
    from k3_decode.stock.triton_kernels import mla_attention as ka

    monkeypatch.setattr(ka, "MERGE_ELEMENTS", 512)
    gen = torch.Generator().manual_seed(6)
    batch, splits, heads, latent = 3, 37, 4, 256
    assert ka.merge_blocks(batch, heads, splits, latent) == (64, 8)
    outs = torch.randn(batch, splits, heads, latent, generator=gen)
    lses = torch.randn(batch, splits, heads, generator=gen) * 3
    lses[0] += 800.0
    lses[0, -1] += 6.0  # the last split dominates request 0
    empty = torch.rand(batch, splits, heads, generator=gen) < 0.3
    empty[2] = True  # request 2: nothing to attend to
    lses[empty] = float("-inf")
    outs[empty] = 0.0  # what the split kernel writes for an empty split
    merged = torch.empty(heads, batch, latent, dtype=torch.bfloat16)
    ka.launch_merge(outs, lses, merged)
    ref, _ = rm.merge_partials(outs.double().permute(1, 0, 2, 3), lses.double().transpose(0, 1))
    got = merged.transpose(0, 1)
    assert_close(got[:2], ref[:2], TOLI["bf16_elementwise"], "merge")
    assert torch.equal(got[2], torch.zeros_like(got[2]))
    again = torch.empty_like(merged)
    ka.launch_merge(outs, lses, again)
    assert torch.equal(again, merged)


@interpreted
def test_interpreted_mla_query_insert_is_bit_exact():
    from k3_decode.stock.triton_kernels.mla import launch_query_insert

    gen = torch.Generator().manual_seed(4)
    mla = K3_MINI.mla
    heads, batch = K3_MINI.shard(TP).mla_heads, 3
    q_scale, k_scale = 0.25, 0.5

    def representable(*shape: int, scale: float) -> torch.Tensor:
        # E4M3 values times the scale: the conversion back is exact, whatever the interpreter's rounding.
        return (torch.randn(*shape, generator=gen) * 3).to(torch.float8_e4m3fn).float().mul(scale).bfloat16()

    ql_nope = representable(heads, batch, mla.kv_lora_rank, scale=q_scale)
    q = representable(batch, heads * mla.qk_head_dim, scale=q_scale)
    kv_c = representable(batch, mla.kv_lora_rank, scale=k_scale)
    width = mla.q_lora_rank + mla.cache_row + heads * mla.v_head_dim
    projected = representable(batch, width, scale=k_scale)
    cache = torch.zeros(4, 8, mla.cache_row, dtype=torch.uint8)
    slot_mapping = torch.tensor([17, -1, 2])
    query = torch.empty(batch, heads, mla.cache_row, dtype=torch.uint8)
    launch_query_insert(
        ql_nope,
        q,
        kv_c,
        projected,
        slot_mapping,
        query,
        cache,
        nope=mla.qk_nope_head_dim,
        k_pe_offset=mla.q_lora_rank + mla.kv_lora_rank,
        q_scale=q_scale,
        k_scale=k_scale,
    )
    q_pe = q.view(batch, heads, mla.qk_head_dim)[..., mla.qk_nope_head_dim :]
    assert torch.equal(query, rm.quantize_e4m3(torch.cat([ql_nope.transpose(0, 1), q_pe], dim=-1), q_scale))
    rope = projected[:, mla.q_lora_rank + mla.kv_lora_rank : mla.q_lora_rank + mla.cache_row]
    expected = torch.zeros_like(cache)
    rm.insert_kv(expected, torch.cat([kv_c, rope], dim=-1).float(), slot_mapping, k_scale)
    assert torch.equal(cache, expected)


@interpreted
def test_interpreted_mla_norm_and_gate_kernels():
    from k3_decode.stock.triton_kernels.mla import launch_qkv_norm, launch_sigmoid_gate

    gen = torch.Generator().manual_seed(5)
    mla, eps = K3_MINI.mla, K3_MINI.rms_norm_eps
    heads, batch = K3_MINI.shard(TP).mla_heads, 4
    width = mla.q_lora_rank + mla.cache_row + heads * mla.v_head_dim
    projected = (torch.randn(batch, width, generator=gen) * 2).bfloat16()
    q_w = (1 + 0.1 * torch.randn(mla.q_lora_rank, generator=gen)).bfloat16()
    kv_w = (1 + 0.1 * torch.randn(mla.kv_lora_rank, generator=gen)).bfloat16()
    q_out = torch.empty(batch, mla.q_lora_rank, dtype=torch.bfloat16)
    kv_out = torch.empty(batch, mla.kv_lora_rank, dtype=torch.bfloat16)
    launch_qkv_norm(projected, q_w, kv_w, q_out, kv_out, eps=eps)
    tol = TOLI["bf16_elementwise"]
    assert_close(q_out, rms_norm(projected[:, : mla.q_lora_rank], q_w, eps, torch.float64), tol, "q_a norm")
    kv_ref = rms_norm(projected[:, mla.q_lora_rank : mla.q_lora_rank + mla.kv_lora_rank], kv_w, eps, torch.float64)
    assert_close(kv_out, kv_ref, tol, "kv_c norm")

    v = torch.randn(heads, batch, mla.v_head_dim, generator=gen).bfloat16()
    gate = projected[:, mla.q_lora_rank + mla.cache_row :]
    out = torch.empty(batch, heads * mla.v_head_dim, dtype=torch.bfloat16)
    launch_sigmoid_gate(v, gate, out)
    ref = rm.value_and_gate(v.transpose(0, 1).double(), torch.eye(mla.v_head_dim).expand(heads, -1, -1), gate)
    assert_close(out, ref, tol, "sigmoid gate")
