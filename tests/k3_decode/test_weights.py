"""Synthetic weights: determinism, TP-shard consistency, padding, MXFP4 experts, magnitudes, byte accounting."""

from __future__ import annotations

import dataclasses
import time
from functools import cache

import pytest
import torch

from k3_decode.config import K3, K3_MINI, ModelDims, ShardError
from k3_decode.reference.mxfp import BLOCK, e8m0_to_float32, quantize_mxfp4
from k3_decode.weights import (
    LayerWeights,
    MoeWeights,
    Normal,
    SyntheticWeights,
    Uniform,
    draw,
    expert_bytes,
    memory_bytes,
    model_memory_bytes,
    named_tensors,
    stream_key,
)

MINI_TPS = (2, 4, 8)
# k3-mini: layer 0 is KDA + dense MLP, layer 1 KDA + MoE, layer 3 MLA + MoE.
MINI_LAYERS = (0, 1, 3)


@cache
def mini_layer(tp: int, rank: int, layer: int, seed: int = 0) -> dict[str, torch.Tensor]:
    return SyntheticWeights(K3_MINI, tp, rank, seed=seed).layer(layer).tensors()


@cache
def mini_layer_obj(tp: int, rank: int, layer: int) -> LayerWeights:
    return SyntheticWeights(K3_MINI, tp, rank).layer(layer)


def mla_first(dims: ModelDims) -> ModelDims:
    """The same model with layer 0 as MLA, so MLA + dense MLP can be generated too."""
    return dataclasses.replace(dims, full_attn_layers=(1, *dims.full_attn_layers))


# --- determinism -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layer", MINI_LAYERS)
def test_same_seed_is_bit_identical(layer: int) -> None:
    a = SyntheticWeights(K3_MINI, 2, 1, seed=5).layer(layer).tensors()
    b = SyntheticWeights(K3_MINI, 2, 1, seed=5).layer(layer).tensors()
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("layer", MINI_LAYERS)
def test_other_seed_or_layer_changes_every_tensor(layer: int) -> None:
    base = mini_layer(2, 0, layer)
    other_seed = mini_layer(2, 0, layer, seed=1)
    other_layer = mini_layer(2, 0, {0: 1, 1: 5, 3: 7}[layer])  # same attention kind, another index
    for name, t in base.items():
        assert not torch.equal(t, other_seed[name]), f"{name} ignores the seed"
        if name in other_layer:
            assert not torch.equal(t, other_layer[name]), f"{name} ignores the layer"
    assert len(base.keys() & other_layer.keys()) >= 13


REPLICATED = {
    "residual.attn_res.norm",
    "residual.attn_res.proj",
    "residual.mlp_res.norm",
    "residual.mlp_res.proj",
    "residual.input_norm",
    "residual.post_attn_norm",
    "attention.o_norm",
    "attention.q_a_norm",
    "attention.kv_a_norm",
    "mlp.router",
    "mlp.router_bias",
    "mlp.latent_down",
    "mlp.latent_norm",
    "mlp.latent_up",
}


@pytest.mark.parametrize("layer", MINI_LAYERS)
def test_ranks_differ_exactly_where_sharded(layer: int) -> None:
    r0, r1 = mini_layer(2, 0, layer), mini_layer(2, 1, layer)
    for name in r0:
        same = torch.equal(r0[name], r1[name])
        assert same == (name in REPLICATED), name


# --- TP shards compose to the TP=1 weight ----------------------------------------------------------------------


def cat_ranks(tp: int, layer: int, name: str, dim: int) -> torch.Tensor:
    return torch.cat([mini_layer(tp, r, layer)[name] for r in range(tp)], dim=dim)


DIM0 = {"attention.f_b", "attention.a_log", "attention.dt_bias", "attention.q_b", "attention.w_uk", "attention.w_uv"}
DIM1 = {"attention.o_proj", "mlp.down", "mlp.shared.down"}
PACKED = {
    "attention.in_proj",
    "attention.conv",
    "attention.qkv_a_g",
    "mlp.gate_up",
    "mlp.shared.gate_up",
    "mlp.w13.data",
    "mlp.w13.scales",
    "mlp.w2.data",
    "mlp.w2.scales",
}


