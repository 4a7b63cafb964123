"""GPU tests of the stock attention side at real Kimi K3 per-rank shapes (TP8, TP16; B = 1, 8, 64): the Triton
and cuBLAS ops against the oracles, CUDA-graph capture, and the launches per attention side counted with
torch.profiler next to the op table. The launch test also times each side (kernel time and graph replay) and
reports it against the HBM roofline, with the copy bandwidth measured in the same run; with K3_STOCK_RESULTS set
to a folder it writes stock-attention-h200.json there.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from collections.abc import Callable
from functools import cache
from pathlib import Path

import pytest
import torch
from torch import Tensor

from k3_decode.config import K3
from k3_decode.reference import attn_res as ra
from k3_decode.reference import kda as rk
from k3_decode.reference import mla as rm
from k3_decode.stock import AttnResBuffers, StockAttentionOps, op_info
from k3_decode.stock import attn_res as sa
from k3_decode.stock import kda as sk
from k3_decode.stock import mla as sm
from tests.k3_decode.stock.attention_helpers import (
    assert_close,
    clone_cache,
    error_metrics,
    load_tolerances,
    oracle_mla,
    projected_rows,
    random_kda_cache,
    random_paged_cache,
    reference_kda_weights,
    weights_for,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TOL = load_tolerances()
DEV = "cuda"
KDA_LAYER, MLA_LAYER = 13, 3  # a KDA layer right after a block write (bank of 2) and the first MLA layer
BATCHES = (1, 8, 64)
PAGE_SIZE = 64
MEASURED: dict[str, dict] = {}  # filled by the launch test, written at module teardown


@cache
def layer_weights(tp: int, layer: int):
    return weights_for(K3, tp, DEV).attention(layer)


@cache
def residual_weights(layer: int):
    return weights_for(K3, 8, DEV).residual(layer)


def check(got: Tensor, ref: Tensor, tol, what: str) -> None:
    """assert_close, printing the measured errors so a passing run still reports its margins."""
    rms_rel, peak_rel = assert_close(got, ref, tol, what)
    print(f"METRIC {what}: rms_rel {rms_rel:.2e} (tol {tol.rms_rel:g}), peak_rel {peak_rel:.2e} (tol {tol.peak_rel:g})")


def kda_spec(tp: int) -> rk.KdaSpec:
    return rk.KdaSpec.for_rank(K3, tp)


def slot_table(batch: int, num_slots: int, gen: torch.Generator) -> Tensor:
    """Distinct live slots, with NULL padding (0 and -1) at the end of the bigger batches, as CUDA graphs pad."""
    slots = torch.randperm(num_slots - 1, generator=gen)[:batch] + 1
    if batch >= 8:
        slots[-2:] = torch.tensor([0, -1])
    return slots.to(DEV)


def untouched_except(before: Tensor, after: Tensor, written: Tensor) -> None:
    keep = torch.ones(before.shape[0], dtype=torch.bool, device=before.device)
    keep[written] = False
    assert torch.equal(before[keep], after[keep]), "a slot outside the write set changed"


# --- AttnRes ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("batch", BATCHES)
def test_attn_res_kernel_at_k3_width(batch: int):
    gen = torch.Generator().manual_seed(batch)
    hidden, bs, eps = K3.hidden_size, K3.attn_res_block_size, K3.rms_norm_eps
    state = ra.AttnResState(
        torch.randn(batch, hidden, generator=gen).bfloat16().to(DEV),
        torch.randn(batch, 1, hidden, generator=gen).bfloat16().to(DEV),
    )
    buffers = AttnResBuffers.from_state(state, K3.num_attn_res_blocks)
    for layer in (12, 13):  # a block write with its restart, then a plain layer
        res = residual_weights(layer)
        before = ra.MixWeights(res.attn_res.norm, res.attn_res.proj, res.input_norm)
        after = ra.MixWeights(res.mlp_res.norm, res.mlp_res.proj, res.post_attn_norm)
        delta = torch.randn(batch, hidden, generator=gen).to(DEV)  # an FP32 sum of partials
        ref, state = ra.before_attention(state, layer, delta, before, bs, eps, torch.float64)
        got = sa.before_attention(buffers, layer, delta, before, bs, eps)
        check(got, ref, TOL["attn_res"], f"AttnRes before layer {layer}, B{batch}")
        attn_out = torch.randn(batch, hidden, generator=gen).bfloat16().to(DEV)
        ref, state = ra.after_attention(state, layer, attn_out, after, bs, eps, torch.float64)
        got = sa.after_attention(buffers, layer, attn_out, after, bs, eps)
        check(got, ref, TOL["attn_res"], f"AttnRes after layer {layer}, B{batch}")
        assert torch.equal(buffers.prefix, state.prefix), "prefix must be bit-equal (same FP32 add, RTNE)"
        assert torch.equal(buffers.blocks[:, : buffers.num_blocks], state.blocks)
    # The final mixing over a full bank of 8 blocks (K3: 93 layers, block 12), no output norm.
    bank = torch.randn(batch, 8, hidden, generator=gen).bfloat16().to(DEV)
    full = ra.AttnResState(state.prefix, bank)
    buffers = AttnResBuffers.from_state(full, 8)
    other = residual_weights(13).mlp_res  # any AttnRes weights will do; the model's own need the vocab tables
    mix = ra.MixWeights(other.norm, other.proj, None)
    delta = torch.randn(batch, hidden, generator=gen).bfloat16().to(DEV)
    ref = ra.final(full, delta, K3.num_layers, mix, bs, eps, torch.float64)
    got = sa.final(buffers, delta, K3.num_layers, mix, bs, eps)
    check(got, ref, TOL["attn_res"], f"final AttnRes, B{batch}")


# --- KDA --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tp", [8, 16])
@pytest.mark.parametrize("batch", BATCHES)
def test_kda_decode_kernel(tp: int, batch: int):
    gen = torch.Generator().manual_seed(tp * 100 + batch)
    spec, weights = kda_spec(tp), layer_weights(tp, KDA_LAYER)
    cache_ = random_kda_cache(spec, 2 * batch + 2, 0, gen, DEV)
    start, ref_cache = clone_cache(cache_), clone_cache(cache_)
    slots = slot_table(batch, cache_.num_slots, gen)
    packed = projected_rows(weights.in_proj, (batch,), gen)
    ref = rk.kda_decode_step(spec, reference_kda_weights(weights), packed, ref_cache, slots)
    got = sk.kda_decode_step(spec, weights, packed, cache_, slots)
    live = slots > 0
    check(got[live], ref[live], TOL["kda_decode"], f"KDA decode TP{tp} B{batch}")
    assert not got[~live].any()
    written = slots[live]
    check(cache_.recurrent[written], ref_cache.recurrent[written], TOL["kda_decode_state"], "KDA state")
    assert torch.equal(cache_.conv, ref_cache.conv)
    untouched_except(start.recurrent, cache_.recurrent, written)
    untouched_except(start.conv, cache_.conv, written)


@pytest.mark.parametrize("tp", [8, 16])
@pytest.mark.parametrize(("batch", "q"), [(1, 4), (8, 4), (8, 8), (64, 4)])
def test_kda_verify_with_fla(tp: int, batch: int, q: int):
    pytest.importorskip("fla", reason="fla-core provides the verify recurrence")
    gen = torch.Generator().manual_seed(tp * 1000 + batch * 10 + q)
    spec, weights = kda_spec(tp), layer_weights(tp, KDA_LAYER)
    num_slots = batch * q + 2
    cache_ = random_kda_cache(spec, num_slots, q - 1, gen, DEV)
    start, ref_cache = clone_cache(cache_), clone_cache(cache_)
    slots = (torch.randperm(num_slots - 1, generator=gen)[: batch * q] + 1).view(batch, q)
    accepted = torch.randint(1, q + 1, (batch,), generator=gen)
    if batch >= 8:
        slots[-1, 0] = 0  # a NULL request (its later slots stay untouched)
        slots[0, -1] = -1  # a live request without a slot for its last token
        accepted[0] = min(int(accepted[0]), q - 1)
    slots, accepted = slots.to(DEV), accepted.to(DEV)
    packed = projected_rows(weights.in_proj, (batch, q), gen)
    ref = rk.kda_verify_step(spec, reference_kda_weights(weights), packed, ref_cache, slots, accepted)
    got = sk.kda_verify_step(spec, weights, packed, cache_, slots, accepted)
    live = slots[:, 0] > 0
    check(got[live], ref[live], TOL["kda_verify"], f"KDA verify TP{tp} B{batch} q{q}")
    assert not got[~live].any()
    states = torch.tensor(sorted(w.slot for w in rk.verify_write_set(slots.cpu()) if w.tensor == "recurrent"))
    check(cache_.recurrent[states], ref_cache.recurrent[states], TOL["kda_verify_state"], "verify states")
    assert torch.equal(cache_.conv, ref_cache.conv)
    untouched_except(start.recurrent, cache_.recurrent, states.to(DEV))
    untouched_except(start.conv, cache_.conv, slots[live, 0])


# --- MLA --------------------------------------------------------------------------------------------------------


def context_lengths(batch: int, gen: torch.Generator) -> list[int]:
    lens = torch.randint(1, 2048, (batch,), generator=gen).tolist()
    if batch >= 8:
        lens[-1] = 0  # a padded request
    return lens


@pytest.mark.parametrize("tp", [8, 16])
@pytest.mark.parametrize("batch", BATCHES)
def test_mla_decode(tp: int, batch: int):
    gen = torch.Generator().manual_seed(tp * 10 + batch)
    weights = layer_weights(tp, MLA_LAYER)
    setup = random_paged_cache(K3, context_lengths(batch, gen), PAGE_SIZE, gen, DEV, k_scale=0.5, q_scale=0.25)
    paged = setup.paged
    projected = projected_rows(weights.qkv_a_g, (batch,), gen)
    ref_cache, start = paged.cache.clone(), paged.cache.clone()
    ref = oracle_mla(projected, weights, K3, paged, ref_cache)
    splits = sm.choose_num_splits(batch, weights.w_uk.shape[0], setup.max_context)
    got = sm.mla_decode(projected, weights, K3.mla, paged, K3.rms_norm_eps, num_splits=splits)
    live = paged.seq_lens > 0
    check(got[live], ref[live], TOL["mla_decode"], f"MLA decode TP{tp} B{batch} ({splits} splits)")
    assert not got[~live].any()
    changed = (paged.cache != start).any(dim=-1).flatten().nonzero().flatten()
    assert set(changed.tolist()) <= set(paged.slot_mapping[live].tolist()), "a row outside the new tokens changed"
    # The row is normed in FP32 and rounded to BF16 on both sides; a different summation order may move a BF16
    # value by an ulp and, rarely, its E4M3 code by one step.
    rows = paged.slot_mapping[live].long()
    got_rows = paged.cache.view(-1, K3.mla.cache_row)[rows].view(torch.int8).int()
    ref_rows = ref_cache.view(-1, K3.mla.cache_row)[rows].view(torch.int8).int()
    assert float((got_rows != ref_rows).float().mean()) < 1e-2
    assert int((got_rows - ref_rows).abs().max()) <= 1


# Contexts the split-KV core must handle besides the random ones: 1, one page, one tile (128), one past a tile, a
# split boundary inside a page, and long contexts of many tiles per split (65537: 513 tiles, 64 splits at B1).
EDGE_CONTEXTS = {1: [65537], 3: [1, 128, 129], 5: [64, 4097, 1, 0, 70000]}


@pytest.mark.parametrize("lens", list(EDGE_CONTEXTS.values()), ids=[f"b{b}" for b in EDGE_CONTEXTS])
def test_mla_split_kv_core_at_edge_and_long_contexts(lens: list[int]):
    """The split kernel's partials and the merge at K3 TP8 shapes on contexts from 1 to 70000 tokens, pages of
    64 shuffled: against the oracle, and bit-equal across two runs (the fixed-order merge, no atomics)."""
    from k3_decode.stock.triton_kernels.mla_attention import launch_merge, launch_split_kv

    gen = torch.Generator().manual_seed(len(lens))
    mla, heads = K3.mla, K3.shard(8).mla_heads
    setup = random_paged_cache(K3, lens, PAGE_SIZE, gen, DEV, k_scale=0.5, q_scale=0.25)
    paged = setup.paged
    query = rm.quantize_e4m3(torch.randn(len(lens), heads, mla.cache_row, generator=gen) * 2, 0.25).to(DEV)
    scale = rm.softmax_scale(mla)
    splits = sm.choose_num_splits(len(lens), heads, setup.max_context)
    outs = []
    for _ in range(2):
        part_out = torch.empty(len(lens), splits, heads, mla.kv_lora_rank, device=DEV)
        part_lse = torch.empty(len(lens), splits, heads, device=DEV)
        launch_split_kv(
            query,
            paged.cache,
            paged.block_table,
            paged.seq_lens,
            part_out,
            part_lse,
            kv_lora_rank=mla.kv_lora_rank,
            score_scale=0.25 * 0.5 * scale,
            value_scale=0.5,
        )
        merged = torch.empty(heads, len(lens), mla.kv_lora_rank, dtype=torch.bfloat16, device=DEV)
        launch_merge(part_out, part_lse, merged)
        outs.append(merged)
    assert torch.equal(outs[0], outs[1]), "two runs of split-KV + merge differ"
    ref, ref_lse = rm.attend(
        rm.dequantize_e4m3(query, 0.25), paged.cache, paged.block_table, paged.seq_lens, 0.5, scale, mla.kv_lora_rank
    )
    live = paged.seq_lens > 0
    check(outs[0].transpose(0, 1)[live], ref[live], TOL["mla_core"], f"MLA core {lens} ({splits} splits)")
    assert not outs[0].transpose(0, 1)[~live].any()
    lse = torch.logsumexp(part_lse, dim=1)
    assert torch.allclose(lse[live], ref_lse[live], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("batch", BATCHES)
def test_mla_core_and_query_insert_kernels(batch: int):
    from k3_decode.stock.triton_kernels.mla import launch_query_insert
    from k3_decode.stock.triton_kernels.mla_attention import launch_merge, launch_split_kv

    gen = torch.Generator().manual_seed(batch)
    mla, heads = K3.mla, K3.shard(8).mla_heads
    setup = random_paged_cache(K3, context_lengths(batch, gen), PAGE_SIZE, gen, DEV, k_scale=0.5, q_scale=0.25)
    paged = setup.paged
    # Query build and cache insert on random BF16 inputs: bit-equal to the oracle's quantization.
    ql_nope = (torch.randn(heads, batch, mla.kv_lora_rank, generator=gen) * 3).bfloat16().to(DEV)
    q = (torch.randn(batch, heads * mla.qk_head_dim, generator=gen) * 3).bfloat16().to(DEV)
    kv_c = torch.randn(batch, mla.kv_lora_rank, generator=gen).bfloat16().to(DEV)
    projected = torch.randn(batch, mla.q_lora_rank + mla.cache_row + heads * mla.v_head_dim, generator=gen)
    projected = projected.bfloat16().to(DEV)
    query = torch.empty(batch, heads, mla.cache_row, dtype=torch.uint8, device=DEV)
    ref_cache = paged.cache.clone()
    launch_query_insert(
        ql_nope,
        q,
        kv_c,
        projected,
        paged.slot_mapping,
        query,
        paged.cache,
        nope=mla.qk_nope_head_dim,
        k_pe_offset=mla.q_lora_rank + mla.kv_lora_rank,
        q_scale=0.25,
        k_scale=0.5,
    )
    q_pe = q.view(batch, heads, mla.qk_head_dim)[..., mla.qk_nope_head_dim :]
    assert torch.equal(query, rm.quantize_e4m3(torch.cat([ql_nope.transpose(0, 1), q_pe], dim=-1), 0.25))
    rope = projected[:, mla.q_lora_rank + mla.kv_lora_rank : mla.q_lora_rank + mla.cache_row]
    rm.insert_kv(ref_cache, torch.cat([kv_c, rope], dim=-1).float(), paged.slot_mapping, 0.5)
    assert torch.equal(paged.cache, ref_cache)
    # Split-KV core and merge on those FP8 inputs.
    scale = rm.softmax_scale(mla)
    splits = sm.choose_num_splits(batch, heads, setup.max_context)
    part_out = torch.empty(batch, splits, heads, mla.kv_lora_rank, device=DEV)
    part_lse = torch.empty(batch, splits, heads, device=DEV)
    launch_split_kv(
        query,
        paged.cache,
        paged.block_table,
        paged.seq_lens,
        part_out,
        part_lse,
        kv_lora_rank=mla.kv_lora_rank,
        score_scale=0.25 * 0.5 * scale,
        value_scale=0.5,
    )
    merged = torch.empty(heads, batch, mla.kv_lora_rank, dtype=torch.bfloat16, device=DEV)
    launch_merge(part_out, part_lse, merged)
    ref, ref_lse = rm.attend(
        rm.dequantize_e4m3(query, 0.25), paged.cache, paged.block_table, paged.seq_lens, 0.5, scale, mla.kv_lora_rank
    )
    live = paged.seq_lens > 0
    check(merged.transpose(0, 1)[live], ref[live], TOL["mla_core"], f"MLA core B{batch} ({splits} splits)")
    lse = torch.logsumexp(part_lse, dim=1)
    assert torch.allclose(lse[live], ref_lse[live], rtol=1e-4, atol=1e-4)


# --- whole attention sides: CUDA graphs, launches, time -----------------------------------------------------------


class Side:
    """One decode step of a layer's attention side (AttnRes, attention, AttnRes) on static buffers."""

    def __init__(self, kind: str, tp: int, batch: int):
        gen = torch.Generator().manual_seed(7)
        self.kind, self.tp, self.batch = kind, tp, batch
        self.ops = StockAttentionOps(K3, tp, DEV, validate=False)
        layer = KDA_LAYER if kind == "kda" else MLA_LAYER
        self.layer = layer
        self.weights = layer_weights(tp, layer)
        self.residual = residual_weights(layer)
        hidden, blocks = K3.hidden_size, K3.blocks_before(layer - 1)
        self.buffers = AttnResBuffers.allocate(batch, hidden, K3.num_attn_res_blocks, DEV)
        self.buffers.prefix.copy_(torch.randn(batch, hidden, generator=gen).bfloat16())
        self.buffers.blocks[:, :blocks].copy_(torch.randn(batch, blocks, hidden, generator=gen).bfloat16())
        self.buffers.num_blocks = blocks
        self.delta = torch.randn(batch, hidden, generator=gen).bfloat16().to(DEV)
        if kind == "kda":
            self.cache = random_kda_cache(kda_spec(tp), batch + 1, 0, gen, DEV)
            self.slots = torch.arange(1, batch + 1, device=DEV)
        else:
            self.setup = random_paged_cache(K3, [2048] * batch, PAGE_SIZE, gen, DEV, 1.0, 1.0)
            self.splits = self.ops.mla_num_splits(batch, self.setup.max_context)

    def step(self) -> Tensor:
        x = self.ops.attn_res_before(self.buffers, self.layer, self.delta, self.residual)
        if self.kind == "kda":
            attn = self.ops.kda_attention(x, self.weights, self.cache, self.slots)
        else:
            attn = self.ops.mla_attention(x, self.weights, self.setup.paged, self.splits)
        return self.ops.attn_res_after(self.buffers, self.layer, attn, self.residual)

    def snapshot(self) -> list[Tensor]:
        state = [self.buffers.prefix, self.buffers.blocks]
        state += [self.cache.conv, self.cache.recurrent] if self.kind == "kda" else [self.setup.paged.cache]
        return [t.clone() for t in state]

    def restore(self, saved: list[Tensor]) -> None:
        live = [self.buffers.prefix, self.buffers.blocks]
        live += [self.cache.conv, self.cache.recurrent] if self.kind == "kda" else [self.setup.paged.cache]
        for dst, src in zip(live, saved, strict=True):
            dst.copy_(src)

    def weight_bytes(self) -> int:
        w = self.weights
        names = ("in_proj", "f_b", "o_proj") if self.kind == "kda" else ("qkv_a_g", "q_b", "w_uk", "w_uv", "o_proj")
        return sum(getattr(w, n).numel() * getattr(w, n).element_size() for n in names)

    def state_bytes(self) -> int:
        """Bytes the step must move besides the weights: states or cache read (and written), AttnRes rows."""
        hidden = K3.hidden_size
        blocks = self.buffers.num_blocks
        attn_res = 2 * self.batch * hidden * 2 * (blocks + 4)  # two sites: sources, delta, prefix, output
        if self.kind == "kda":
            s = kda_spec(self.tp)
            per_request = 2 * (s.heads * s.head_dim**2 * 4 + s.conv_channels * (s.conv_width - 1) * 2)
            return attn_res + self.batch * per_request
        return attn_res + self.batch * 2048 * K3.mla.cache_row


