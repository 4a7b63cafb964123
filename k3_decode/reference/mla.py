"""Reference oracle for Kimi K3 MLA decode in the absorbed form, over a paged FP8 E4M3 latent cache.

What it models (vLLM 0.33.0, vllm/models/kimi_k3/nvidia/mla.py and the fused_qkv_a_g_proj in
vllm/model_executor/layers/linear.py), for one query token per request (q = 1, no speculative verify):

1. The fused projection output of one rank, [B, q_lora + kv_lora + rope + H*v], splits into
   q_a | kv_a = (kv_c | k_pe) | gate. q_a and kv_a are replicated across TP ranks, the gate is this rank's
   H heads, head-major (head h owns columns h*v .. h*v+v-1).
2. Query: q = RMSNorm(q_a) @ q_b^T viewed [B, H, nope + rope]; the nope part is absorbed through
   W_UK [H, nope, kv_lora] into the latent: ql[b,h] = q_nope[b,h] @ W_UK[h]; query = ql | q_pe [B, H, 576].
   NoPE target: the rope dims are stored and dotted as they are, never rotated.
3. Cache row of the new token: RMSNorm(kv_c) | k_pe, quantized to FP8 E4M3 with the per-tensor k_scale
   (bits = e4m3(clamp(x / k_scale, +-448)), round to nearest even, saturating as the kernels' satfinite
   conversion does) and written at slot_mapping[b] = page * page_size + offset. Slots < 0 are padding
   and are not written.
4. Attention over positions 0 .. seq_lens[b]-1 (the new token included), read through block_table:
   scores = query . row * softmax_scale with softmax_scale = 1/sqrt(qk_nope + qk_rope) (the head dim the
   model was trained with, not the 576-wide latent), values = the first kv_lora dims of the rows.
5. Output: (latent @ W_UV[h]) * sigmoid(gate), flattened to [B, H*v] (the o_proj input).

Split-KV: `attend_partial` returns each split's normalized partial output and its natural-log
sum-exp of the scaled scores (LSE); `merge_partials` combines them with the LSE merge that the
decode-context-parallel combine across ranks also performs (vLLM 0.33.0,
vllm/models/kimi_k3/nvidia/specialized_decode/cutedsl/mla/dcp.py `DcpValue`):
lse = logsumexp_j lse_j, out = sum_j exp(lse_j - lse) out_j. Kernels that keep base-2 LSEs must convert
(lse_e = lse_2 * ln 2) before comparing.

Empty ranges: a request with seq_len 0 (how FULL CUDA graphs pad a batch, vLLM 0.33.0,
vllm/models/kimi_k3/nvidia/specialized_decode/runtime/decode.py) and an empty split both give
out = 0 and lse = -inf; merging an all-empty set gives 0 and -inf, never NaN. A padded request's
slot_mapping entry must be negative, so it writes nothing.

Numerics: everything runs in `dtype` (FP32 by default, FP64 for tight comparisons), except the FP8
quantization, which always divides in FP32 so that the cache bytes do not depend on `dtype`. Kernels that
multiply by a precomputed 1/k_scale, or that round the row to BF16 first (pass kv_row_dtype=torch.bfloat16
to model that), can differ by one E4M3 step on rare near-ties.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from k3_decode.config import MlaDims
from k3_decode.reference.norms import rms_norm

E4M3_MAX = 448.0


@dataclass(frozen=True)
class MlaWeights:
    """One rank's MLA weights (H = heads on this rank), in any float dtype."""

    q_a_norm: Tensor  # [q_lora]
    kv_a_norm: Tensor  # [kv_lora]
    q_b: Tensor  # [H * (nope + rope), q_lora], rows head-major
    w_uk: Tensor  # [H, nope, kv_lora]
    w_uv: Tensor  # [H, kv_lora, v]

    @property
    def num_heads(self) -> int:
        return self.w_uk.shape[0]


class QkvAG(NamedTuple):
    q_a: Tensor  # [B, q_lora]
    kv_c: Tensor  # [B, kv_lora]
    k_pe: Tensor  # [B, rope]
    gate: Tensor  # [B, H * v]


def softmax_scale(dims: MlaDims) -> float:
    return 1.0 / math.sqrt(dims.qk_head_dim)


def split_qkv_a_g(projected: Tensor, dims: MlaDims, num_heads: int) -> QkvAG:
    """Split the fused q_a | kv_c | k_pe | gate projection output [B, rows] of one rank."""
    widths = (dims.q_lora_rank, dims.kv_lora_rank, dims.qk_rope_head_dim, num_heads * dims.v_head_dim)
    if projected.shape[-1] != sum(widths):
        raise ValueError(f"projection width {projected.shape[-1]} != q_a+kv_c+k_pe+gate = {sum(widths)}")
    return QkvAG(*torch.split(projected, widths, dim=-1))


