"""Routing kernels: sigmoid top-k with a correction bias, and grouping of the (token, slot) pairs by expert.

`k3_moe_route` stands in for vLLM 0.33.0's fused `grouped_topk` (noaux_tc, one group) and `k3_moe_align` for its
`moe_align_block_size` (vllm/model_executor/layers/fused_moe/): one launch each, as on the stock H200 path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3_decode.stock.triton_moe.limits import MAX_PAIRS, PAIRWISE_MAX_PAIRS


@triton.jit
def k3_moe_route(
    logits_ptr,
    bias_ptr,
    ids_ptr,
    weights_ptr,
    num_experts,
    stride_logits,
    eps,
    scale,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
):
    """One program per token: the TOP_K largest sigmoid(logit) + bias, ties to the lower expert id.

    Each of the TOP_K rounds takes the maximum key and then the smallest id holding it, so equal keys resolve
    exactly as vLLM 0.33.0's specialized routing does (vllm/models/kimi_k3/nvidia/specialized_decode/cutedsl/moe/
    routing.py). Weights are the chosen raw scores over their sum + eps, times the scaling factor.
    """
    b = tl.program_id(0)
    offs = tl.arange(0, E_PAD)
    real = offs < num_experts
    logits = tl.load(logits_ptr + b * stride_logits + offs, mask=real, other=0.0)
    scores = tl.sigmoid(logits)
    keys = tl.where(real, scores + tl.load(bias_ptr + offs, mask=real, other=0.0), -float("inf"))
    slots = tl.arange(0, K_PAD)
    chosen_ids = tl.zeros([K_PAD], dtype=tl.int32)
    chosen_scores = tl.zeros([K_PAD], dtype=tl.float32)
    for i in tl.static_range(TOP_K):
        best = tl.max(keys, axis=0)
        idx = tl.min(tl.where(keys == best, offs, E_PAD), axis=0)
        # Only a NaN key leaves no index; clamp it to a real expert (memory safety) and poison its weight.
        invalid = idx >= num_experts
        idx = tl.where(invalid, 0, idx)
        hit = offs == idx
        score = tl.sum(tl.where(hit, scores, 0.0), axis=0)
        score = tl.where(invalid, float("nan"), score)
        chosen_ids = tl.where(slots == i, idx, chosen_ids)
        chosen_scores = tl.where(slots == i, score, chosen_scores)
        keys = tl.where(hit, -float("inf"), keys)
    weights = chosen_scores / (tl.sum(chosen_scores, axis=0) + eps) * scale
    tl.store(ids_ptr + b * TOP_K + slots, chosen_ids, mask=slots < TOP_K)
    tl.store(weights_ptr + b * TOP_K + slots, weights, mask=slots < TOP_K)


@triton.jit
def k3_moe_align(
    ids_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_blocks_ptr,
    pad_start_ptr,
    unpad_start_ptr,
    num_pairs,
    num_experts,
    max_blocks,
    BLOCK_M: tl.constexpr,
    P_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    FILL: tl.constexpr,
    PAIRWISE: tl.constexpr,
):
    """One program: lay the pairs out expert by expert, each expert's run padded to whole BLOCK_M blocks.

    Outputs: sorted_ptr[max_blocks * BLOCK_M] pair indices (num_pairs marks padding), block_expert_ptr[max_blocks]
    the expert of each block (-1: unused), num_blocks_ptr[0] the blocks in use. Within an expert, pairs keep
    ascending pair order, so the layout is deterministic (both ways below give the same one).

    PAIRWISE (small batches): each pair's destination from [P, P] comparisons held in registers, so the only
    memory round trip is the load of the ids; a decode step's align is then latency, not work. Otherwise a
    histogram over the experts, prefix sums stored to the scratch rows and read back by a sort of the pairs.
    """
    offs = tl.arange(0, P_PAD)
    valid = offs < num_pairs
    expert = tl.load(ids_ptr + offs, mask=valid, other=E_PAD - 1)  # E_PAD > num_experts: a spare bin
    if PAIRWISE:
        real = valid & (expert < num_experts)
        real_q = real[None, :]
        same = (expert[:, None] == expert[None, :]) & real_q
        rank = tl.sum((same & (offs[None, :] < offs[:, None])).to(tl.int32), axis=1)
        count = tl.sum(same.to(tl.int32), axis=1)
        # One pair per hit expert (its first) carries that expert's padded run; the runs of lower expert ids
        # come first, so a pair's run starts at the sum of the lower experts' runs.
        lead_padded = tl.where(real & (rank == 0), (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
        lower = (expert[None, :] < expert[:, None]) & real_q
        dest = tl.sum(tl.where(lower, lead_padded[None, :], 0), axis=1) + rank
        tl.store(num_blocks_ptr, tl.sum(lead_padded, axis=0) // BLOCK_M)
        key_expert = expert
        pair = offs
    for start0 in range(0, max_blocks * BLOCK_M, FILL):
        f = start0 + tl.arange(0, FILL)
        tl.store(sorted_ptr + f, num_pairs, mask=f < max_blocks * BLOCK_M)
    for start0 in range(0, max_blocks, FILL):
        f = start0 + tl.arange(0, FILL)
        tl.store(block_expert_ptr + f, -1, mask=f < max_blocks)
    if not PAIRWISE:
        bins = tl.arange(0, E_PAD)
        counts = tl.where(bins < num_experts, tl.histogram(expert, E_PAD), 0)
        padded_e = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        tl.store(pad_start_ptr + bins, tl.cumsum(padded_e, axis=0) - padded_e)
        tl.store(unpad_start_ptr + bins, tl.cumsum(counts, axis=0) - counts)
        tl.store(num_blocks_ptr, tl.sum(padded_e, axis=0) // BLOCK_M)
    # The scatter below overwrites the fill (and, sorting, reads the offsets stored above): order them.
    tl.debug_barrier()
    if not PAIRWISE:
        keys = tl.sort(tl.where(valid, expert * P_PAD + offs, E_PAD * P_PAD + offs))
        key_expert = keys // P_PAD
        pair = keys % P_PAD
        real = key_expert < num_experts
        rank = offs - tl.load(unpad_start_ptr + key_expert, mask=real, other=0)
        dest = tl.load(pad_start_ptr + key_expert, mask=real, other=0) + rank
    tl.store(sorted_ptr + dest, pair, mask=real)
    tl.store(block_expert_ptr + dest // BLOCK_M, key_expert, mask=real & (rank % BLOCK_M == 0))


@dataclass(frozen=True)
class Grouping:
    """Pairs grouped by expert: what the expert GEMMs iterate over."""

    sorted_pairs: Tensor  # [max_blocks * block_m] int32, num_pairs = padding
    block_expert: Tensor  # [max_blocks] int32, -1 = unused block
    num_blocks: Tensor  # [1] int32, blocks in use (device value; reading it syncs)
    block_m: int
    num_pairs: int

    @property
    def max_blocks(self) -> int:
        return self.block_expert.shape[0]


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound on sum_e ceil(count_e / block_m): at most min(E, P) experts are hit, plus P / block_m."""
    return min(num_experts, num_pairs) + triton.cdiv(num_pairs, block_m)