def test_every_tensor_has_a_sharding_rule() -> None:
    names = set().union(*(mini_layer(1, 0, i).keys() for i in MINI_LAYERS))
    assert names == REPLICATED | DIM0 | DIM1 | PACKED


@pytest.mark.parametrize("tp", MINI_TPS)
@pytest.mark.parametrize("layer", MINI_LAYERS)
def test_plain_shards_concatenate_to_tp1(tp: int, layer: int) -> None:
    full = mini_layer(1, 0, layer)
    for name, t in full.items():
        if name in REPLICATED:
            for r in range(tp):
                assert torch.equal(mini_layer(tp, r, layer)[name], t), name
        elif name in DIM0 or name in DIM1:
            assert torch.equal(cat_ranks(tp, layer, name, 0 if name in DIM0 else 1), t), name


@pytest.mark.parametrize("tp", MINI_TPS)
@pytest.mark.parametrize("layer", [0, 1])
def test_kda_in_proj_sections_and_conv_compose(tp: int, layer: int) -> None:
    full = mini_layer(1, 0, layer)["attention.in_proj"]
    full_sec = K3_MINI.shard(1).in_proj_sections()
    local_sec = K3_MINI.shard(tp).in_proj_sections()
    shards = [mini_layer(tp, r, layer)["attention.in_proj"] for r in range(tp)]
    for name in ("q", "k", "v", "g", "beta"):
        assert torch.equal(torch.cat([s[local_sec[name]] for s in shards]), full[full_sec[name]]), name
    for s in shards:
        assert torch.equal(s[local_sec["f_a"]], full[full_sec["f_a"]])
        assert s[local_sec["pad"]].shape[0] > 0 and bool((s[local_sec["pad"]] == 0).all())
    assert bool((full[full_sec["pad"]] == 0).all())
    # conv channels are [q | k | v], each third sharded on its own.
    conv_full = mini_layer(1, 0, layer)["attention.conv"].chunk(3)
    conv = [mini_layer(tp, r, layer)["attention.conv"].chunk(3) for r in range(tp)]
    for c in range(3):
        assert torch.equal(torch.cat([shard[c] for shard in conv]), conv_full[c])


@pytest.mark.parametrize("tp", MINI_TPS)
def test_mla_qkv_a_g_composes(tp: int) -> None:
    full = mini_layer(1, 0, 3)["attention.qkv_a_g"]
    replicated = K3_MINI.mla.q_lora_rank + K3_MINI.mla.cache_row
    shards = [mini_layer(tp, r, 3)["attention.qkv_a_g"] for r in range(tp)]
    for s in shards:
        assert s.shape[0] == K3_MINI.shard(tp).mla_qkv_a_g_rows
        assert torch.equal(s[:replicated], full[:replicated])
    assert torch.equal(torch.cat([s[replicated:] for s in shards]), full[replicated:])


@pytest.mark.parametrize("tp", MINI_TPS)
@pytest.mark.parametrize(("layer", "name", "inter"), [(0, "mlp.gate_up", "dense"), (1, "mlp.shared.gate_up", "shared")])
def test_gate_up_halves_compose(tp: int, layer: int, name: str, inter: str) -> None:
    full_gate, full_up = mini_layer(1, 0, layer)[name].chunk(2)
    halves = [mini_layer(tp, r, layer)[name].chunk(2) for r in range(tp)]
    assert torch.equal(torch.cat([h[0] for h in halves]), full_gate)
    assert torch.equal(torch.cat([h[1] for h in halves]), full_up)
    local = getattr(K3_MINI.shard(tp), f"{inter}_intermediate")
    assert halves[0][0].shape[0] == local


