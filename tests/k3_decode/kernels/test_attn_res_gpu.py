"""The CuTe DSL AttnRes kernel on an H200 against the oracle, at K3 shapes (hidden 7168, a bank of 8).

This must pass on a GPU before the kernel may be registered as a specialized provider (it is not registered now).
Tolerances: the AttnRes entry of tests/k3_decode/stock/attention_tolerances.toml, the same as the stock kernel's.
Besides the output, every test checks the in-place state bit for bit: the prefix and the saved block equal the
oracle's BF16 values exactly, every other bank block and every row outside the batch is untouched.
"""

from __future__ import annotations

from functools import cache

import pytest
import torch
from torch import Tensor

from k3_decode.attn_res_state import AttnResBuffers, AttnResSite
from k3_decode.config import K3
from k3_decode.kernels import attn_res_op
from k3_decode.kernels.attn_res_plan import AttnResKind
from k3_decode.kernels.builds import K3_KERNEL_BUILDS
from k3_decode.reference import attn_res as ra
from tests.k3_decode.stock.attention_helpers import assert_close, load_tolerances, weights_for

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TOL = load_tolerances()["attn_res"]
DEV = "cuda"
HIDDEN, CAPACITY, EPS = K3.hidden_size, K3.num_attn_res_blocks, K3.rms_norm_eps
SPARE_ROWS = 2  # rows after the batch in every buffer: the kernel must not touch them
ALL_KINDS = sorted({b.kind for b in K3_KERNEL_BUILDS.attn_res_builds()}, key=lambda k: k.tag)  # what CI compiles
# At B = 1 and 64 a kind of each shape: layer 0, a restart, a save, the heaviest, no norm, FP32 delta.
EDGE_KINDS = [
    AttnResKind.from_tag(t)
    for t in ("n0-none-save-norm", "n1-restart-norm", "n7-add-save-norm", "n8-add-norm", "n8-add-nonorm")
] + [AttnResKind(8, "restart", False, True, "float32")]
CASES = [(8, k) for k in ALL_KINDS] + [(b, k) for b in (1, 64) for k in EDGE_KINDS]


@cache
def mix_weights(out_norm: bool) -> ra.MixWeights:
    res = weights_for(K3, 8, DEV).residual(13)
    return ra.MixWeights(res.attn_res.norm, res.attn_res.proj, res.input_norm if out_norm else None)


def site_of(kind: AttnResKind) -> AttnResSite:
    """K3's sites read the whole bank they find and save into the next block (test_build checks this on K3)."""
    return AttnResSite(kind.delta, kind.num_blocks if kind.save else None, kind.num_blocks, kind.num_blocks)


def make_buffers(batch: int, blocks: int, gen: torch.Generator) -> tuple[AttnResBuffers, Tensor, Tensor]:
    """Buffers whose first `batch` rows the kernel gets; returns (batch view, whole prefix, whole bank)."""
    rows = batch + SPARE_ROWS
    prefix = torch.randn(rows, HIDDEN, generator=gen).bfloat16().to(DEV)
    bank = torch.randn(rows, CAPACITY, HIDDEN, generator=gen).bfloat16().to(DEV)
    return AttnResBuffers(prefix[:batch], bank[:batch], blocks), prefix, bank


def oracle(kind: AttnResKind, prefix: Tensor, bank: Tensor, delta: Tensor | None) -> tuple[Tensor, Tensor]:
    """(FP64 output, BF16 new prefix) per the oracle's rules for one application."""
    if kind.delta == "add":
        p = ra.add_to_prefix(prefix, delta)
    elif kind.delta == "restart":
        p = delta.to(ra.STATE_DTYPE)
    else:
        p = prefix.clone()
    sources = torch.cat([bank[:, : kind.num_blocks], p.unsqueeze(1)], dim=1)
    return ra.mix(sources, mix_weights(kind.out_norm), EPS, torch.float64), p


@pytest.mark.parametrize("batch, kind", CASES, ids=[f"B{b}-{k.tag}" for b, k in CASES])
def test_kernel_matches_the_oracle(batch: int, kind: AttnResKind):
    gen = torch.Generator().manual_seed(batch * 100 + kind.num_blocks)
    buffers, prefix_all, bank_all = make_buffers(batch, kind.num_blocks, gen)
    delta = None
    if kind.delta != "none":
        dtype = torch.float32 if kind.delta_dtype == "float32" else torch.bfloat16
        delta = torch.randn(batch, HIDDEN, generator=gen).to(dtype).to(DEV)
    prefix_before, bank_before = prefix_all.clone(), bank_all.clone()
    ref, p_ref = oracle(kind, buffers.prefix.clone(), buffers.blocks.clone(), delta)

    got = attn_res_op.apply(buffers, site_of(kind), delta, mix_weights(kind.out_norm), EPS)
    torch.cuda.synchronize()

    rms_rel, peak_rel = assert_close(got, ref, TOL, f"CuTe AttnRes {kind.tag}, B{batch}")
    print(f"METRIC CuTe AttnRes {kind.tag} B{batch}: rms_rel {rms_rel:.2e}, peak_rel {peak_rel:.2e}")
    assert got.dtype == torch.bfloat16 and got.shape == (batch, HIDDEN)
    expected_prefix = p_ref if kind.delta != "none" else prefix_before[:batch]
    assert torch.equal(prefix_all[:batch], expected_prefix), "prefix must be bit-equal (one FP32 add, RTNE)"
    expected_bank = bank_before.clone()
    if kind.save:
        expected_bank[:batch, kind.num_blocks] = p_ref
        assert buffers.num_blocks == kind.num_blocks + 1
    assert torch.equal(bank_all, expected_bank), "the bank changed outside the saved block"
    assert torch.equal(prefix_all[batch:], prefix_before[batch:]), "a row outside the batch changed"


