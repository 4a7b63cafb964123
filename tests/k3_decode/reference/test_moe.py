"""Tests for the MoE oracle: tie-stable routing, SiTU, expert FFN formulations, TP sharding, latent MoE."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from k3_decode.config import K3, K3_MINI, ModelDims, RankShapes
from k3_decode.reference import allreduce
from k3_decode.reference import moe as m
from k3_decode.reference.norms import rms_norm

F32, F64 = torch.float32, torch.float64
LN9 = math.log(9.0)  # tanh(ln9 / 4) = 1/2 and sigmoid(ln9) = 9/10
UP15 = 25.0 * math.log(2.0)  # 25·tanh(UP15 / 25) = 25·tanh(ln2) = 15


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def fake_mxfp8(x: Tensor) -> Tensor:
    """Row-local blockwise fake quantizer in the spirit of MXFP8: power-of-two scale per 32 values, E4M3."""
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, torch.exp2(torch.ceil(torch.log2(amax / 448.0))), torch.ones_like(amax))
    return ((blocks / scale).to(torch.float8_e4m3fn).to(x.dtype) * scale).reshape(x.shape)


def python_topk(keys: list[float], k: int) -> list[int]:
    return sorted(range(len(keys)), key=lambda e: (-keys[e], e))[:k]


@pytest.fixture(scope="module")
def mini_weights() -> m.LatentMoeWeights:
    return m.random_latent_moe_weights(K3_MINI, generator=gen(11), dtype=F64)


@pytest.fixture(scope="module")
def mini_hidden() -> Tensor:
    return torch.randn(9, K3_MINI.hidden_size, generator=gen(12), dtype=F64).to(torch.bfloat16)


# --- router: logits and selection ----------------------------------------------------------------------


def test_router_logits_are_fp32_and_accurate() -> None:
    g = gen(1)
    w = torch.randn(16, 256, generator=g).to(torch.bfloat16)
    x = torch.randn(3, 256, generator=g).to(torch.bfloat16)
    logits = m.router_logits(x, w)
    assert logits.dtype == F32
    for b, e in [(0, 0), (1, 7), (2, 15)]:
        exact = math.fsum(float(a) * float(c) for a, c in zip(x[b].tolist(), w[e].tolist(), strict=True))
        assert logits[b, e].item() == torch.tensor(exact, dtype=F64).float().item()
    assert not torch.equal(logits, (x @ w.T).float())  # a BF16 GEMM would not do


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.one_of(st.sampled_from([-1.0, -0.0, 0.0, 0.25, 0.5, 1.5]), st.floats(-2.0, 2.0, width=32)),
        min_size=1,
        max_size=48,
    ),
    st.data(),
)
def test_selection_matches_sorted_by_key_then_id(values: list[float], data: st.DataObject) -> None:
    k = data.draw(st.integers(1, len(values)))
    got = m.select_experts(torch.tensor([values, values[::-1]], dtype=F32), k)
    assert got[0].tolist() == python_topk(values, k)
    assert got[1].tolist() == python_topk(values[::-1], k)


def test_exact_ties_pick_lower_ids() -> None:
    assert m.select_experts(torch.full((2, 896), 0.5), 16).tolist() == [list(range(16))] * 2
    keys = torch.zeros(1, 10)
    keys[0, [8, 3, 6, 1]] = 1.0
    assert m.select_experts(keys, 3).tolist() == [[1, 3, 6]]
    # -0.0 and +0.0 are equal keys, so the id decides
    assert m.select_experts(torch.tensor([[-0.0, 0.0, -0.0]]), 2).tolist() == [[0, 1]]


def test_equal_score_and_bias_pick_lower_ids_through_route() -> None:
    logits = torch.zeros(1, 8)
    bias = torch.zeros(8)
    bias[[2, 5, 7]] = 0.25
    r = m.route(logits, bias, top_k=2)
    assert r.ids.tolist() == [[2, 5]]
    assert torch.equal(r.weights, torch.tensor([[0.5, 0.5]]))


def test_tie_between_different_score_bias_splits() -> None:
    # expert 4: 0.75 + 0; expert 1: 0.5 + 0.25 -> equal FP32 keys; the lower id wins, the weights stay raw
    s = torch.tensor([0.1, 0.5, 0.1, 0.1, 0.75, 0.1])
    logits = torch.log(s / (1 - s)).float()
    scores = torch.sigmoid(logits)
    bias = torch.zeros(6)
    bias[1] = (scores[4] - scores[1]).item()
    assert scores[1] + bias[1] == scores[4] + bias[4]
    r = m.route(logits[None], bias, top_k=1)
    assert r.ids.tolist() == [[1]]
    r2 = m.route(logits[None], bias, top_k=2)
    assert r2.ids.tolist() == [[1, 4]]
    assert torch.allclose(r2.weights, (scores[[1, 4]] / scores[[1, 4]].sum())[None])


def test_selection_rejects_bad_keys() -> None:
    with pytest.raises(ValueError, match="NaN"):
        m.select_experts(torch.tensor([[0.1, float("nan")]]), 1)
    with pytest.raises(TypeError):
        m.select_experts(torch.zeros(1, 4, dtype=F64), 1)
    with pytest.raises(ValueError):
        m.select_experts(torch.zeros(1, 4), 5)


# --- router: weights -----------------------------------------------------------------------------------


def test_bias_moves_selection_but_not_weights() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, -1.0, -2.0, -3.0, -4.0]])
    small = (1e-3 * torch.randn(8, generator=gen(3))).float()
    plain, biased = m.route(logits, torch.zeros(8), top_k=3), m.route(logits, small, top_k=3)
    assert torch.equal(plain.ids, biased.ids) and torch.equal(plain.weights, biased.weights)
    big = torch.zeros(8)
    big[6] = 10.0  # expert 6 has a low score but the bias makes it first
    r = m.route(logits, big, top_k=3)
    assert r.ids.tolist() == [[6, 0, 1]]
    raw = torch.sigmoid(logits[0, [6, 0, 1]]).double()
    assert torch.allclose(r.weights[0].double(), raw / raw.sum(), rtol=1e-7, atol=0)
    assert r.weights[0, 0] < 0.05  # its weight is its own small raw score share, not score + bias


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31), st.floats(0.1, 10.0), st.integers(1, 16))
def test_weights_renormalize_to_the_scaling_factor(seed: int, scale: float, k: int) -> None:
    g = gen(seed)
    logits = (3 * torch.randn(4, 16, generator=g)).float()
    bias = (0.3 * torch.randn(16, generator=g)).float()
    r = m.route(logits, bias, top_k=k, routed_scaling_factor=scale)
    assert torch.allclose(r.weights.double().sum(-1), torch.full((4,), scale, dtype=F64), rtol=1e-6, atol=0)
    chosen = r.scores.gather(-1, r.ids).double()
    assert torch.allclose(r.weights.double(), chosen / chosen.sum(-1, keepdim=True) * scale, rtol=1e-6, atol=0)
    keys = (r.scores + bias).gather(-1, r.ids)
    assert bool((keys[:, :-1] >= keys[:, 1:]).all())  # slots come largest key first


def test_denominator_eps() -> None:
    # Scores of 0 (sigmoid underflows): eps keeps the weights finite zeros instead of 0/0.
    dead = m.route(torch.full((1, 8), -200.0), torch.zeros(8), top_k=4)
    assert torch.equal(dead.weights, torch.zeros(1, 4))
    # Four scores of 2.5e-21 sum to the eps itself, so the weights sum to 1/2, not 1.
    tiny = m.route(torch.full((1, 8), math.log(2.5e-21)), torch.zeros(8), top_k=4)
    s = tiny.scores[0, :4].double()
    assert torch.allclose(tiny.weights[0].double(), s / (s.sum() + 1e-20), rtol=1e-6, atol=0)
    assert abs(tiny.weights.sum().item() - 0.5) < 1e-3


def test_route_checks_dtypes_and_shapes() -> None:
    with pytest.raises(TypeError):
        m.route(torch.zeros(1, 8, dtype=torch.bfloat16), torch.zeros(8), top_k=2)
    with pytest.raises(TypeError):
        m.route(torch.zeros(1, 8), torch.zeros(8, dtype=torch.bfloat16), top_k=2)
    with pytest.raises(ValueError):
        m.route(torch.zeros(1, 8), torch.zeros(7), top_k=2)


def test_by_id_sorts_slots_with_their_weights() -> None:
    r = m.route(torch.tensor([[0.0, 3.0, 1.0, 2.0]]), torch.zeros(4), top_k=3)
    ids, w = r.by_id()
    assert ids.tolist() == [[1, 2, 3]]
    assert torch.equal(w[0], r.weights[0, [0, 2, 1]])


def test_route_tokens_takes_top_k_scale_and_eps_from_the_dims() -> None:
    moe = dataclasses.replace(K3_MINI.moe, top_k=3, routed_scaling_factor=2.5, routing_denominator_eps=1.0)
    w = torch.randn(16, 32, generator=gen(13)).to(torch.bfloat16)
    r = m.route_tokens(torch.randn(2, 32, generator=gen(14)), w, torch.zeros(16), moe)
    s = r.scores.gather(-1, r.ids).double()
    assert r.ids.shape == (2, 3)
    assert torch.allclose(r.weights.double(), s / (s.sum(-1, keepdim=True) + 1.0) * 2.5, rtol=1e-6, atol=0)


def test_real_size_router() -> None:
    moe, h, b = K3.moe, K3.hidden_size, 4
    g = gen(7)
    weight = (torch.randn(moe.num_experts, h, generator=g) / h**0.5).to(torch.bfloat16)
    bias = (0.01 * torch.randn(moe.num_experts, generator=g)).float()
    hidden = torch.randn(b, h, generator=g).to(torch.bfloat16)

    r = m.route_tokens(hidden, weight, bias, moe)
    assert r.ids.shape == (b, 16) and r.logits.shape == (b, 896) and r.logits.dtype == F32
    assert torch.allclose(r.logits, hidden.float() @ weight.float().T, rtol=0, atol=1e-4)
    keys = (r.scores + bias).tolist()
    assert r.ids.tolist() == [python_topk(row, 16) for row in keys]
    assert torch.allclose(r.weights.sum(-1), torch.ones(b), rtol=1e-6, atol=0)

    # Plant exact ties: zero router rows give logit 0 (score 1/2) whatever the summation order.
    perm = torch.randperm(moe.num_experts, generator=g)
    first, boundary = perm[:12], perm[12:20]
    weight[perm[:20]] = 0
    bias[first], bias[boundary] = 1.0, 0.6  # keys 1.5 and 1.1; every other key is below 1.1
    r = m.route_tokens(hidden, weight, bias, moe)
    want = sorted(first.tolist()) + sorted(boundary.tolist())[:4]
    assert r.ids.tolist() == [want] * b
    assert torch.equal(r.weights, torch.full((b, 16), 1 / 16))


# --- SiTU ----------------------------------------------------------------------------------------------


def situ_math(g: float, u: float, beta: float, beta_lin: float | None) -> float:
    gate = beta * math.tanh(g / beta) / (1.0 + math.exp(-g))
    up = beta_lin * math.tanh(u / beta_lin) if beta_lin is not None and beta_lin > 0 else u
    return gate * up


def test_situ_hand_values() -> None:
    g = torch.tensor([LN9, -LN9, LN9, 0.0, 0.0], dtype=F64)
    u = torch.tensor([UP15, UP15, -UP15, 7.0, 0.0], dtype=F64)
    want = torch.tensor([27.0, -3.0, -27.0, 0.0, 0.0], dtype=F64)  # 4·(±1/2)·(9/10 or 1/10)·(±15)
    assert torch.allclose(m.situ(g, u), want, rtol=1e-14, atol=1e-14)
    assert torch.allclose(m.situ(g.float(), u.float()), want.float(), rtol=1e-6, atol=1e-6)


def test_situ_limits() -> None:
    big = torch.tensor([60.0, -60.0], dtype=F64)
    one = torch.ones(2, dtype=F64)
    gate_part = m.situ(big, one, beta_lin=None)
    assert abs(gate_part[0].item() - 4.0) < 1e-12  # beta·tanh -> beta, sigmoid -> 1
    assert abs(gate_part[1].item()) < 1e-24  # beta·tanh -> -beta, but sigmoid -> 0
    u = torch.tensor([1e4, -1e4, 1e-3], dtype=F64)
    g = torch.full((3,), LN9, dtype=F64)
    got = m.situ(g, u)
    assert torch.allclose(got, torch.tensor([1.8 * 25, -1.8 * 25, 1.8 * 1e-3], dtype=F64), rtol=1e-9, atol=0)


@pytest.mark.parametrize("beta_lin", [None, 0.0, -1.0])
def test_situ_without_linear_clamp(beta_lin: float | None) -> None:
    g = torch.tensor([LN9, LN9], dtype=F64)
    u = torch.tensor([1000.0, -2.0], dtype=F64)
    assert torch.allclose(m.situ(g, u, beta_lin=beta_lin), 1.8 * u, rtol=1e-14, atol=0)


@settings(max_examples=200, deadline=None)
@given(
    st.floats(-100, 100),
    st.floats(-1e4, 1e4),
    st.sampled_from([4.0, 1.5]),
    st.sampled_from([25.0, 3.0, None, 0.0, -2.0]),
)
def test_situ_matches_math_reference(g: float, u: float, beta: float, beta_lin: float | None) -> None:
    got = m.situ(torch.tensor([g], dtype=F64), torch.tensor([u], dtype=F64), beta=beta, beta_lin=beta_lin)
    want = situ_math(g, u, beta, beta_lin)
    assert math.isclose(got.item(), want, rel_tol=1e-12, abs_tol=1e-290)


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 2**31))
def test_situ_is_bounded_by_beta_times_beta_lin(seed: int) -> None:
    x = 1e3 * torch.randn(2, 256, generator=gen(seed))
    assert m.situ(x[0], x[1]).abs().max() <= 4.0 * 25.0


def test_situ_and_mul_takes_gate_then_up() -> None:
    gu = torch.tensor([[LN9, -LN9, UP15, UP15]], dtype=F64)
    assert torch.allclose(m.situ_and_mul(gu), torch.tensor([[27.0, -3.0]], dtype=F64), rtol=1e-14, atol=0)
    with pytest.raises(ValueError):
        m.situ_and_mul(torch.zeros(1, 3))


# --- gated FFN and routed experts ----------------------------------------------------------------------


def test_gated_ffn_layout_is_gate_rows_then_up_rows() -> None:
    ffn = m.GatedFfn(torch.tensor([[LN9], [-LN9], [UP15], [UP15]], dtype=F64), torch.tensor([[1.0, 10.0]], dtype=F64))
    assert ffn.intermediate == 2
    out = m.gated_ffn(torch.ones(1, 1, dtype=F64), ffn)
    assert abs(out.item() - (27.0 - 30.0)) < 1e-12


def test_gated_ffn_shape_checks() -> None:
    with pytest.raises(ValueError):
        m.GatedFfn(torch.zeros(6, 4), torch.zeros(4, 2))
    with pytest.raises(ValueError):
        m.GatedFfn(torch.zeros(2, 4, 4), torch.zeros(3, 4, 2))
    with pytest.raises(ValueError):
        m.gated_ffn(torch.zeros(1, 4), m.GatedFfn(torch.zeros(2, 4, 4), torch.zeros(2, 4, 2)))


def random_routing(b: int, k: int, e: int, seed: int) -> tuple[Tensor, Tensor]:
    g = gen(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(b)])
    return ids, torch.rand(b, k, generator=g).float()


@pytest.mark.parametrize("hook", [None, fake_mxfp8])
def test_expert_loop_matches_batched_gather_bmm(mini_weights: m.LatentMoeWeights, hook: m.ActQuant | None) -> None:
    latent = torch.randn(7, K3_MINI.moe.latent_size, generator=gen(4), dtype=F64)
    ids, w = random_routing(7, K3_MINI.moe.top_k, K3_MINI.moe.num_experts, seed=5)
    loop = m.routed_experts(latent, ids, w, mini_weights.experts, act_quant=hook)
    batched = m.routed_experts_batched(latent, ids, w, mini_weights.experts, act_quant=hook)
    assert torch.allclose(loop, batched, rtol=1e-12, atol=1e-12)
    by_slot = sum(
        w[:, j, None].double()
        * torch.cat(
            [
                m.gated_ffn(latent[b : b + 1], mini_weights.experts.expert(int(ids[b, j])), act_quant=hook)
                for b in range(7)
            ]
        )
        for j in range(ids.shape[1])
    )
    assert torch.allclose(loop, by_slot, rtol=1e-12, atol=1e-12)


def test_activation_hook_sees_both_expert_gemm_inputs(mini_weights: m.LatentMoeWeights) -> None:
    seen: list[tuple[int, ...]] = []

    def record(x: Tensor) -> Tensor:
        seen.append(tuple(x.shape))
        return x

    latent = torch.randn(3, K3_MINI.moe.latent_size, generator=gen(6), dtype=F64)
    ids = torch.tensor([[0, 5], [5, 9], [0, 9]])
    w = torch.full((3, 2), 0.5)
    plain = m.routed_experts(latent, ids, w, mini_weights.experts)
    assert torch.equal(m.routed_experts(latent, ids, w, mini_weights.experts, act_quant=record), plain)
    lat, inter = K3_MINI.moe.latent_size, K3_MINI.moe.routed_intermediate
    assert sorted(seen) == sorted([(2, lat), (2, inter)] * 3)
    zero = m.routed_experts(latent, ids, w, mini_weights.experts, act_quant=torch.zeros_like)
    assert torch.equal(zero, torch.zeros_like(plain))
    quant = m.routed_experts(latent, ids, w, mini_weights.experts, act_quant=fake_mxfp8)
    rel = ((quant - plain).norm() / plain.norm()).item()
    assert 1e-4 < rel < 0.1
    with pytest.raises(ValueError):
        m.routed_experts(latent, ids, w, mini_weights.experts, act_quant=lambda x: x[:, :-1])


# --- TP sharding ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("tp", K3_MINI.parallel.tp_sizes)
def test_shards_have_rank_shapes_and_keep_the_gate_up_layout(mini_weights: m.LatentMoeWeights, tp: int) -> None:
    shapes = RankShapes.for_tp(K3_MINI, tp)
    inter, n, padded = K3_MINI.moe.routed_intermediate, shapes.routed_intermediate_unpadded, shapes.routed_intermediate
    full = mini_weights.experts
    for r in range(tp):
        sh = mini_weights.shard(K3_MINI, tp, r)
        assert sh.experts.gate_up.shape[1:] == shapes.expert_w13 and sh.experts.down.shape[1:] == shapes.expert_w2
        assert sh.shared.gate_up.shape == (2 * shapes.shared_intermediate, K3_MINI.hidden_size)
        rows = slice(r * n, (r + 1) * n)
        assert torch.equal(sh.experts.gate_up[:, :n], full.gate_up[:, rows])
        assert torch.equal(sh.experts.gate_up[:, padded : padded + n], full.gate_up[:, inter:][:, rows])
        assert torch.equal(sh.experts.down[..., :n], full.down[..., rows])
        assert not sh.experts.gate_up[:, n:padded].any() and not sh.experts.gate_up[:, padded + n :].any()
        assert not sh.experts.down[..., n:].any()
        assert sh.router is mini_weights.router and sh.latent_up is mini_weights.latent_up


def test_k3_tp16_expert_padding_192_to_256_changes_nothing() -> None:
    shapes = RankShapes.for_tp(K3, 16)
    assert (shapes.routed_intermediate_unpadded, shapes.routed_intermediate) == (192, 256)
    g, k = gen(8), 64  # the real intermediate, a narrow stand-in for the 3584 latent
    ffn = m.GatedFfn(
        torch.randn(2 * K3.moe.routed_intermediate, k, generator=g, dtype=F64) / k**0.5,
        torch.randn(k, K3.moe.routed_intermediate, generator=g, dtype=F64) / 3072**0.5,
    )
    x = torch.randn(4, k, generator=g, dtype=F64)
    full = m.gated_ffn(x, ffn)
    padded = [ffn.shard(16, r, padded=shapes.routed_intermediate) for r in range(16)]
    assert padded[0].gate_up.shape == (shapes.expert_w13[0], k)
    parts = [m.gated_ffn(x, p) for p in padded]
    assert torch.allclose(m.sum_rank_order(parts), full, rtol=1e-12, atol=1e-12)
    unpadded = [m.gated_ffn(x, ffn.shard(16, r)) for r in range(16)]
    assert all(torch.allclose(a, b, rtol=1e-13, atol=1e-15) for a, b in zip(parts, unpadded, strict=True))
    assert not torch.allclose(parts[0], full, rtol=1e-3, atol=1e-3)  # one rank alone is only a partial


def test_shard_rejects_bad_arguments() -> None:
    ffn = m.GatedFfn(torch.zeros(12, 4), torch.zeros(4, 6))
    for tp, rank, padded in [(4, 0, None), (3, 3, None), (3, -1, None), (3, 0, 1), (0, 0, None)]:
        with pytest.raises(ValueError):
            ffn.shard(tp, rank, padded)
    with pytest.raises(ValueError):
        m.random_latent_moe_weights(K3_MINI, generator=gen()).shard(K3_MINI, 3, 0)  # TP=3 is not offered


# --- latent MoE ----------------------------------------------------------------------------------------


def ref_latent_moe(hidden: Tensor, w: m.LatentMoeWeights, dims: ModelDims) -> Tensor:
    """Token by token in FP64 from the definitions, sharing no code with the oracle beyond the data."""
    moe, inter, s = dims.moe, dims.moe.routed_intermediate, dims.moe.shared_intermediate

    def act(g: Tensor, u: Tensor) -> Tensor:
        return 4.0 * torch.tanh(g / 4.0) * torch.sigmoid(g) * 25.0 * torch.tanh(u / 25.0)

    rows = []
    for x in hidden.double():
        logits = [torch.tensor(float(x @ r.double()), dtype=F64).float().item() for r in w.router]
        scores = [1.0 / (1.0 + math.exp(-lg)) for lg in logits]
        keys = [sc + float(bi) for sc, bi in zip(scores, w.e_score_correction_bias.tolist(), strict=True)]
        chosen = python_topk(keys, moe.top_k)
        total = sum(scores[e] for e in chosen) + 1e-20
        lat = w.latent_down.double() @ x
        routed = torch.zeros_like(lat)
        for e in chosen:
            h = w.experts.gate_up[e].double() @ lat
            routed += (
                scores[e] / total * moe.routed_scaling_factor * (w.experts.down[e].double() @ act(h[:inter], h[inter:]))
            )
        normed = routed / torch.sqrt(routed.square().mean() + dims.rms_norm_eps) * w.latent_norm.double()
        h = w.shared.gate_up.double() @ x
        shared = w.shared.down.double() @ act(h[:s], h[s:])
        rows.append(w.latent_up.double() @ normed + shared)
    return torch.stack(rows)


def test_latent_moe_matches_token_by_token_definition(mini_weights: m.LatentMoeWeights, mini_hidden: Tensor) -> None:
    trace = m.latent_moe(mini_hidden, mini_weights, K3_MINI)
    assert trace.out.shape == mini_hidden.shape and trace.out.dtype == F64
    assert torch.allclose(trace.out, ref_latent_moe(mini_hidden, mini_weights, K3_MINI), rtol=1e-6, atol=1e-6)


def test_latent_moe_fp32_weights_compute_in_fp32(mini_weights: m.LatentMoeWeights, mini_hidden: Tensor) -> None:
    w32 = m.random_latent_moe_weights(K3_MINI, generator=gen(11), dtype=F32)
    trace = m.latent_moe(mini_hidden, w32, K3_MINI)
    assert trace.out.dtype == F32 and trace.routed.dtype == F32
    assert torch.allclose(
        trace.out.double(), m.latent_moe(mini_hidden, mini_weights, K3_MINI).out, rtol=1e-4, atol=1e-4
    )


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tp_rank_partials_sum_to_the_tp1_result(mini_weights: m.LatentMoeWeights, mini_hidden: Tensor, tp: int) -> None:
    one = m.latent_moe(mini_hidden, mini_weights, K3_MINI)
    partials = [m.latent_moe_partial(mini_hidden, mini_weights.shard(K3_MINI, tp, r), K3_MINI) for r in range(tp)]
    many = m.latent_moe_combine(partials, mini_weights, K3_MINI)
    assert torch.equal(many.routing.ids, one.routing.ids)
    for name in ("routed", "normed", "shared", "out"):
        assert torch.allclose(getattr(many, name), getattr(one, name), rtol=1e-12, atol=1e-12), name
    assert torch.equal(m.latent_moe(mini_hidden, mini_weights, K3_MINI, tp=tp).out, many.out)
    # The norm belongs after the all-reduce: normalizing each rank's partial first gives another answer.
    early = sum(rms_norm(p.routed, mini_weights.latent_norm, K3_MINI.rms_norm_eps, dtype=F64) for p in partials)
    assert not torch.allclose(early, one.normed, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_with_blockwise_activation_quant(mini_weights: m.LatentMoeWeights, mini_hidden: Tensor, tp: int) -> None:
    # Shards of 64 and 32 keep the 32-wide quantization blocks of the full intermediate, so TP cannot
    # change the result (as for K3, whose 384 and 192 shards are whole blocks).
    one = m.latent_moe(mini_hidden, mini_weights, K3_MINI, act_quant=fake_mxfp8)
    many = m.latent_moe(mini_hidden, mini_weights, K3_MINI, tp=tp, act_quant=fake_mxfp8)
    assert torch.allclose(many.out, one.out, rtol=1e-12, atol=1e-12)
    plain = m.latent_moe(mini_hidden, mini_weights, K3_MINI)
    assert not torch.allclose(one.routed, plain.routed, rtol=1e-5, atol=1e-5)
    assert torch.equal(one.shared, plain.shared)  # the BF16 shared experts see no activation quantization


def test_bf16_two_shot_reduce_plugs_in(mini_weights: m.LatentMoeWeights, mini_hidden: Tensor) -> None:
    def two_shot(parts: list[Tensor]) -> Tensor:
        return allreduce.reduce_rank_order([p.to(torch.bfloat16) for p in parts]).double()

    exact = m.latent_moe(mini_hidden, mini_weights, K3_MINI, tp=4)
    bf16 = m.latent_moe(mini_hidden, mini_weights, K3_MINI, tp=4, reduce=two_shot)
    assert torch.equal(bf16.routed, bf16.routed.to(torch.bfloat16).double())
    assert torch.allclose(bf16.out, exact.out, rtol=2e-2, atol=2e-2)
    assert not torch.allclose(bf16.out, exact.out, rtol=1e-6, atol=1e-6)


def test_latent_norm_off(mini_weights: m.LatentMoeWeights, mini_hidden: Tensor) -> None:
    dims = dataclasses.replace(K3_MINI, moe=dataclasses.replace(K3_MINI.moe, latent_norm=False))
    on, off = m.latent_moe(mini_hidden, mini_weights, K3_MINI), m.latent_moe(mini_hidden, mini_weights, dims)
    assert torch.equal(off.normed, off.routed) and not torch.allclose(on.normed, on.routed)
    assert torch.allclose(off.out, off.routed @ mini_weights.latent_up.T + off.shared, rtol=1e-12, atol=1e-12)


def test_combine_rejects_ranks_that_route_differently(mini_weights: m.LatentMoeWeights, mini_hidden: Tensor) -> None:
    p = m.latent_moe_partial(mini_hidden, mini_weights.shard(K3_MINI, 2, 0), K3_MINI)
    other = dataclasses.replace(p, routing=dataclasses.replace(p.routing, ids=p.routing.ids.flip(-1)))
    with pytest.raises(ValueError, match="rank 1"):
        m.latent_moe_combine([p, other], mini_weights, K3_MINI)
    with pytest.raises(ValueError):
        m.latent_moe_combine([], mini_weights, K3_MINI)


def test_only_the_one_group_sigmoid_router_is_modelled(mini_weights: m.LatentMoeWeights, mini_hidden: Tensor) -> None:
    for change in ({"num_expert_group": 2}, {"topk_group": 2}, {"router_activation": "softmax"}):
        dims = dataclasses.replace(K3_MINI, moe=dataclasses.replace(K3_MINI.moe, **change))
        with pytest.raises(NotImplementedError):
            m.latent_moe(mini_hidden, mini_weights, dims)


# --- dense layer-0 MLP ---------------------------------------------------------------------------------


@pytest.mark.parametrize("tp", K3_MINI.parallel.tp_sizes)
def test_dense_mlp_tp_partials_sum_to_tp1(tp: int) -> None:
    ffn = m.random_dense_mlp(K3_MINI, generator=gen(9), dtype=F64)
    x = torch.randn(3, K3_MINI.hidden_size, generator=gen(10), dtype=F64)
    full = m.dense_mlp(x, ffn, K3_MINI)
    parts = m.dense_mlp_partials(x, ffn, K3_MINI, tp)
    assert len(parts) == tp
    assert torch.allclose(m.sum_rank_order(parts), full, rtol=1e-12, atol=1e-12)
    if tp > 1:
        assert not torch.allclose(parts[0], full, rtol=1e-3, atol=1e-3)
    assert ffn.shard(tp, 0).intermediate == RankShapes.for_tp(K3_MINI, tp).dense_intermediate


def test_dense_mlp_uses_the_model_situ_betas() -> None:
    ffn = m.GatedFfn(torch.tensor([[LN9], [UP15]], dtype=F64), torch.tensor([[1.0]], dtype=F64))
    assert abs(m.dense_mlp(torch.ones(1, 1, dtype=F64), ffn, K3_MINI).item() - 27.0) < 1e-12
    dims = dataclasses.replace(K3_MINI, moe=dataclasses.replace(K3_MINI.moe, situ_linear_beta=0.0))
    assert abs(m.dense_mlp(torch.ones(1, 1, dtype=F64), ffn, dims).item() - 1.8 * UP15) < 1e-12


def test_sum_rank_order_checks() -> None:
    with pytest.raises(ValueError):
        m.sum_rank_order([])
    with pytest.raises(ValueError):
        m.sum_rank_order([torch.zeros(2), torch.zeros(3)])
    assert m.sum_rank_order([torch.ones(2, dtype=torch.bfloat16)] * 3).dtype == F32