@pytest.mark.parametrize("tp", MINI_TPS)
def test_mxfp4_experts_compose(tp: int) -> None:
    shapes = K3_MINI.shard(tp)
    real, padded, full_i = (
        shapes.routed_intermediate_unpadded,
        shapes.routed_intermediate,
        K3_MINI.moe.routed_intermediate,
    )
    full = mini_layer_obj(1, 0, 1).mlp
    assert isinstance(full, MoeWeights)
    full13, full2 = full.w13.dequantize(), full.w2.dequantize()
    ranks = [mini_layer_obj(tp, r, 1).mlp for r in range(tp)]
    gates, ups, downs = [], [], []
    for r, moe in enumerate(ranks):
        assert isinstance(moe, MoeWeights)
        w13, w2 = moe.w13.dequantize(), moe.w2.dequantize()
        gates.append(w13[:, :real])
        ups.append(w13[:, padded : padded + real])
        downs.append(w2[..., :real])
        assert bool((w13[:, real:padded] == 0).all()) and bool((w13[:, padded + real :] == 0).all())
        assert bool((w2[..., real:] == 0).all())
        # w13 rows are whole MXFP4 rows of the TP=1 tensor: bytes, not just values, agree.
        rows = slice(r * real, (r + 1) * real)
        assert torch.equal(moe.w13.data[:, :real], full.w13.data[:, rows])
        assert torch.equal(moe.w13.scales[:, :real], full.w13.scales[:, rows])
    assert torch.equal(torch.cat(gates, dim=1), full13[:, :full_i])
    assert torch.equal(torch.cat(ups, dim=1), full13[:, full_i:])
    # w2's blocks run along the sharded dim; at TP8 (16 real columns) each rank holds half a logical block.
    assert torch.equal(torch.cat(downs, dim=-1), full2)


def test_w2_shard_that_would_split_a_scale_block_is_rejected() -> None:
    moe = dataclasses.replace(K3_MINI.moe, routed_intermediate=96, min_intermediate_per_partition=64)
    dims = dataclasses.replace(K3_MINI, moe=moe)
    SyntheticWeights(dims, 2, 0).mlp(1, experts=[0])  # columns 0..47 fit blocks 0 and 1
    with pytest.raises(ValueError, match="mix two MXFP4 scale blocks"):
        SyntheticWeights(dims, 2, 1).mlp(1, experts=[0])  # local block 0 would hold logical columns 48..79


@pytest.mark.parametrize("tp", MINI_TPS)
def test_model_weights_compose(tp: int) -> None:
    full = SyntheticWeights(K3_MINI, 1, 0).model().tensors()
    ranks = [SyntheticWeights(K3_MINI, tp, r).model().tensors() for r in range(tp)]
    for name in ("embedding", "lm_head"):
        assert torch.equal(torch.cat([r[name] for r in ranks]), full[name])
    for name in ("final_res.norm", "final_res.proj", "final_norm"):
        assert all(torch.equal(r[name], full[name]) for r in ranks)
    assert not torch.equal(full["embedding"], full["lm_head"])


