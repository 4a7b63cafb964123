"""Tests for the AttnRes oracle against an independent "residual stream cut into blocks" formulation."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from k3_decode.config import K3, K3_MINI
from k3_decode.reference import attn_res as ar

F64 = torch.float64


# --- independent formulation -------------------------------------------------------------------------


def ref_mix(sources: list[Tensor], res_norm: Tensor, res_proj: Tensor, out_norm: Tensor | None, eps: float) -> Tensor:
    """One token, one source at a time, in FP64: softmax over per-source RMS-normalized projections."""
    w = [
        float(a) * float(b)
        for a, b in zip(res_norm.double().tolist(), res_proj.double().reshape(-1).tolist(), strict=True)
    ]
    logits = []
    for s in sources:
        vals = s.double().tolist()
        rms = math.sqrt(sum(v * v for v in vals) / len(vals) + eps)
        logits.append(sum(v * wi for v, wi in zip(vals, w, strict=True)) / rms)
    top = max(logits)
    exps = [math.exp(v - top) for v in logits]
    total = sum(exps)
    mixed = sum((e / total) * s.double() for e, s in zip(exps, sources, strict=True))
    if out_norm is None:
        return mixed
    return mixed / math.sqrt(float(mixed.square().mean()) + eps) * out_norm.double()


def ref_sources(embedding: Tensor, outputs: list[tuple[int, Tensor]], layer: int, block_size: int) -> list[Tensor]:
    """Sources for a mixing that has consumed `outputs` ((producing layer, row) pairs, in order) and sits
    in `layer` (num_layers for the final mixing): the embedding, every completed block of `block_size`
    layers, and the running sum of the current block if it is non-empty. Every sum is a BF16 running sum.
    """
    groups: dict[int, Tensor] = {}
    for src_layer, out in outputs:
        g = src_layer // block_size
        groups[g] = out.to(torch.bfloat16) if g not in groups else (groups[g].float() + out.float()).bfloat16()
    current = layer // block_size
    completed = [groups[g] for g in range(current) if (g + 1) * block_size <= layer]
    partial = [groups[current]] if current in groups else []
    return [embedding.to(torch.bfloat16), *completed, *partial]


class Sublayers:
    """Deterministic stand-ins for attention and MLP so that an error in one input reaches later layers."""

    def __init__(self, num_layers: int, hidden: int, gen: torch.Generator, delta_dtype: torch.dtype):
        self.mats = [torch.randn(hidden, hidden, generator=gen, dtype=F64) / hidden**0.5 for _ in range(2 * num_layers)]
        self.delta_dtype = delta_dtype

    def __call__(self, index: int, x: Tensor) -> Tensor:
        return (3.0 * torch.tanh(x.double() @ self.mats[index])).to(self.delta_dtype)


def random_mix_weights(hidden: int, gen: torch.Generator, with_norm: bool = True) -> ar.MixWeights:
    return ar.MixWeights(
        res_norm=(1.0 + 0.3 * torch.randn(hidden, generator=gen)).bfloat16(),
        res_proj=torch.randn(1, hidden, generator=gen).bfloat16(),
        out_norm=(1.0 + 0.3 * torch.randn(hidden, generator=gen)).bfloat16() if with_norm else None,
    )


def run_oracle(emb, layers_w, final_w, subs, num_layers, block_size, eps) -> list[Tensor]:
    """Drive the oracle through a whole forward; returns every sublayer input and the final output."""
    inputs: list[Tensor] = []
    state = ar.init_state(emb)
    delta = None
    for i in range(num_layers):
        x, state = ar.before_attention(state, i, delta, layers_w[i][0], block_size, eps, F64)
        inputs.append(x)
        x, state = ar.after_attention(state, i, subs(2 * i, x), layers_w[i][1], block_size, eps, F64)
        inputs.append(x)
        delta = subs(2 * i + 1, x)
    inputs.append(ar.final(state, delta, num_layers, final_w, block_size, eps, F64))
    return inputs


def run_reference(emb, layers_w, final_w, subs, num_layers, block_size, eps) -> list[Tensor]:
    """The same forward from the block formulation, one token at a time."""
    per_token = []
    for t in range(emb.shape[0]):
        outputs: list[tuple[int, Tensor]] = []
        inputs = []

        def mixed(layer: int, w: ar.MixWeights, t: int = t, outputs: list = outputs) -> Tensor:
            srcs = ref_sources(emb[t], outputs, layer, block_size)
            return ref_mix(srcs, w.res_norm, w.res_proj, w.out_norm, eps)

        for i in range(num_layers):
            x = mixed(i, layers_w[i][0])
            inputs.append(x)
            outputs.append((i, subs(2 * i, x.unsqueeze(0))[0]))
            x = mixed(i, layers_w[i][1])
            inputs.append(x)
            outputs.append((i, subs(2 * i + 1, x.unsqueeze(0))[0]))
        inputs.append(mixed(num_layers, final_w))
        per_token.append(inputs)
    return [torch.stack([tok[k] for tok in per_token]) for k in range(len(per_token[0]))]


def check_forward(num_layers: int, block_size: int, tokens: int, hidden: int, seed: int, delta_dtype) -> None:
    gen = torch.Generator().manual_seed(seed)
    eps = 1e-5
    emb = torch.randn(tokens, hidden, generator=gen).bfloat16()
    layers_w = [(random_mix_weights(hidden, gen), random_mix_weights(hidden, gen)) for _ in range(num_layers)]
    final_w = random_mix_weights(hidden, gen)
    subs = Sublayers(num_layers, hidden, gen, delta_dtype)
    got = run_oracle(emb, layers_w, final_w, subs, num_layers, block_size, eps)
    want = run_reference(emb, layers_w, final_w, subs, num_layers, block_size, eps)
    assert len(got) == len(want) == 2 * num_layers + 1
    for k, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10, msg=lambda m, k=k: f"sublayer input {k}: {m}")


# --- block counts ------------------------------------------------------------------------------------


def test_k3_block_counts():
    bs, n = K3.attn_res_block_size, K3.num_layers
    assert (bs, n) == (12, 93)
    before_attn = {0: 0, 1: 1, 11: 1, 12: 1, 13: 2, 24: 2, 25: 3, 84: 7, 85: 8, 92: 8}
    before_mlp = {0: 1, 1: 1, 11: 1, 12: 2, 13: 2, 24: 3, 84: 8, 85: 8, 92: 8}
    assert {i: ar.blocks_before_attention(i, bs) for i in before_attn} == before_attn
    assert {i: ar.blocks_before_mlp(i, bs) for i in before_mlp} == before_mlp
    assert ar.blocks_final(n, bs) == 8 == K3.num_attn_res_blocks
    # The stock native kernel takes at most 8 blocks; no mixing may read more.
    assert max(ar.bank_blocks(i, bs) for i in range(n)) == 8
    # No MLA layer of K3 is a block-write layer.
    assert not [i for i in range(n) if K3.layer_kind(i) == "mla" and ar.is_block_write(i, bs)]


@pytest.mark.parametrize("dims", [K3, K3_MINI], ids=lambda d: d.name)
def test_counts_agree_with_config(dims):
    bs = dims.attn_res_block_size
    for i in range(dims.num_layers):
        assert ar.is_block_write(i, bs) == dims.is_block_write(i)
        # config's blocks_before counts the bank including the block the layer writes; that is what the
        # pre-MLP mixing reads, while the pre-attention mixing reads one fewer at a block-write layer.
        assert ar.bank_blocks(i, bs) == dims.blocks_before(i) == ar.blocks_before_mlp(i, bs)
        assert ar.blocks_before_attention(i, bs) == dims.blocks_before(i) - int(dims.is_block_write(i))
    assert ar.blocks_final(dims.num_layers, bs) == dims.num_attn_res_blocks


@given(layer=st.integers(0, 500), bs=st.integers(1, 40))
def test_count_invariants(layer, bs):
    # The next layer's pre-attention mixing reads exactly the bank as this layer left it.
    assert ar.blocks_before_attention(layer + 1, bs) == ar.bank_blocks(layer, bs)
    assert ar.blocks_before_mlp(layer, bs) == ar.bank_blocks(layer, bs)
    # Final mixing after L layers reads what a pre-attention mixing of a layer L would.
    assert ar.blocks_final(layer + 1, bs) == ar.blocks_before_attention(layer + 1, bs)
    # Blocks are counted from the first layer, so layer 0 alone reads nothing from the bank.
    assert ar.blocks_before_attention(layer, bs) == len([k for k in range(layer + 1) if k * bs < layer])


# --- mixing ------------------------------------------------------------------------------------------


def test_mix_hand_computed():
    # w_norm * w_q = e_0; s1 = [1,1,1,1] (rms 1, logit 1), s2 = [-2,2,2,2] (rms 2, logit -1).
    s1 = torch.tensor([1.0, 1.0, 1.0, 1.0])
    s2 = torch.tensor([-2.0, 2.0, 2.0, 2.0])
    w = ar.MixWeights(res_norm=torch.ones(4), res_proj=torch.tensor([[1.0, 0.0, 0.0, 0.0]]), out_norm=None)
    a1 = 1.0 / (1.0 + math.exp(-2.0))
    want = a1 * s1.double() + (1.0 - a1) * s2.double()
    got = ar.mix(torch.stack([s1, s2]).unsqueeze(0), w, eps=0.0, dtype=F64)[0]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-15)
    normed = ar.mix(
        torch.stack([s1, s2]).unsqueeze(0),
        ar.MixWeights(w.res_norm, w.res_proj, out_norm=torch.tensor([1.0, 2.0, 3.0, 4.0])),
        eps=0.0,
        dtype=F64,
    )[0]
    rms = math.sqrt(float(want.square().mean()))
    torch.testing.assert_close(normed, want / rms * torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=F64), rtol=0, atol=1e-15)


def test_single_source_is_identity_before_norm():
    gen = torch.Generator().manual_seed(1)
    p = torch.randn(3, 1, 32, generator=gen).bfloat16()
    w = random_mix_weights(32, gen, with_norm=False)
    torch.testing.assert_close(ar.mix(p, w, 1e-5, F64), p[:, 0].double(), rtol=0, atol=0)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), n_src=st.integers(1, 9), scale=st.floats(0.01, 100.0))
def test_mix_matches_reference_and_is_scale_free(seed, n_src, scale):
    gen = torch.Generator().manual_seed(seed)
    src = (torch.randn(2, n_src, 48, generator=gen) * 4).bfloat16()
    w = random_mix_weights(48, gen)
    got32 = ar.mix(src, w, 1e-5)
    got64 = ar.mix(src, w, 1e-5, F64)
    for t in range(2):
        want = ref_mix(list(src[t]), w.res_norm, w.res_proj, w.out_norm, 1e-5)
        torch.testing.assert_close(got64[t], want, rtol=1e-12, atol=1e-12)
    assert got32.dtype == torch.float32
    torch.testing.assert_close(got32.double(), got64, rtol=1e-4, atol=1e-4)
    # With eps = 0 logits ignore the scale of the sources and the output norm undoes it.
    torch.testing.assert_close(
        ar.mix(src.double() * scale, w, 0.0, F64), ar.mix(src, w, 0.0, F64), rtol=1e-9, atol=1e-9
    )


def test_prefix_update_rounds_once_to_bf16():
    p = torch.tensor([[256.0, 1.0]], dtype=torch.bfloat16)
    # 256 + 1.0078125 rounds to 258 (bf16 spacing 2 above 256); 1 + 2**-9 stays 1.
    delta = torch.tensor([[1.0078125, 2**-9]], dtype=torch.float32)
    out = ar.add_to_prefix(p, delta)
    assert out.dtype == torch.bfloat16
    assert out.float().tolist() == [[258.0, 1.0]]


# --- whole forward -----------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(
    num_layers=st.integers(1, 9),
    block_size=st.integers(1, 5),
    tokens=st.integers(1, 3),
    seed=st.integers(0, 2**31),
    fp32_delta=st.booleans(),
)
def test_forward_matches_block_formulation(num_layers, block_size, tokens, seed, fp32_delta):
    check_forward(num_layers, block_size, tokens, 16, seed, torch.float32 if fp32_delta else torch.bfloat16)


@pytest.mark.parametrize("block_size", [3, 1, 12, 13])
def test_forward_k3_mini(block_size):
    # k3-mini's 12 layers with its block size 3, one block per layer, exactly one block, and a block
    # longer than the model (the final mixing then sees b_0 and p only).
    check_forward(K3_MINI.num_layers, block_size, 2, K3_MINI.hidden_size, 7, torch.bfloat16)


def test_layer0_state_and_restart():
    gen = torch.Generator().manual_seed(3)
    emb = torch.randn(2, 16, generator=gen).bfloat16()
    w = random_mix_weights(16, gen)
    x, s = ar.before_attention(ar.init_state(emb), 0, None, w, 3, 1e-5)
    assert s.num_blocks == 1 and torch.equal(s.blocks[:, 0], emb) and torch.equal(s.prefix, emb)
    # Layer 0 mixes the embedding alone.
    torch.testing.assert_close(x, ar.mix(emb.unsqueeze(1), w, 1e-5))
    attn = torch.randn(2, 16, generator=gen)
    _, s = ar.after_attention(s, 0, attn, w, 3, 1e-5)
    assert torch.equal(s.prefix, attn.bfloat16())  # restarted, the embedding no longer in p


def test_rejects_inconsistent_calls():
    emb = torch.zeros(1, 8).bfloat16() + 1
    w = ar.MixWeights(torch.ones(8), torch.ones(8), None)
    with pytest.raises(ValueError, match="delta"):
        ar.before_attention(ar.init_state(emb), 0, emb, w, 2, 1e-5)
    with pytest.raises(ValueError, match="delta"):
        ar.before_attention(ar.init_state(emb), 1, None, w, 2, 1e-5)
    # Skipping layer 0 leaves the bank empty where layer 1 expects b_0.
    with pytest.raises(ValueError, match="bank holds 0"):
        ar.before_attention(ar.init_state(emb), 1, emb, w, 2, 1e-5)
    _, s = ar.before_attention(ar.init_state(emb), 0, None, w, 2, 1e-5)
    with pytest.raises(ValueError, match="bank holds 1"):
        ar.final(s, emb, 3, w, 2, 1e-5)