def absorbed_query(
    q_a: Tensor, weights: MlaWeights, dims: MlaDims, eps: float, dtype: torch.dtype = torch.float32
) -> Tensor:
    """Latent query [B, H, kv_lora + rope]: (RMSNorm(q_a) q_b)_nope absorbed through W_UK, then q_pe."""
    q = rms_norm(q_a, weights.q_a_norm, eps, dtype) @ weights.q_b.to(dtype).T
    q = q.view(q.shape[0], weights.num_heads, dims.qk_head_dim)
    q_nope, q_pe = q.split([dims.qk_nope_head_dim, dims.qk_rope_head_dim], dim=-1)
    ql_nope = torch.einsum("bhn,hnl->bhl", q_nope, weights.w_uk.to(dtype))
    return torch.cat([ql_nope, q_pe], dim=-1)


def kv_cache_row(
    kv_c: Tensor, k_pe: Tensor, kv_a_norm: Tensor, eps: float, dtype: torch.dtype = torch.float32
) -> Tensor:
    """The unquantized cache row [B, kv_lora + rope]: RMSNorm(kv_c) | k_pe (k_pe: not normed, not rotated)."""
    return torch.cat([rms_norm(kv_c, kv_a_norm, eps, dtype), k_pe.to(dtype)], dim=-1)


def quantize_e4m3(x: Tensor, scale: float) -> Tensor:
    """E4M3 bits (uint8) of x / scale, saturated to +-448, rounded to nearest even, computed in FP32."""
    # Clamp first: torch 2.13 on CPU happens to saturate in the conversion too, but that is not a
    # documented contract across devices and versions, and the kernels' satfinite conversion is.
    y = (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX)
    return y.to(torch.float8_e4m3fn).view(torch.uint8)


def dequantize_e4m3(bits: Tensor, scale: float, dtype: torch.dtype = torch.float32) -> Tensor:
    return bits.view(torch.float8_e4m3fn).to(dtype) * scale


def _byte_rows(cache: Tensor) -> Tensor:
    """The cache [pages, page_size, row] as uint8, sharing storage (float8_e4m3fn caches are accepted too)."""
    if cache.dim() != 3 or cache.element_size() != 1:
        raise ValueError(
            f"cache must be a 1-byte [pages, page_size, row] tensor, got {cache.dtype} {tuple(cache.shape)}"
        )
    return cache.view(torch.uint8)


def insert_kv(
    cache: Tensor, rows: Tensor, slot_mapping: Tensor, k_scale: float, kv_row_dtype: torch.dtype | None = None
) -> None:
    """Quantize rows [B, row] and write them into the paged cache IN PLACE at slot_mapping[b] (< 0: skip)."""
    if not cache.is_contiguous():
        raise ValueError("cache must be contiguous: the insert writes through a flat [slots, row] view")
    flat = _byte_rows(cache).view(-1, cache.shape[-1])
    if rows.shape[-1] != cache.shape[-1]:
        raise ValueError(f"row width {rows.shape[-1]} != cache row {cache.shape[-1]}")
    slots = slot_mapping.to(torch.long)
    keep = slots >= 0
    if keep.any() and int(slots[keep].max()) >= flat.shape[0]:
        raise ValueError(f"slot {int(slots[keep].max())} outside a cache of {flat.shape[0]} slots")
    if slots[keep].unique().numel() != int(keep.sum()):
        raise ValueError("two requests write the same slot")
    if kv_row_dtype is not None:
        rows = rows.to(kv_row_dtype)
    flat[slots[keep]] = quantize_e4m3(rows[keep.to(rows.device)], k_scale)


