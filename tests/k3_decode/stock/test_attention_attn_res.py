"""Stock AttnRes (torch-cpu path) against the oracle over a whole k3-mini layer stack, plus its site table and
its errors. The Triton kernel is checked under the interpreter (test_attention_interpreted.py) and on the GPU."""

from __future__ import annotations

import pytest
import torch

from k3_decode.config import K3, K3_MINI
from k3_decode.reference import attn_res as ra
from k3_decode.stock import attn_res as sa
from k3_decode.stock.attn_res import AttnResBuffers, AttnResSite
from tests.k3_decode.stock.attention_helpers import assert_close, load_tolerances, weights_for

TOL = load_tolerances()
DIMS = K3_MINI
EPS = DIMS.rms_norm_eps


def mix_weights(sw, layer: int) -> tuple[ra.MixWeights, ra.MixWeights]:
    res = sw.residual(layer)
    return (
        ra.MixWeights(res.attn_res.norm, res.attn_res.proj, res.input_norm),
        ra.MixWeights(res.mlp_res.norm, res.mlp_res.proj, res.post_attn_norm),
    )


def test_whole_stack_matches_the_oracle_and_keeps_identical_state():
    """Every site of every layer and the final mixing: outputs within tolerance, prefix and bank bit-equal."""
    gen = torch.Generator().manual_seed(0)
    sw = weights_for(DIMS, 2, "cpu")
    tokens, hidden, bs = 5, DIMS.hidden_size, DIMS.attn_res_block_size
    state = ra.init_state(torch.randn(tokens, hidden, generator=gen).bfloat16())
    buffers = AttnResBuffers.from_state(state, DIMS.num_attn_res_blocks)
    delta = None
    for layer in range(DIMS.num_layers):
        before, after = mix_weights(sw, layer)
        ref, state = ra.before_attention(state, layer, delta, before, bs, EPS, torch.float64)
        got = sa.before_attention(buffers, layer, delta, before, bs, EPS)
        assert got.dtype == torch.bfloat16
        assert_close(got, ref, TOL["attn_res"], f"before attention, layer {layer}")
        assert torch.equal(buffers.prefix, state.prefix) and buffers.num_blocks == state.num_blocks
        assert torch.equal(buffers.blocks[:, : buffers.num_blocks], state.blocks)

        attn_out = torch.randn(tokens, hidden, generator=gen).bfloat16()
        ref, state = ra.after_attention(state, layer, attn_out, after, bs, EPS, torch.float64)
        got = sa.after_attention(buffers, layer, attn_out, after, bs, EPS)
        assert_close(got, ref, TOL["attn_res"], f"after attention, layer {layer}")
        assert torch.equal(buffers.prefix, state.prefix)
        delta = torch.randn(tokens, hidden, generator=gen) * 0.5  # an FP32 sum of partials is allowed too

    model = sw.model()
    final = ra.MixWeights(model.final_res.norm, model.final_res.proj, None)
    ref = ra.final(state, delta, DIMS.num_layers, final, bs, EPS, torch.float64)
    got = sa.final(buffers, delta, DIMS.num_layers, final, bs, EPS)
    assert_close(got, ref, TOL["attn_res"], "final mixing")


@pytest.mark.parametrize(
    ("site", "expected"),
    [
        (AttnResSite.before_attention(0, 12), AttnResSite("none", 0, 0, 0)),
        (AttnResSite.before_attention(1, 12), AttnResSite("add", None, 1, 1)),
        (AttnResSite.before_attention(12, 12), AttnResSite("add", 1, 1, 1)),
        (AttnResSite.after_attention(12, 12), AttnResSite("restart", None, 2, 2)),
        (AttnResSite.after_attention(13, 12), AttnResSite("add", None, 2, 2)),
        (AttnResSite.final(K3.num_layers, 12), AttnResSite("add", None, 8, 8)),
    ],
)
def test_sites_of_k3(site, expected):
    """K3 block size 12: block writes at 0, 12, ..., a restart after them, 8 blocks in the final mixing."""
    assert site == expected


def test_restart_discards_the_old_prefix():
    """After a block-write layer's attention, p is the attention output alone (the old p lives in the bank)."""
    sw = weights_for(DIMS, 2, "cpu")
    buffers = AttnResBuffers.allocate(2, DIMS.hidden_size, 4)
    buffers.prefix.fill_(3.0)
    _, after = mix_weights(sw, 0)
    sa.before_attention(buffers, 0, None, mix_weights(sw, 0)[0], 3, EPS)
    attn_out = torch.full((2, DIMS.hidden_size), 0.5).bfloat16()
    sa.after_attention(buffers, 0, attn_out, after, 3, EPS)
    assert torch.equal(buffers.prefix, attn_out)
    assert torch.equal(buffers.blocks[:, 0], torch.full_like(attn_out, 3.0))


def test_errors_name_the_problem():
    sw = weights_for(DIMS, 2, "cpu")
    before, _ = mix_weights(sw, 1)
    buffers = AttnResBuffers.allocate(2, DIMS.hidden_size, 4)
    delta = torch.zeros(2, DIMS.hidden_size)
    with pytest.raises(ValueError, match="bank holds 0 blocks, this site expects 1"):
        sa.before_attention(buffers, 1, delta, before, 3, EPS)
    with pytest.raises(ValueError, match="takes no delta"):
        sa.before_attention(buffers, 0, delta, before, 3, EPS)
    with pytest.raises(ValueError, match=r"delta \(2, 3\) must be \[tokens, hidden\]"):
        buffers.num_blocks = 1
        sa.before_attention(buffers, 1, torch.zeros(2, 3), before, 3, EPS)
    small = AttnResBuffers.allocate(2, DIMS.hidden_size, 1)
    small.num_blocks = 1
    with pytest.raises(ValueError, match="does not fit a bank of 1"):
        sa.before_attention(small, 3, delta, before, 3, EPS)
    wrong = AttnResBuffers(buffers.prefix.float(), buffers.blocks, 1)
    with pytest.raises(ValueError, match=r"must be torch\.bfloat16"):
        sa.before_attention(wrong, 1, delta, before, 3, EPS)
    with pytest.raises(ValueError, match="may not read block 0"):
        sa.apply(buffers, AttnResSite("add", 0, 1, 1), delta, before, EPS)