def test_a_layer_stack_follows_the_oracle():
    """Layers 0..25 and the final mixing in sequence (three block writes, restarts), state carried by the kernel."""
    gen, batch, bs = torch.Generator().manual_seed(7), 8, K3.attn_res_block_size
    embedding = torch.randn(batch, HIDDEN, generator=gen).bfloat16().to(DEV)
    state = ra.init_state(embedding)
    buffers = AttnResBuffers.allocate(batch, HIDDEN, CAPACITY, DEV)
    buffers.prefix.copy_(embedding)
    weights = weights_for(K3, 8, DEV)
    delta = None
    for layer in range(26):
        res = weights.residual(layer)
        before = ra.MixWeights(res.attn_res.norm, res.attn_res.proj, res.input_norm)
        after = ra.MixWeights(res.mlp_res.norm, res.mlp_res.proj, res.post_attn_norm)
        ref, state = ra.before_attention(state, layer, delta, before, bs, EPS, torch.float64)
        got = attn_res_op.apply(buffers, AttnResSite.before_attention(layer, bs), delta, before, EPS)
        assert_close(got, ref, TOL, f"before attention of layer {layer}")
        attn_out = torch.randn(batch, HIDDEN, generator=gen).bfloat16().to(DEV)
        ref, state = ra.after_attention(state, layer, attn_out, after, bs, EPS, torch.float64)
        got = attn_res_op.apply(buffers, AttnResSite.after_attention(layer, bs), attn_out, after, EPS)
        assert_close(got, ref, TOL, f"after attention of layer {layer}")
        assert torch.equal(buffers.prefix, state.prefix), f"prefix after layer {layer}"
        assert torch.equal(buffers.blocks[:, : buffers.num_blocks], state.blocks), f"bank after layer {layer}"
        delta = torch.randn(batch, HIDDEN, generator=gen).bfloat16().to(DEV)
    assert buffers.num_blocks == 3


def test_runs_are_deterministic_and_replay_in_a_cuda_graph():
    """Same inputs, same bits: eagerly twice and from a captured graph (cluster launch with PDL inside a graph)."""
    gen, batch = torch.Generator().manual_seed(3), 8
    kind = AttnResKind.from_tag("n8-add-norm")
    prefix0 = torch.randn(batch, HIDDEN, generator=gen).bfloat16().to(DEV)
    bank = torch.randn(batch, CAPACITY, HIDDEN, generator=gen).bfloat16().to(DEV)
    delta = torch.randn(batch, HIDDEN, generator=gen).bfloat16().to(DEV)
    weights = mix_weights(True)

    def once() -> Tensor:
        buffers = AttnResBuffers(prefix0.clone(), bank.clone(), kind.num_blocks)
        return attn_res_op.apply(buffers, site_of(kind), delta, weights, EPS)

    first, second = once(), once()
    assert torch.equal(first, second), "two eager runs differ"

    static = AttnResBuffers(prefix0.clone(), bank.clone(), kind.num_blocks)
    attn_res_op.apply(static, site_of(kind), delta, weights, EPS)  # compile and warm up outside the capture
    static.prefix.copy_(prefix0)
    static.num_blocks = kind.num_blocks
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = attn_res_op.apply(static, site_of(kind), delta, weights, EPS)
    static.prefix.copy_(prefix0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, first), "the graph replay differs from the eager run"


def test_inputs_the_kernel_cannot_take_are_refused():
    buffers = AttnResBuffers.allocate(4, HIDDEN, CAPACITY, DEV)
    weights = mix_weights(True)
    site = AttnResSite("add", None, 0, 0)
    with pytest.raises(ValueError, match="delta must be BF16 or FP32"):
        attn_res_op.apply(buffers, site, torch.zeros(4, HIDDEN, dtype=torch.float16, device=DEV), weights, EPS)
    with pytest.raises(ValueError, match="contiguous"):
        attn_res_op.apply(buffers, site, torch.zeros(HIDDEN, 4, device=DEV).t(), weights, EPS)
    with pytest.raises(ValueError, match="expects 1"):
        attn_res_op.apply(buffers, AttnResSite("add", None, 1, 1), torch.zeros(4, HIDDEN, device=DEV), weights, EPS)