# --- shapes, dtypes, magnitudes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("tp", (1, *MINI_TPS))
def test_shapes_follow_rank_shapes(tp: int) -> None:
    s = K3_MINI.shard(tp)
    kda, mla = mini_layer(tp, 0, 1), mini_layer(tp, 0, 3)
    assert kda["attention.in_proj"].shape == (s.kda_in_proj_rows, s.hidden)
    assert kda["attention.f_b"].shape == s.kda_f_b
    assert kda["attention.o_proj"].shape == s.kda_o_proj
    assert kda["attention.conv"].shape == (s.kda_conv_state[0], K3_MINI.kda.conv_width)
    assert kda["attention.a_log"].shape == (s.kda_heads,) and kda["attention.dt_bias"].shape == (s.kda_proj,)
    assert mla["attention.q_b"].shape == s.mla_q_b
    assert mla["attention.w_uk"].shape == s.mla_w_uk and mla["attention.w_uv"].shape == s.mla_w_uv
    assert mla["attention.o_proj"].shape == s.mla_o_proj
    assert kda["mlp.router"].shape == s.router and kda["mlp.latent_down"].shape == s.latent_down
    assert kda["mlp.latent_up"].shape == s.latent_up
    e = K3_MINI.moe.num_experts
    assert kda["mlp.w13.data"].shape == (e, s.expert_w13[0], s.expert_w13[1] // 2)
    assert kda["mlp.w13.scales"].shape == (e, s.expert_w13[0], s.expert_w13[1] // BLOCK)
    assert kda["mlp.w2.data"].shape == (e, s.expert_w2[0], s.expert_w2[1] // 2)
    fp32 = {"attention.a_log", "attention.dt_bias", "mlp.router_bias"}
    for name, t in {**kda, **mla}.items():
        want = (
            torch.uint8 if name.startswith(("mlp.w13", "mlp.w2")) else torch.float32 if name in fp32 else torch.bfloat16
        )
        assert t.dtype == want, name


def test_float32_dtype_holds_the_bf16_values() -> None:
    bf16 = mini_layer(2, 1, 1)
    f32 = SyntheticWeights(K3_MINI, 2, 1, dtype=torch.float32).layer(1).tensors()
    for name, t in bf16.items():
        if t.dtype == torch.bfloat16:
            assert f32[name].dtype == torch.float32 and torch.equal(f32[name], t.float()), name
        else:
            assert torch.equal(f32[name], t), name


def _std_times_sqrt_fan_in(t: torch.Tensor, fan_in: int) -> float:
    return t.float().std().item() * fan_in**0.5


def test_projection_scales_preserve_rms() -> None:
    # std ~ 1/sqrt(logical fan-in): a unit-RMS input gives a unit-RMS output, per rank and after the TP reduce.
    d, h = K3_MINI, K3_MINI.hidden_size
    kda, mla, dense, moe = (mini_layer(1, 0, i) for i in (0, 3, 0, 1))
    checks = [
        (kda["attention.in_proj"][: 4 * d.kda.proj_size], h),
        (kda["attention.f_b"], d.kda.gate_rank),
        (kda["attention.o_proj"], d.kda.proj_size),
        (mla["attention.qkv_a_g"], h),
        (mla["attention.q_b"], d.mla.q_lora_rank),
        (mla["attention.w_uk"], d.mla.kv_lora_rank),
        (mla["attention.w_uv"], d.mla.kv_lora_rank),
        (mla["attention.o_proj"], d.mla.num_heads * d.mla.v_head_dim),
        (dense["mlp.gate_up"], h),
        (dense["mlp.down"], d.moe.dense_intermediate),
        (moe["mlp.router"], h),
        (moe["mlp.latent_down"], h),
        (moe["mlp.latent_up"], d.moe.latent_size),
        (moe["mlp.shared.gate_up"], h),
        (moe["mlp.shared.down"], d.moe.shared_intermediate),
        (moe["residual.attn_res.proj"], h),
    ]
    for t, fan_in in checks:
        assert 0.9 < _std_times_sqrt_fan_in(t, fan_in) < 1.1
    for name in ("residual.input_norm", "attention.o_norm", "mlp.latent_norm"):
        t = {**kda, **moe}[name].float()
        assert 0.95 < t.mean().item() < 1.05 and 0.05 < t.std().item() < 0.15 and t.min().item() > 0.5
    bias = moe["mlp.router_bias"]
    assert bias.abs().max().item() < 0.05 and bias.std().item() > 0.003


def test_kda_gates_spread_over_lower_bound_to_zero() -> None:
    w = mini_layer_obj(1, 0, 1).attention
    sec = K3_MINI.shard(1).in_proj_sections()
    x = torch.randn(2048, K3_MINI.hidden_size, generator=torch.Generator().manual_seed(0))
    f_a = x @ w.in_proj[sec["f_a"]].float().T
    z = torch.exp(w.a_log).repeat_interleave(K3_MINI.kda.head_dim) * (f_a @ w.f_b.float().T + w.dt_bias)
    g = K3_MINI.kda.gate_lower_bound * torch.sigmoid(z)
    lb = K3_MINI.kda.gate_lower_bound
    q = torch.quantile(g.flatten()[::7], torch.tensor([0.05, 0.5, 0.95])).tolist()
    assert q[0] < 0.75 * lb and 0.7 * lb < q[1] < 0.2 * lb and q[2] > 0.15 * lb
    beta = torch.sigmoid(x @ w.in_proj[sec["beta"]].float().T)
    assert beta.quantile(0.1).item() > 0.1 and beta.quantile(0.9).item() < 0.9


def situ(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    b, bl = K3_MINI.moe.situ_beta, K3_MINI.moe.situ_linear_beta
    return b * torch.tanh(g / b) * torch.sigmoid(g) * bl * torch.tanh(u / bl)


def test_expert_and_mlp_chains_stay_in_range() -> None:
    moe = mini_layer_obj(1, 0, 1).mlp
    dense = mini_layer_obj(1, 0, 0).mlp
    assert isinstance(moe, MoeWeights)
    x = torch.randn(512, K3_MINI.hidden_size, generator=torch.Generator().manual_seed(1))
    latent = x @ moe.latent_down.float().T
    latent = latent * torch.rsqrt(latent.pow(2).mean(-1, keepdim=True))
    w13, w2 = moe.w13.dequantize(), moe.w2.dequantize()
    for e in (0, 7, 15):
        gate, up = (latent @ w13[e].T).chunk(2, dim=-1)
        assert 0.7 < gate.std().item() < 1.4 and 0.7 < up.std().item() < 1.4
        out = situ(gate, up) @ w2[e].T
        assert 0.1 < out.pow(2).mean().sqrt().item() < 2.0
    gate, up = (x @ dense.gate_up.float().T).chunk(2, dim=-1)
    out = situ(gate, up) @ dense.down.float().T
    assert 0.1 < out.pow(2).mean().sqrt().item() < 2.0


def test_mxfp4_experts_realistic_and_close_to_their_bf16_source() -> None:
    moe = mini_layer_obj(1, 0, 1).mlp
    assert isinstance(moe, MoeWeights)
    lat, inter = K3_MINI.moe.latent_size, K3_MINI.moe.routed_intermediate
    w13 = moe.w13.dequantize()
    assert w13.shape == (K3_MINI.moe.num_experts, 2 * inter, lat)
    assert 0.85 < w13.std().item() * lat**0.5 < 1.15
    assert 0.85 < moe.w2.dequantize().std().item() * inter**0.5 < 1.15
    # Scale bytes sit where N(0, 1/lat) blocks put them: amax ~ 2-3 sd -> 2^(floor(log2 amax) - 2).
    scales = e8m0_to_float32(moe.w13.scales)
    assert scales.min().item() >= 2.0**-7 and scales.max().item() <= 2.0**-4
    # The source of expert 3's w13 is the BF16 rounding of its counter-based draw; MXFP4 stays within ~20%.
    key = torch.tensor(stream_key(0, 1, "moe.experts.w13", 3)).expand(2 * inter, 2)
    src = draw(key, torch.arange(2 * inter), torch.arange(lat), Normal(lat**-0.5)).to(torch.bfloat16).float()
    err = (w13[3] - src).norm() / src.norm()
    assert 0.03 < err.item() < 0.2


@pytest.mark.parametrize(("dims", "tp", "rank"), [(K3_MINI, 1, 0), (K3_MINI, 4, 1), (K3, 16, 15)])
def test_experts_are_mxfp4_of_their_bf16_source(dims: ModelDims, tp: int, rank: int) -> None:
    # Where a shard is block-aligned, its bytes must equal quantize_mxfp4 of the BF16-rounded draw of its logical
    # rows/columns with the zero padding in place (K3 TP16 pads 192 -> 256, so whole pad blocks get scale 0).
    s, moe, e = dims.shard(tp), dims.moe, 5
    real, padded, full, lat = (
        s.routed_intermediate_unpadded,
        s.routed_intermediate,
        moe.routed_intermediate,
        moe.latent_size,
    )
    w13, w2 = SyntheticWeights(dims, tp, rank).experts(1, [e])
    pad = torch.full((padded - real,), -1)
    mine = torch.arange(rank * real, (rank + 1) * real)
    rows13 = torch.cat([mine, pad, full + mine, pad])
    key13 = torch.tensor(stream_key(0, 1, "moe.experts.w13", e)).expand(len(rows13), 2)
    src13 = draw(key13, rows13, torch.arange(lat), Normal(lat**-0.5)).to(torch.bfloat16)
    q13 = quantize_mxfp4(src13)
    assert torch.equal(w13.data[0], q13.data) and torch.equal(w13.scales[0], q13.scales)
    key2 = torch.tensor(stream_key(0, 1, "moe.experts.w2", e)).expand(lat, 2)
    src2 = draw(key2, torch.arange(lat), torch.cat([mine, pad]), Normal(full**-0.5)).to(torch.bfloat16)
    q2 = quantize_mxfp4(src2)
    assert torch.equal(w2.data[0], q2.data) and torch.equal(w2.scales[0], q2.scales)
    if padded > real:
        assert bool((w2.scales[0, :, real // BLOCK :] == 0).all())


def test_mla_w_uk_and_w_uv_are_disjoint_halves_of_kv_b() -> None:
    # Both come from one logical kv_b [H * (nope + v), kv_lora]; every row of it appears exactly once.
    mla = mini_layer_obj(1, 0, 3).attention
    kv = K3_MINI.mla.kv_lora_rank
    rows = torch.cat([mla.w_uk.reshape(-1, kv), mla.w_uv.transpose(1, 2).reshape(-1, kv)])
    assert torch.unique(rows, dim=0).shape[0] == rows.shape[0]
    assert rows.shape[0] == K3_MINI.mla.num_heads * (K3_MINI.mla.qk_nope_head_dim + K3_MINI.mla.v_head_dim)


def test_expert_subset_equals_slice_of_all_experts() -> None:
    full = mini_layer_obj(4, 2, 1).mlp
    sub = SyntheticWeights(K3_MINI, 4, 2, expert_batch_elems=1).mlp(1, experts=[9, 2])
    assert isinstance(full, MoeWeights) and isinstance(sub, MoeWeights)
    assert sub.expert_ids == (9, 2)
    for part in ("w13", "w2"):
        for field in ("data", "scales"):
            got = getattr(getattr(sub, part), field)
            assert torch.equal(got, getattr(getattr(full, part), field)[[9, 2]]), (part, field)


# --- the draws ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("init", [Normal(0.5), Normal(0.1, 1.0), Uniform(-2.0, 1.0)])
def test_numpy_and_torch_backends_are_bit_identical(init) -> None:
    g = torch.Generator().manual_seed(3)
    keys = torch.randint(0, 2**32, (300, 2), generator=g)
    rows = torch.randint(-1, 1 << 30, (300,), generator=g)
    cols = torch.randint(-1, 1 << 30, (70,), generator=g)
    a = draw(keys, rows, cols, init, backend="numpy", chunk=1000)
    b = draw(keys, rows, cols, init, backend="torch", chunk=333)
    assert torch.equal(a, b)
    assert bool((a[rows < 0] == 0).all()) and bool((a[:, cols < 0] == 0).all())


def test_draw_statistics() -> None:
    key = torch.tensor(stream_key(0, 0, "x")).expand(512, 2)
    x = draw(key, torch.arange(512), torch.arange(512), Normal(2.0)).double()
    assert abs(x.mean().item()) < 0.02 and abs(x.std().item() - 2.0) < 0.02
    assert x.abs().max().item() <= 6.0 + 1e-6  # Irwin-Hall(3) is bounded at 3 sd
    z = (x - x.mean()) / x.std()

    def corr(a: torch.Tensor, b: torch.Tensor) -> float:
        return (a * b).mean().item()

    assert abs(corr(z[1:], z[:-1])) < 0.01 and abs(corr(z[:, 1:], z[:, :-1])) < 0.01
    # Different keys (neighbouring experts) and a shifted row range are uncorrelated too.
    other = draw(torch.tensor(stream_key(0, 0, "x", 1)).expand(512, 2), torch.arange(512), torch.arange(512), Normal(1))
    assert abs(corr(z, (other - other.mean()) / other.std())) < 0.01
    u = draw(key[:256], torch.arange(256), torch.arange(256), Uniform(0.0, 1.0))
    assert u.min().item() >= 0 and u.max().item() < 1 and abs(u.mean().item() - 0.5) < 0.01


def test_stream_keys_separate_every_field() -> None:
    base = stream_key(0, 1, "a", 2)
    assert (
        len(
            {
                base,
                stream_key(1, 1, "a", 2),
                stream_key(0, 2, "a", 2),
                stream_key(0, 1, "b", 2),
                stream_key(0, 1, "a", 3),
            }
        )
        == 5
    )
    assert all(0 <= k < 2**32 for k in base)


# --- byte accounting ---------------------------------------------------------------------------------------------


def _nbytes(tensors: dict[str, torch.Tensor], prefix: str) -> int:
    return sum(t.numel() * t.element_size() for n, t in tensors.items() if n.startswith(prefix))


@pytest.mark.parametrize("tp", (1, *MINI_TPS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("dims", "layer"), [(K3_MINI, 0), (K3_MINI, 1), (K3_MINI, 3), (mla_first(K3_MINI), 0)])
def test_memory_bytes_match_generated_tensors(tp: int, dtype: torch.dtype, dims: ModelDims, layer: int) -> None:
    w = SyntheticWeights(dims, tp, tp - 1, dtype=dtype).layer(layer)
    got = memory_bytes(dims, tp, w.kind, w.mlp_kind, dtype)
    t = w.tensors()
    experts = _nbytes(t, "mlp.w13") + _nbytes(t, "mlp.w2")
    assert got.residual == _nbytes(t, "residual.")
    assert got.attention == _nbytes(t, "attention.")
    assert got.experts == experts
    assert got.mlp == _nbytes(t, "mlp.") - experts
    assert got.total == sum(x.numel() * x.element_size() for x in t.values())


@pytest.mark.parametrize("tp", (1, *MINI_TPS))
def test_model_memory_bytes_match(tp: int) -> None:
    t = SyntheticWeights(K3_MINI, tp, 0).model().tensors()
    assert model_memory_bytes(K3_MINI, tp) == sum(x.numel() * x.element_size() for x in t.values())


@pytest.mark.parametrize(
    ("tp", "kda_mb", "mla_mb", "moe_mb", "expert_mb", "all_experts_gb"),
    [(8, 112.6, 84.5, 148.6, 2.19, 181), (16, 57.3, 57.4, 132.1, 1.46, 120)],
)
def test_k3_bytes_match_the_fact_sheet(
    tp: int, kda_mb: float, mla_mb: float, moe_mb: float, expert_mb: float, all_experts_gb: float
) -> None:
    # Figures of the K3 fact sheet (section 1.3), derived there from vLLM 0.33.0's shapes independently of us.
    kda, mla = memory_bytes(K3, tp, "kda"), memory_bytes(K3, tp, "mla")
    assert kda.attention / 1e6 == pytest.approx(kda_mb, abs=0.1)
    assert mla.attention / 1e6 == pytest.approx(mla_mb, abs=0.1)
    assert kda.mlp / 1e6 == pytest.approx(moe_mb, abs=0.1)
    assert expert_bytes(K3.shard(tp)) / 1e6 == pytest.approx(expert_mb, abs=0.01)
    moe_layers = K3.num_layers - K3.first_k_dense
    assert moe_layers * kda.experts / 1e9 == pytest.approx(all_experts_gb, rel=0.01)
    assert memory_bytes(K3, tp, "kda", "dense").experts == 0


def test_memory_bytes_rejects_unknown_kinds() -> None:
    with pytest.raises(ValueError, match="layer kind"):
        memory_bytes(K3_MINI, 2, "gqa")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="MLP kind"):
        memory_bytes(K3_MINI, 2, "kda", "mixture")  # type: ignore[arg-type]


# --- argument checks ---------------------------------------------------------------------------------------------


def test_bad_arguments_rejected() -> None:
    with pytest.raises(ShardError):
        SyntheticWeights(K3_MINI, 3, 0)
    with pytest.raises(ValueError, match="rank 2 is outside"):
        SyntheticWeights(K3_MINI, 2, 2)
    with pytest.raises(ValueError, match="floating"):
        SyntheticWeights(K3_MINI, 2, 0, dtype=torch.int8)
    sw = SyntheticWeights(K3_MINI, 2, 0)
    with pytest.raises(ValueError, match="layer 12 is outside"):
        sw.attention(12)
    with pytest.raises(ValueError, match="expert ids"):
        sw.mlp(1, experts=[16])
    with pytest.raises(ValueError, match="dense MLP"):
        sw.experts(0)
    one_key, one = torch.zeros(1, 2, dtype=torch.int64), torch.zeros(1)
    with pytest.raises(ValueError, match="unknown backend"):
        draw(one_key, one, one, Normal(1), backend="cuda")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="CPU only"):
        draw(one_key, one, one, Normal(1), "meta", "numpy")


# --- real size -----------------------------------------------------------------------------------------------------


def test_real_k3_tp8_kda_attention_generates_quickly() -> None:
    sw = SyntheticWeights(K3, 8, 5)
    start = time.perf_counter()
    w = sw.attention(0)
    elapsed = time.perf_counter() - start
    t = named_tensors(w)
    assert sum(x.numel() * x.element_size() for x in t.values()) == memory_bytes(K3, 8, "kda").attention
    assert w.in_proj.shape == (6288, 7168)  # the fact sheet's packed row count at TP8
    pad = K3.shard(8).in_proj_sections()["pad"]
    assert pad.stop - pad.start == 4 and bool((w.in_proj[pad] == 0).all())
    assert 0.9 < _std_times_sqrt_fan_in(w.in_proj[: pad.start - 140], 7168) < 1.1
    assert 0.9 < _std_times_sqrt_fan_in(w.o_proj, 12288) < 1.1
    # A few seconds on a 2-core CI machine; the bound only catches a pathological slowdown.
    assert elapsed < 30, f"{elapsed:.1f} s"


def test_real_k3_expert_subset_at_tp8_and_tp16() -> None:
    for tp, inter in ((8, 384), (16, 192)):
        s = K3.shard(tp)
        w13, w2 = SyntheticWeights(K3, tp, tp - 1).experts(1, [895])
        assert w13.data.shape == (1, s.expert_w13[0], 1792) and w13.scales.shape == (1, s.expert_w13[0], 112)
        assert w2.data.shape == (1, 3584, s.routed_intermediate // 2)
        assert w2.scales.shape == (1, 3584, s.routed_intermediate // BLOCK)
        assert w13.nbytes + w2.nbytes == expert_bytes(s)
        down = w2.dequantize()
        assert bool((down[..., inter:] == 0).all())  # TP16 pads 192 -> 256 columns
        assert 0.85 < down[..., :inter].std().item() * 3072**0.5 < 1.15
        assert 0.85 < w13.dequantize()[:, :inter].std().item() * 3584**0.5 < 1.15


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_weights_equal_cpu_weights() -> None:
    for layer in (1, 3):
        cpu = SyntheticWeights(K3_MINI, 4, 3).layer(layer).tensors()
        gpu = SyntheticWeights(K3_MINI, 4, 3, device="cuda").layer(layer).tensors()
        for name, t in cpu.items():
            assert gpu[name].is_cuda and torch.equal(gpu[name].cpu(), t), name
