"""Stock gated MLPs of Kimi K3 decode: the dense layer-0 MLP and the shared experts of every MoE layer.

Both are gate_up GEMM -> SiTU-and-mul -> down GEMM, three launches, as vLLM 0.33.0 runs them on an H200
(k3_facts section 2.E and 2.F.2: `MergedColumnParallelLinear`, `situ_and_mul`, `RowParallelLinear`; the TP
all-reduce after the down GEMM is elided here, because one GPU holds one rank's shapes). Numerics of every
implementation: BF16 GEMM outputs from FP32 accumulation, SiTU in FP32 rounded once to BF16.

Implementations (named in the dispatch ledger):
- "triton": the GEMMs are cuBLAS through torch, SiTU-and-mul is a Triton kernel (triton_moe/elementwise.py).
- "torch-cpu": the same rounding points in plain torch on the CPU (FP32 matmul of the BF16 values, then rounded).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from k3_decode.config import MoeDims
from k3_decode.reference.moe import GatedFfn
from k3_decode.stock.dispatch import Implementation
from k3_decode.weights import DenseMlpWeights


def linear_bf16(x: Tensor, weight: Tensor, implementation: Implementation) -> Tensor:
    """x [B, K] @ weight [N, K]^T -> BF16 [B, N], accumulated in FP32."""
    if implementation == "triton":
        return F.linear(x, weight)
    return (x.float() @ weight.float().T).to(torch.bfloat16)


def situ_and_mul_torch(gate_up: Tensor, beta: float, beta_lin: float | None) -> Tensor:
    """SiTU on a [B, 2I] BF16 tensor laid out [gate | up], in FP32, rounded once to BF16.

    act(g, u) = beta*tanh(g/beta)*sigmoid(g) * beta_lin*tanh(u/beta_lin) (vLLM 0.33.0,
    vllm/model_executor/layers/activation.py `SituAndMul`); beta_lin None or <= 0 leaves u unclamped.
    """
    gate, up = gate_up.float().chunk(2, dim=-1)
    act = beta * torch.tanh(gate / beta) * torch.sigmoid(gate)
    if beta_lin is not None and beta_lin > 0:
        up = beta_lin * torch.tanh(up / beta_lin)
    return (act * up).to(torch.bfloat16)


def situ_and_mul(gate_up: Tensor, moe: MoeDims, implementation: Implementation) -> Tensor:
    if implementation == "triton":
        from k3_decode.stock.triton_moe import elementwise  # triton is only needed on this path

        return elementwise.situ_and_mul(gate_up, moe.situ_beta, moe.situ_linear_beta)
    return situ_and_mul_torch(gate_up, moe.situ_beta, moe.situ_linear_beta)


def check_gated_weights(hidden: Tensor, weights: DenseMlpWeights, what: str) -> None:
    """Per-call shape and dtype checks (no device sync)."""
    two_inter, h = weights.gate_up.shape
    if hidden.dim() != 2 or hidden.shape[1] != h or hidden.dtype != torch.bfloat16:
        raise ValueError(f"{what}: hidden must be BF16 [B, {h}], got {hidden.dtype} {tuple(hidden.shape)}")
    if two_inter % 2 or tuple(weights.down.shape) != (h, two_inter // 2):
        raise ValueError(
            f"{what}: gate_up {tuple(weights.gate_up.shape)} and down {tuple(weights.down.shape)} "
            "are not [2I, H] and [H, I]"
        )
    if weights.gate_up.dtype != torch.bfloat16 or weights.down.dtype != torch.bfloat16:
        raise ValueError(f"{what}: the stock path runs BF16 weights; load them with dtype=torch.bfloat16")


def gated_mlp(hidden: Tensor, weights: DenseMlpWeights, moe: MoeDims, implementation: Implementation) -> Tensor:
    """This rank's partial [B, H] BF16 of a SiTU-gated MLP (its sum over ranks is the TP all-reduce)."""
    gate_up = linear_bf16(hidden, weights.gate_up, implementation)
    return linear_bf16(situ_and_mul(gate_up, moe, implementation), weights.down, implementation)


def dense_mlp(hidden: Tensor, weights: DenseMlpWeights, moe: MoeDims, implementation: Implementation) -> Tensor:
    """The dense layer-0 MLP: gate_up [2I, H], SiTU-and-mul, down [H, I]; three launches."""
    check_gated_weights(hidden, weights, "dense MLP")
    return gated_mlp(hidden, weights, moe, implementation)


def as_gated_ffn(weights: DenseMlpWeights) -> GatedFfn:
    """The oracle's container for the same weights (k3_decode.reference.moe), for numerics checks."""
    return GatedFfn(weights.gate_up, weights.down)
