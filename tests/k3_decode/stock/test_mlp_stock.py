"""The stock dense layer-0 MLP and SiTU-and-mul on the CPU ("torch-cpu") against the oracles, at k3-mini dims."""

from __future__ import annotations

import pytest
import torch

from k3_decode.config import K3_MINI
from k3_decode.reference import moe as ref
from k3_decode.stock import mlp
from k3_decode.stock.moe import StockMoeOps, rank_order_all_reduce
from k3_decode.weights import DenseMlpWeights, SyntheticWeights
from tests.k3_decode.stock.test_moe_helpers import assert_matches, failures, hidden

DIMS = K3_MINI


def dense_weights(tp: int, rank: int) -> DenseMlpWeights:
    weights = SyntheticWeights(DIMS, tp, rank).mlp(0)
    assert isinstance(weights, DenseMlpWeights)
    return weights


@pytest.mark.parametrize(("tp", "rank"), [(1, 0), (2, 1), (8, 5)])
@pytest.mark.parametrize("batch", [1, 6])
def test_dense_mlp_partial_matches_the_oracle(tp: int, rank: int, batch: int) -> None:
    weights = dense_weights(tp, rank)
    x = hidden(batch, seed=batch + tp)
    out = StockMoeOps(DIMS, tp).dense(x, weights)
    assert out.dtype == torch.bfloat16 and out.shape == (batch, DIMS.hidden_size)
    assert_matches("dense_mlp.bfloat16", out, ref.dense_mlp(x, mlp.as_gated_ffn(weights), DIMS))


@pytest.mark.parametrize("tp", [2, 4])
def test_dense_partials_all_reduced_match_the_full_mlp(tp: int) -> None:
    x = hidden(4, seed=tp)
    ops = StockMoeOps(DIMS, tp)
    out = rank_order_all_reduce([ops.dense(x, dense_weights(tp, r)) for r in range(tp)])
    full = ref.dense_mlp(x, mlp.as_gated_ffn(dense_weights(1, 0)), DIMS)
    assert_matches("dense_mlp.bfloat16", out, full)


def test_situ_and_mul_matches_the_oracle_over_its_range() -> None:
    g = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(64, 512, generator=g) * 20).bfloat16()  # covers both tanh clamps (|g| >> 4, |u| >> 25)
    out = mlp.situ_and_mul_torch(gate_up, DIMS.moe.situ_beta, DIMS.moe.situ_linear_beta)
    assert_matches("situ_and_mul.bfloat16", out, ref.situ_and_mul(gate_up.double()), rel_l2=None)
    assert float(out.float().abs().max()) > 50  # the clamped range was reached
    small = (gate_up.float() / 4).bfloat16()  # |u| < 25 keeps the unclamped outputs below 100 too
    unclamped = mlp.situ_and_mul_torch(small, 4.0, None)
    assert_matches("situ_and_mul.bfloat16", unclamped, ref.situ_and_mul(small.double(), beta_lin=None), rel_l2=None)
    assert failures("situ_and_mul.bfloat16", unclamped, ref.situ_and_mul(small.double()), rel_l2=None)


def test_gemm_rounds_once_from_fp32() -> None:
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(3, 64, generator=g).bfloat16(), torch.randn(32, 64, generator=g).bfloat16()
    assert torch.equal(mlp.linear_bf16(x, w, "torch-cpu"), (x.double() @ w.double().T).float().bfloat16())


def test_bad_dense_inputs_name_the_fix() -> None:
    weights = dense_weights(1, 0)
    ops = StockMoeOps(DIMS, 1)
    with pytest.raises(ValueError, match=r"dense MLP: hidden must be BF16 \[B, 256\], got torch\.float32"):
        ops.dense(hidden(2).float(), weights)
    with pytest.raises(ValueError, match=r"dense MLP gate_up \(512, 256\) is not \(1024, 256\) at TP=1"):
        ops.dense(hidden(2), dense_weights(2, 0))
    half = DenseMlpWeights(weights.gate_up.float(), weights.down.float())
    with pytest.raises(ValueError, match=r"runs BF16 weights; load them with dtype=torch\.bfloat16"):
        ops.dense(hidden(2), half)
    with pytest.raises(ValueError, match=r"are not \[2I, H\] and \[H, I\]"):
        ops.dense(hidden(2), DenseMlpWeights(weights.gate_up, weights.down[:, :7]))
