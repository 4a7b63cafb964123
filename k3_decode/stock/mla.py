"""Stock MLA decode (q = 1) over the paged FP8 E4M3 latent cache, launch for launch as vLLM's stock path on an
H200 (k3_facts section 2.C, vLLM 0.33.0 vllm/models/kimi_k3/nvidia/mla.py).

`mla_decode` mirrors the oracle's k3_decode.reference.mla.mla_decode: from the fused q_a | kv_c | k_pe | gate
projection of one rank to the o_proj input [B, H*v] (BF16), inserting the new tokens' cache rows in place. On
CUDA it runs 8 launches: fused q/kv RMSNorm (Triton), q_b GEMM (cuBLAS), W_UK bmm (cuBLAS), FP8 query build +
FP8 cache insert (Triton), split-KV attention + LSE merge (Triton, 2), W_UV bmm (cuBLAS), sigmoid gate (Triton).
`mla_attention` adds the qkv_a_g GEMM before and the o_proj GEMM after (10 launches).

BF16 rounding points (where vLLM's activations are BF16 between kernels): the normed q_a and kv_c, the q_b
output, the absorbed query ql_nope, the merged latent, the W_UV output and the gated output. FP8 points: the
query (per-tensor q_scale) and the cache row (per-tensor k_scale). The CPU ("torch-cpu") path rounds at the
same points.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from k3_decode.config import MlaDims
from k3_decode.reference.mla import softmax_scale
from k3_decode.stock import gemm
from k3_decode.stock.dispatch import Implementation, implementation_for
from k3_decode.weights import MlaWeights

ACT_DTYPE = torch.bfloat16
E4M3_MAX = 448.0
HEADS_PER_PROGRAM = 16  # the split kernel's head block; must match triton_kernels.mla_attention.BLOCK_H
POSITIONS_PER_TILE = 128  # the split kernel's BLOCK_N; splits are whole tiles
MAX_SPLITS = 64
H200_SMS = 132


@dataclass(frozen=True)
class PagedLatentCache:
    """One MLA layer's paged FP8 cache and this step's tables (the oracle's mla_decode arguments)."""

    cache: Tensor  # [pages, page_size, kv_lora + rope], 1-byte (uint8 bits or float8_e4m3fn), contiguous
    block_table: Tensor  # [B, max_pages] integer
    seq_lens: Tensor  # [B], the new token included; 0 for a padded request
    slot_mapping: Tensor  # [B], page * page_size + offset of the new token; < 0 writes nothing
    k_scale: float = 1.0
    q_scale: float = 1.0

    def bytes(self) -> Tensor:
        if self.cache.dim() != 3 or self.cache.element_size() != 1 or not self.cache.is_contiguous():
            raise ValueError(
                f"MLA cache must be a contiguous 1-byte [pages, page_size, row] tensor, got {self.cache.dtype} "
                f"{tuple(self.cache.shape)}"
            )
        return self.cache.view(torch.uint8)


def choose_num_splits(batch: int, heads: int, max_context: int, num_sms: int = H200_SMS) -> int:
    """Split count fixed per (batch, max context), so a CUDA graph can capture it. The split kernel holds one CTA
    per SM (162 KB of shared memory, 255 registers at 8 warps), so the grid is one wave: as many splits as
    leave every SM one program (num_sms // programs per split), at least one tile each, at most MAX_SPLITS.
    B1 at 4096 tokens: 32 one-tile splits; B8: 16 (2 tiles each); B64: 2 (16 tiles each); B >= 67: 1."""
    if batch < 1 or heads < 1 or max_context < 0:
        raise ValueError(f"choose_num_splits: batch {batch}, heads {heads}, max_context {max_context} must be >= 1/0")
    programs = batch * math.ceil(heads / HEADS_PER_PROGRAM)
    want = num_sms // programs
    tiles = max(1, math.ceil(max_context / POSITIONS_PER_TILE))
    return max(1, min(want, tiles, MAX_SPLITS))


def _widths(dims: MlaDims, heads: int) -> tuple[int, int, int, int]:
    return dims.q_lora_rank, dims.kv_lora_rank, dims.qk_rope_head_dim, heads * dims.v_head_dim


def _check(projected: Tensor, weights: MlaWeights, dims: MlaDims, paged: PagedLatentCache, num_splits: int) -> None:
    heads = weights.w_uk.shape[0]
    q_lora, latent, rope, gate = _widths(dims, heads)
    if (dims.output_gate, dims.cache_dtype) != ("sigmoid", "float8_e4m3fn"):
        raise ValueError(
            f"stock MLA models a sigmoid gate and an FP8 E4M3 cache, not {dims.output_gate}/{dims.cache_dtype}"
        )
    if projected.dim() != 2 or projected.shape[1] != q_lora + latent + rope + gate or projected.stride(1) != 1:
        raise ValueError(
            f"projection must be [B, {q_lora + latent + rope + gate}] with a unit last stride, got "
            f"{tuple(projected.shape)}"
        )
    batch = projected.shape[0]
    expected = {
        "q_a_norm": (q_lora,),
        "kv_a_norm": (latent,),
        "q_b": (heads * dims.qk_head_dim, q_lora),
        "w_uk": (heads, dims.qk_nope_head_dim, latent),
        "w_uv": (heads, latent, dims.v_head_dim),
    }
    for name, shape in expected.items():
        got = tuple(getattr(weights, name).shape)
        if got != shape:
            raise ValueError(f"MLA weight {name}: shape {got}, expected {shape}")
    if paged.bytes().shape[2] != latent + rope:
        raise ValueError(f"MLA cache row is {paged.cache.shape[2]} bytes, expected kv_lora + rope = {latent + rope}")
    for name in ("seq_lens", "slot_mapping"):
        if tuple(getattr(paged, name).shape) != (batch,):
            raise ValueError(f"MLA {name} has shape {tuple(getattr(paged, name).shape)}, expected ({batch},)")
    if paged.block_table.dim() != 2 or paged.block_table.shape[0] != batch or paged.block_table.stride(1) != 1:
        raise ValueError(f"MLA block_table must be [B={batch}, max_pages] with a unit last stride")
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits {num_splits} outside 1..{MAX_SPLITS}; use choose_num_splits")
    for d in (latent, rope, dims.v_head_dim):
        if d & (d - 1):
            raise ValueError(f"stock MLA kernels need power-of-two latent/rope/v widths, got {d}")
    if projected.dtype != weights.q_b.dtype:
        raise ValueError(f"projection is {projected.dtype} but q_b is {weights.q_b.dtype}; use the qkv_a_g output")


def mla_decode(
    projected: Tensor,
    weights: MlaWeights,
    dims: MlaDims,
    paged: PagedLatentCache,
    eps: float,
    *,
    num_splits: int = 1,
    implementation: Implementation | None = None,
) -> Tensor:
    """One MLA decode step of one rank: insert the new rows into `paged.cache` (in place), attend, and return the
    o_proj input BF16 [B, H*v]."""
    _check(projected, weights, dims, paged, num_splits)
    heads = weights.w_uk.shape[0]
    batch = projected.shape[0]
    q_lora, latent, rope, _ = _widths(dims, heads)
    nope = dims.qk_nope_head_dim
    impl = implementation or implementation_for(projected.device)
    gate = projected[:, q_lora + latent + rope :]
    scale = softmax_scale(dims)

    if impl == "triton":
        from k3_decode.stock.triton_kernels import mla as km
        from k3_decode.stock.triton_kernels import mla_attention as ka

        q_a = torch.empty(batch, q_lora, dtype=ACT_DTYPE, device=projected.device)
        kv_c = torch.empty(batch, latent, dtype=ACT_DTYPE, device=projected.device)
        km.launch_qkv_norm(projected, weights.q_a_norm, weights.kv_a_norm, q_a, kv_c, eps=eps)
    else:
        q_a = _rms(projected[:, :q_lora], weights.q_a_norm, eps)
        kv_c = _rms(projected[:, q_lora : q_lora + latent], weights.kv_a_norm, eps)
    q = gemm.linear(q_a, weights.q_b)
    ql_nope = gemm.bmm(q.view(batch, heads, dims.qk_head_dim)[..., :nope].transpose(0, 1), weights.w_uk)
    cache = paged.bytes()

    if impl == "triton":
        query = torch.empty(batch, heads, latent + rope, dtype=torch.uint8, device=projected.device)
        km.launch_query_insert(
            ql_nope,
            q,
            kv_c,
            projected,
            paged.slot_mapping,
            query,
            cache,
            nope=nope,
            k_pe_offset=q_lora + latent,
            q_scale=paged.q_scale,
            k_scale=paged.k_scale,
        )
        part_out = torch.empty(batch, num_splits, heads, latent, dtype=torch.float32, device=projected.device)
        part_lse = torch.empty(batch, num_splits, heads, dtype=torch.float32, device=projected.device)
        ka.launch_split_kv(
            query,
            cache,
            paged.block_table,
            paged.seq_lens,
            part_out,
            part_lse,
            kv_lora_rank=latent,
            score_scale=paged.q_scale * paged.k_scale * scale,
            value_scale=paged.k_scale,
        )
        merged = torch.empty(heads, batch, latent, dtype=ACT_DTYPE, device=projected.device)
        ka.launch_merge(part_out, part_lse, merged)
        v = gemm.bmm(merged, weights.w_uv)
        out = torch.empty(batch, heads * dims.v_head_dim, dtype=ACT_DTYPE, device=projected.device)
        km.launch_sigmoid_gate(v, gate, out)
        return out

    q_pe = q.view(batch, heads, dims.qk_head_dim)[..., nope:]
    query = _e4m3(torch.cat([ql_nope.transpose(0, 1), q_pe], dim=-1), paged.q_scale)
    row = torch.cat([kv_c, projected[:, q_lora + latent : q_lora + latent + rope]], dim=-1)
    live = paged.slot_mapping >= 0
    cache.view(-1, latent + rope)[paged.slot_mapping[live].long()] = _e4m3(row[live], paged.k_scale)
    merged = _attend_torch(query, cache, paged, latent, num_splits, scale)
    v = gemm.bmm(merged.transpose(0, 1).contiguous(), weights.w_uv)  # [H, B, v]
    gated = v.transpose(0, 1).float() * torch.sigmoid(gate.float()).view(batch, heads, -1)
    return gated.flatten(1).to(ACT_DTYPE)


def mla_attention(
    x: Tensor,
    weights: MlaWeights,
    dims: MlaDims,
    paged: PagedLatentCache,
    eps: float,
    *,
    num_splits: int = 1,
    implementation: Implementation | None = None,
) -> Tensor:
    """qkv_a_g GEMM, mla_decode, o_proj GEMM: the attention input [B, hidden] to this rank's partial output."""
    projected = gemm.linear(x, weights.qkv_a_g)
    o = mla_decode(projected, weights, dims, paged, eps, num_splits=num_splits, implementation=implementation)
    return gemm.linear(o, weights.o_proj)


# ---------------------------------------------------------------------------------------------------------
# torch-cpu pieces.


def _rms(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    x = x.float()
    return (x * torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + eps) * weight.float()).to(ACT_DTYPE)


def _e4m3(x: Tensor, scale: float) -> Tensor:
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def _split_ranges(seq_lens: Tensor, num_splits: int) -> tuple[Tensor, Tensor]:
    """[B, S] start and end of each split, as the kernel computes them (whole tiles, trailing splits may be empty)."""
    n = seq_lens.long().unsqueeze(-1)
    per_split = (n + num_splits - 1) // num_splits
    per_split = (per_split + POSITIONS_PER_TILE - 1) // POSITIONS_PER_TILE * POSITIONS_PER_TILE
    start = torch.arange(num_splits, device=n.device) * per_split
    return start, torch.minimum(n, start + per_split)


def _attend_torch(
    query: Tensor, cache: Tensor, paged: PagedLatentCache, latent: int, num_splits: int, scale: float
) -> Tensor:
    """Split-KV attention and LSE merge in torch; returns the merged latent BF16 [B, H, L]."""
    batch = query.shape[0]
    page_size = cache.shape[1]
    longest = int(paged.seq_lens.max()) if batch else 0
    pos = torch.arange(longest, device=query.device)
    valid = pos.unsqueeze(0) < paged.seq_lens.long().unsqueeze(-1)  # [B, N]
    page_idx = (pos // page_size).clamp(max=paged.block_table.shape[1] - 1)
    pages = torch.where(valid, paged.block_table.long()[:, page_idx], 0)
    rows = cache[pages, pos % page_size].view(torch.float8_e4m3fn).float()  # [B, N, row]
    q = query.view(torch.float8_e4m3fn).float()
    scores = (q @ rows.transpose(1, 2)) * (paged.q_scale * paged.k_scale * scale)  # [B, H, N]
    start, end = _split_ranges(paged.seq_lens, num_splits)
    in_split = (pos >= start.unsqueeze(-1)) & (pos < end.unsqueeze(-1))  # [B, S, N]
    s = scores.unsqueeze(1).masked_fill(~in_split.unsqueeze(2), -math.inf)  # [B, S, H, N]
    top = s.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    p = torch.exp(s - top)
    total = p.sum(dim=-1)
    values = rows[..., :latent].unsqueeze(1)  # [B, 1, N, L]
    weighted = p.to(torch.float16).float() @ values  # the kernel rounds the probabilities to FP16
    part = weighted / total.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)
    part = part * paged.k_scale
    lse = torch.where(total > 0, top.squeeze(-1) + torch.log(total), torch.full_like(total, -math.inf))
    best = lse.amax(dim=1, keepdim=True)
    weight = torch.where(lse == -math.inf, torch.zeros_like(lse), torch.exp(lse - best))
    merged = (weight.unsqueeze(-1) * part).sum(dim=1) / weight.sum(dim=1).clamp_min(1e-30).unsqueeze(-1)
    return merged.to(ACT_DTYPE)