def decode_slot_mapping(block_table: Tensor, seq_lens: Tensor, page_size: int) -> Tensor:
    """The slot of each request's newest token (position seq_len - 1); -1 for a zero-length request."""
    out = torch.full((len(seq_lens),), -1, dtype=torch.long)
    for b, n in enumerate(seq_lens.tolist()):
        if n > 0:
            out[b] = int(block_table[b, (n - 1) // page_size]) * page_size + (n - 1) % page_size
    return out


def context_bytes(cache: Tensor, block_table_row: Tensor, start: int, end: int) -> Tensor:
    """Cache rows [end - start, row] (uint8) of positions start .. end-1 of one request."""
    page_size = cache.shape[1]
    pos = torch.arange(start, end, device=cache.device)
    pages = block_table_row.to(device=cache.device, dtype=torch.long)[pos // page_size]
    return _byte_rows(cache)[pages, pos % page_size]


def attend_partial(
    query: Tensor,
    cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    k_scale: float,
    scale: float,
    kv_lora_rank: int,
    bounds: Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor]:
    """Attention of query [B, H, row] over positions [bounds[b,0], bounds[b,1]) ∩ [0, seq_lens[b]).

    bounds [B, 2] defaults to the whole context. Returns the normalized partial output [B, H, kv_lora] and
    the natural-log LSE [B, H] of the scaled scores; an empty range gives zeros and -inf.
    """
    batch, heads, _ = query.shape
    out = query.new_zeros((batch, heads, kv_lora_rank), dtype=dtype)
    lse = query.new_full((batch, heads), -math.inf, dtype=dtype)
    q = query.to(dtype)
    for b, n in enumerate(seq_lens.tolist()):
        start, end = (0, n) if bounds is None else (max(0, int(bounds[b, 0])), min(n, int(bounds[b, 1])))
        if end <= start:
            continue
        rows = dequantize_e4m3(context_bytes(cache, block_table[b], start, end), k_scale, dtype)
        scores = (q[b] @ rows.T) * scale  # [H, n]
        lse[b] = torch.logsumexp(scores, dim=-1)
        out[b] = torch.exp(scores - lse[b, :, None]) @ rows[:, :kv_lora_rank]
    return out, lse


def merge_partials(outs: Tensor, lses: Tensor) -> tuple[Tensor, Tensor]:
    """Merge split partials outs [S, B, H, L] with LSEs [S, B, H] into (out [B, H, L], lse [B, H])."""
    lse = torch.logsumexp(lses, dim=0)
    # exp(-inf - -inf) is NaN: where every split is empty the merged row is zero by definition.
    w = torch.where(torch.isfinite(lse), torch.exp(lses - lse), torch.zeros_like(lses))
    return (w.unsqueeze(-1) * outs).sum(dim=0), lse


def split_bounds(seq_lens: Tensor, num_splits: int, page_size: int | None = None) -> Tensor:
    """Split-KV ranges [S, B, 2]: split j of request b covers [j*c, (j+1)*c) ∩ [0, n) with c = cdiv(n, S),
    rounded up to a multiple of page_size when given (page-aligned splits). Trailing splits may be empty."""
    if num_splits < 1:
        raise ValueError("num_splits must be >= 1")
    out = torch.zeros((num_splits, len(seq_lens), 2), dtype=torch.long)
    for b, n in enumerate(seq_lens.tolist()):
        chunk = max(1, -(-n // num_splits))
        if page_size is not None:
            chunk = -(-chunk // page_size) * page_size
        for j in range(num_splits):
            out[j, b, 0], out[j, b, 1] = min(n, j * chunk), min(n, (j + 1) * chunk)
    return out


def attend(
    query: Tensor,
    cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    k_scale: float,
    scale: float,
    kv_lora_rank: int,
    num_splits: int = 1,
    page_aligned_splits: bool = False,
    dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor]:
    """Full attention over each request's context, optionally as `num_splits` split-KV partials merged."""
    if num_splits == 1:
        return attend_partial(query, cache, block_table, seq_lens, k_scale, scale, kv_lora_rank, None, dtype)
    bounds = split_bounds(seq_lens, num_splits, cache.shape[1] if page_aligned_splits else None)
    parts = [
        attend_partial(query, cache, block_table, seq_lens, k_scale, scale, kv_lora_rank, bounds[j], dtype)
        for j in range(num_splits)
    ]
    return merge_partials(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))


def value_and_gate(latent: Tensor, w_uv: Tensor, gate: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """(latent [B, H, kv_lora] @ W_UV[h]) * sigmoid(gate [B, H*v]), flattened to the o_proj input [B, H*v]."""
    v = torch.einsum("bhl,hlv->bhv", latent.to(dtype), w_uv.to(dtype))
    return (v * torch.sigmoid(gate.to(dtype).view_as(v))).flatten(1)


def mla_decode(
    projected: Tensor,
    weights: MlaWeights,
    dims: MlaDims,
    cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    slot_mapping: Tensor,
    k_scale: float,
    eps: float,
    *,
    q_scale: float | None = None,
    num_splits: int = 1,
    page_aligned_splits: bool = False,
    kv_row_dtype: torch.dtype | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """One MLA decode step of one rank: insert the new tokens' rows into `cache` (IN PLACE), attend, and
    return the o_proj input [B, H*v] in `dtype`.

    seq_lens counts the new token; slot_mapping[b] should be `decode_slot_mapping(...)[b]`.
    q_scale: when given, the latent query is rounded through FP8 E4M3 with that per-tensor scale, as the
    FP8 decode kernels consume it; None keeps it exact.
    """
    if (dims.output_gate, dims.cache_dtype) != ("sigmoid", "float8_e4m3fn"):
        raise ValueError(
            f"oracle models a sigmoid gate and an FP8 E4M3 cache, not {dims.output_gate}/{dims.cache_dtype}"
        )
    parts = split_qkv_a_g(projected, dims, weights.num_heads)
    query = absorbed_query(parts.q_a, weights, dims, eps, dtype)
    if q_scale is not None:
        query = dequantize_e4m3(quantize_e4m3(query, q_scale), q_scale, dtype)
    row = kv_cache_row(parts.kv_c, parts.k_pe, weights.kv_a_norm, eps, dtype)
    insert_kv(cache, row, slot_mapping, k_scale, kv_row_dtype)
    latent, _ = attend(
        query,
        cache,
        block_table,
        seq_lens,
        k_scale,
        softmax_scale(dims),
        dims.kv_lora_rank,
        num_splits,
        page_aligned_splits,
        dtype,
    )
    return value_and_gate(latent, weights.w_uv, parts.gate, dtype)