def route(logits: Tensor, bias: Tensor, top_k: int, eps: float, scale: float) -> tuple[Tensor, Tensor]:
    """ids [B, k] int32 and weights [B, k] FP32 from FP32 logits [B, E] and the FP32 bias [E]."""
    batch, num_experts = logits.shape
    ids = torch.empty(batch, top_k, dtype=torch.int32, device=logits.device)
    weights = torch.empty(batch, top_k, dtype=torch.float32, device=logits.device)
    e_pad = triton.next_power_of_2(num_experts)
    k3_moe_route[(batch,)](
        logits,
        bias,
        ids,
        weights,
        num_experts,
        logits.stride(0),
        eps,
        scale,
        TOP_K=top_k,
        K_PAD=triton.next_power_of_2(top_k),
        E_PAD=e_pad,
        num_warps=4 if e_pad <= 1024 else 8,
    )
    return ids, weights


def align(ids: Tensor, num_experts: int, block_m: int, *, pairwise: bool | None = None) -> Grouping:
    """Group the flattened (token, slot) pairs of ids [B, k] by expert into block_m-row blocks.

    pairwise: the kernel's register-only way (default: up to PAIRWISE_MAX_PAIRS pairs) or its sort (above)."""
    num_pairs = ids.numel()
    if num_pairs > MAX_PAIRS:
        raise ValueError(
            f"align sorts at most {MAX_PAIRS} (token, slot) pairs per launch, got {num_pairs}; split the batch"
        )
    p_pad = triton.next_power_of_2(num_pairs)
    e_pad = triton.next_power_of_2(num_experts + 1)
    if e_pad * (p_pad + 1) >= 2**31:
        raise ValueError(f"{num_experts} experts x {num_pairs} pairs overflow the int32 sort keys; split the batch")
    blocks = max_blocks(num_pairs, num_experts, block_m)
    if pairwise is None:
        pairwise = num_pairs <= PAIRWISE_MAX_PAIRS
    dev = ids.device
    grouping = Grouping(
        sorted_pairs=torch.empty(blocks * block_m, dtype=torch.int32, device=dev),
        block_expert=torch.empty(blocks, dtype=torch.int32, device=dev),
        num_blocks=torch.empty(1, dtype=torch.int32, device=dev),
        block_m=block_m,
        num_pairs=num_pairs,
    )
    scratch = torch.empty(2, e_pad, dtype=torch.int32, device=dev)
    k3_moe_align[(1,)](
        ids,
        grouping.sorted_pairs,
        grouping.block_expert,
        grouping.num_blocks,
        scratch[0],
        scratch[1],
        num_pairs,
        num_experts,
        blocks,
        BLOCK_M=block_m,
        P_PAD=p_pad,
        E_PAD=e_pad,
        FILL=1024,
        PAIRWISE=pairwise,
        num_warps=8 if pairwise and p_pad > 64 else 4,  # [P, P] temporaries: 64 elements per thread at P = 128
    )
    return grouping