def graph_of(fn: Callable[[], Tensor]) -> tuple[torch.cuda.CUDAGraph, Tensor]:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile and warm cuBLAS outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth (bytes read + written per second) of a 1 GiB copy."""
    src = torch.empty(1 << 29, dtype=torch.bfloat16, device=DEV)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * src.numel() * src.element_size() * 10 / (start.elapsed_time(end) / 1e3)


def profiled_kernels(fn: Callable[[], Tensor]) -> list[tuple[str, float]]:
    """(kernel name, device microseconds) of every kernel `fn` launches, in launch order."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    kernels.sort(key=lambda e: e.time_range.start)
    return [(e.name, e.time_range.end - e.time_range.start) for e in kernels]


TRITON_KERNELS = {
    "attn_res_kernel",
    "kda_decode_kernel",
    "qkv_norm_kernel",
    "query_insert_kernel",
    "split_kv_kernel",
    "merge_kernel",
    "sigmoid_gate_kernel",
}


@pytest.mark.parametrize("tp", [8, 16])
@pytest.mark.parametrize("kind", ["kda", "mla"])
def test_attention_side_launches_graphs_and_time(kind: str, tp: int):
    """Measure every batch before judging any, so one failure still leaves the numbers of the others."""
    bandwidth = MEASURED.setdefault("_copy_bandwidth", {"bytes_per_s": copy_bandwidth()})["bytes_per_s"]
    ops_sequence = (
        ("attn_res", "kda_in_proj", "kda_f_b", "kda_decode", "kda_o_proj", "attn_res")
        if kind == "kda"
        else ("attn_res", "mla_qkv_a_g", *_mla_decode_ops(), "mla_o_proj", "attn_res")
    )
    gemms = sum(1 for op in ops_sequence if op_info(op, DEV).implementation == "cublas")
    triton_launches = sum(op_info(op, DEV).launches for op in ops_sequence if op_info(op, DEV).kernels)
    failures: list[str] = []
    for batch in BATCHES:
        side = Side(kind, tp, batch)
        saved = side.snapshot()
        eager = side.step()  # also compiles every kernel
        eager_state = side.snapshot()
        side.restore(saved)
        kernels = profiled_kernels(side.step)
        expected = side.ops.expected_launches(ops_sequence)
        names = [n for n, _ in kernels]
        ours = [n for n in names if n in TRITON_KERNELS]
        if len(ours) != triton_launches:
            failures.append(f"B{batch}: {len(ours)} Triton launches, the op table says {triton_launches}: {names}")
        # cuBLAS may add one split-K reduction (or memset) per skinny GEMM; anything beyond that is a regression.
        if not expected <= len(kernels) <= expected + gemms:
            failures.append(f"B{batch}: {len(kernels)} launches, the op table says {expected}: {names}")

        side.restore(saved)
        graph, graph_out = graph_of(side.step)
        side.restore(saved)
        graph.replay()
        torch.cuda.synchronize()
        bit_equal = torch.equal(graph_out, eager)
        graph_err = error_metrics(graph_out, eager)
        # cuBLAS may pick another algorithm inside a capture: equal up to GEMM rounding, not necessarily bitwise.
        if graph_err[0] > TOL["gemm"].rms_rel:
            failures.append(f"B{batch}: graph replay differs from eager by rms_rel {graph_err[0]:.2e}")
        state_equal = all(torch.equal(a, b) for a, b in zip(side.snapshot(), eager_state, strict=True))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(5):
            graph.replay()
        start.record()
        for _ in range(50):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        replay_us = start.elapsed_time(end) * 1e3 / 50
        kernel_us = sum(t for _, t in kernels)
        moved = side.weight_bytes() + side.state_bytes()
        roofline_us = moved / bandwidth * 1e6
        MEASURED[f"{kind}_tp{tp}_b{batch}"] = {
            "launches": len(kernels),
            "launches_in_op_table": expected,
            "kernels": [{"name": n[:80], "us": round(t, 2)} for n, t in kernels],
            "kernel_us": round(kernel_us, 2),
            "graph_replay_us": round(replay_us, 2),
            "graph_bit_equal_to_eager": bit_equal,
            "graph_state_bit_equal_to_eager": state_equal,
            "bytes": moved,
            "roofline_us": round(roofline_us, 2),
            "roofline_fraction": round(roofline_us / replay_us, 3),
        }
        print(
            f"SIDE {kind} TP{tp} B{batch}: {len(kernels)} launches (table {expected}), kernels {kernel_us:.1f} us, "
            f"graph {replay_us:.1f} us, roofline {roofline_us:.1f} us ({roofline_us / replay_us:.0%}), "
            f"graph bit-equal {bit_equal}/{state_equal}"
        )
        for n, t in kernels:
            print(f"  {t:8.2f} us  {n[:100]}")
        del graph
    assert not failures, "\n".join(failures)


def _mla_decode_ops() -> tuple[str, ...]:
    from k3_decode.stock.attention_ops import MLA_DECODE_OPS

    return MLA_DECODE_OPS


@pytest.fixture(scope="module", autouse=True)
def _write_results():
    yield
    folder = os.environ.get("K3_STOCK_RESULTS")
    if not folder or len(MEASURED) <= 1:
        return
    # The device copy of the tree may have no git: K3_COMMIT (and K3_DIRTY=1) name what ran.
    commit = os.environ.get("K3_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        except OSError:
            commit = ""
    import triton

    meta = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "commit": commit or "unknown",
        "dirty": os.environ.get("K3_DIRTY") == "1",
    }
    Path(folder, "stock-attention-h200.json").write_text(json.dumps({"meta": meta, **MEASURED}, indent=1))


def test_error_metric_guard_rejects_zero_output():
    """The comparison itself: a zero output must fail, however loose the tolerance."""
    ref = torch.randn(64, dtype=torch.float64)
    with pytest.raises(AssertionError, match="output rms"):
        assert_close(torch.zeros_like(ref), ref, TOL["mla_decode"], "zeros")
    assert error_metrics(ref, ref) == (0.0, 0.0)
