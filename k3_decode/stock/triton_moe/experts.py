"""MXFP4 routed experts as W4A16 grouped GEMMs: FC1 (w13), SiTU-and-mul, FC2 (w2) with the routing weight, then
the sum over the top-k slots.

Stand-in for vLLM 0.33.0's H200 path (vllm/model_executor/layers/fused_moe/oracle/mxfp4.py falls through to the
Marlin/Humming MXFP4 MoE on SM90): 16-bit activations, MXFP4 weights dequantized on the fly in registers, FP32
accumulation, tokens grouped by expert so each selected expert's weights are read once. The launch structure of
vLLM's fused Marlin MoE: align, FC1, activation, FC2, sum.

Why the previous kernel ran at 8-15 % of the HBM roofline (measured on the H200: 84 / 434 / 2214 us for 16 / ~120 /
~600 experts at TP8 B 1 / 8 / 64, docs/stock-path.md "MoE"), read from its sm_90 SASS (compiled on the CPU):
- It was issue-bound, not latency-bound. At the roofline an H200 streams ~7.9e12 MXFP4 weights/s (0.53 byte each),
  about 31 weights per SM per clock; its four schedulers issue 128 thread-instructions per SM per clock, so a kernel
  has ~4 instructions per weight *in total* (decode, scale, operand shuffles, MMA, loads, addresses). The FC1 main
  loop was 842 instructions for 32 weights per thread per step: 26 per weight. The parts: the E2M1 decode on one
  byte per 32-bit lane (shift, mask, or, bitcast, FP16 multiply; ~13), the FP16 range flag (a max over the x tile
  with warp shuffles every K step: 49 FMNMX + 48 SHFL), the x tile's BF16 -> FP16 conversion and its M = 16 rows
  (one real row at decode) converted to MMA operands every step, and 16-byte-at-most weight loads of 64 bytes per
  row per step.
- Few bytes in flight: 2 K steps of 2-4 KB per program, a scale pre-pass (the row's largest scale byte) and, in FC2,
  an x pre-pass (the row shift into FP16's range), each a dependent round trip to memory before the first weight.
- Grid: at B1 the 16 experts gave 17 x 24 FC1 programs and 17 x 112 FC2 programs: enough programs, but each one a
  chain of latencies; the K split (more programs per expert) would not have helped an issue-bound loop.

What this version does (counts from the sm_90 SASS, tests/k3_decode/stock/test_moe_kernels_compile.py):
- BF16 activations, so no range flag, no x conversion and no pre-pass: the latent and the SiTU output enter the MMA
  as they are (BF16 x BF16 products are exact in FP32). The weights become BF16 too.
- The decode works on packed words (Marlin's trick, arXiv 2408.11743, applied to E2M1 and BF16): one inline-PTX block
  turns 4 packed bytes (8 codes) into 4 BF16 pairs with 2 byte permutes and, per pair, a mask, an integer multiply
  that places sign and magnitude at once, a mask and one BF16x2 multiply by the block scale: ~2.3 instructions per
  weight. Its BF16 bits are a code's value times 2^-126 (sign at bit 15, the code's e1 e0 m at bits 8..6: the codes
  +-0.5 land on the BF16 subnormal 2^-127, which the multiply keeps), times 2^(b - 53) for scale byte b: a weight
  enters the MMA as w * 2^-52, exact for scale bytes 48..MAX_SCALE_BYTE (180), and 2^52 is applied to the FP32
  result once per output element.
- Weights are the MMA's M operand (64 rows per warpgroup, swap-AB as decode GEMMs do) and the <= 16 tokens of an
  expert block its N operand, so wgmma runs with the weights in registers and the tiny x tile in shared memory.
  FC1's 64 rows are 32 gate and 32 up rows of the same intermediate columns.
- 16-byte weight loads (16 packed bytes = one scale block per thread); a K step's weights, scales and activations
  are requested together (FC1 at B <= 8: 512 K elements, 16 KB per program), and the other programs resident on
  the SM (4-5 at ~100-130 registers) cover the latency. A prefetch of the next step held across the loop made
  Triton keep the packed bytes one per register and re-pack them (6.2 instructions per weight instead of 3.9), and
  Triton's own cp.async pipelining (num_stages 3) added shared-memory round trips (4.9): both measured in SASS and
  dropped.
The main loops come to 3.8-3.9 (FC1) and 4.2 (FC2) instructions per weight, from 26; tiles.toml picks BK per batch.
Measured on the H200 (a3ad2f6) they reached 18 / 29 / 36 % of the experts' roofline at TP8 B 1 / 8 / 64, not the
60-80 % the instruction count alone allowed: a program waits for each K step's loads before its decode, and at
small batches FC1 had too few programs (TP8 B1: 192 for 132 SMs, 4 warps each) to fill an SM's schedulers.
So FC1 splits its K loop at small batches (tiles.toml fc1_splits; each split a compile-time number of whole steps):
its programs write FP32 gate and up partials, and `k3_moe_situ` sums them in split order before SiTU, vLLM's
separate activation launch. TP8 B1: 1,344 programs of one 512-wide step, FC1 26.9 -> 20.6 us; with the align
kernel's register-only path (routing.py) the experts took 37 us instead of 47 (fda4029, docs/stock-path.md). FC2
can split the same way (the slot sum adds its partials) but measured no gain.

Interpreted (TRITON_INTERPRET=1, CPU tensors) the inline PTX cannot run: the same codes become FP32 bit patterns with
the same value (value * 2^-126) and are scaled by the same power of two in FP32, and the dot runs in FP32 (exact
for these products); only the FP32 summation order can differ from the GPU path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3_decode.reference.mxfp import BLOCK, MxTensor
from k3_decode.stock.triton_moe.common import bf16_rne, pow2_f32, situ_f32
from k3_decode.stock.triton_moe.limits import MAX_PAIRS, WEIGHT_SHIFT
from k3_decode.stock.triton_moe.routing import align
from k3_decode.stock.triton_moe.tiles import ExpertTiles

# $4: 4 packed bytes (8 codes: byte i holds elements 2i (low nibble) and 2i + 1 (high nibble)); $5, $6: the BF16
# scale factor, twice in each register. Out: $0, $1 the even elements of bytes (0, 1) and (2, 3), $2, $3 the odd.
# prmt spreads bytes (0, 1) and (2, 3) into the low bytes of the two halves; masking one nibble per half and
# multiplying by 2^12 + 2^6 (even) or 2^8 + 2^2 (odd) puts its sign bit at 15 and e1 e0 m at 8..6 (the two shifted
# copies do not overlap), and the last mask keeps those bits of each half.
_DECODE_PTX = tl.constexpr("""
{
.reg .b32 t, u, a;
prmt.b32 t, $4, 0, 0x4140;
prmt.b32 u, $4, 0, 0x4342;
and.b32 a, t, 0x000F000F;
mul.lo.u32 a, a, 0x1040;
and.b32 a, a, 0x81C081C0;
mul.rn.bf16x2 $0, a, $5;
and.b32 a, u, 0x000F000F;
mul.lo.u32 a, a, 0x1040;
and.b32 a, a, 0x81C081C0;
mul.rn.bf16x2 $1, a, $6;
and.b32 a, t, 0x00F000F0;
mul.lo.u32 a, a, 0x104;
and.b32 a, a, 0x81C081C0;
mul.rn.bf16x2 $2, a, $5;
and.b32 a, u, 0x00F000F0;
mul.lo.u32 a, a, 0x104;
and.b32 a, a, 0x81C081C0;
mul.rn.bf16x2 $3, a, $6;
}
""")


@triton.jit
def _decode(packed, scale, SHIFT: tl.constexpr, ASM: tl.constexpr):
    """(even, odd) weights times 2^-SHIFT of packed MXFP4 bytes [..., 16] with their scale bytes [..., 1].

    even[..., j] is element 2j, odd[..., j] element 2j + 1. BF16 through the inline PTX (ASM), else FP32 with the
    same values (the interpreter's path).
    """
    # 2^(b - 127) * 2^-SHIFT = 2^(b - SHIFT - 1) * 2^-126: the decoded bits already carry the 2^-126.
    e = scale.to(tl.int32) - (SHIFT + 1)
    if ASM:
        factor = ((e + 127) << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)
        factor = tl.broadcast_to(factor, packed.shape)
        even, odd = tl.inline_asm_elementwise(
            _DECODE_PTX, "=r,=r,=r,=r,r,r,r", [packed, factor], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4
        )
    else:
        b = packed.to(tl.int32)
        # FP32 bits s | 0000 00 e1 e0 | m 0...: a code's value times 2^-126 (the +-0.5 codes are FP32 subnormals).
        even = (((b & 0x8) << 28) | ((b & 0x7) << 22)).to(tl.float32, bitcast=True) * pow2_f32(e)
        odd = (((b & 0x80) << 24) | ((b & 0x70) << 18)).to(tl.float32, bitcast=True) * pow2_f32(e)
    return even, odd


@triton.jit
def _load_step(w_rows, w_ok, s_rows, x_rows, x_ok, k0, K, BK: tl.constexpr, EVEN_K: tl.constexpr):
    """One K step: packed codes [R, BK/32, 16], scale bytes [R, BK/32, 1], activations [BM, BK] (zero past K)."""
    nb = tl.arange(0, BK // 32)
    j = tl.arange(0, 16)
    kx = k0 + tl.arange(0, BK)
    byte = (k0 // 2 + nb * 16)[None, :, None] + j[None, None, :]
    blk = (k0 // 32 + nb)[None, :, None]
    if EVEN_K:
        packed = tl.load(w_rows[:, None, None] + byte, mask=w_ok[:, None, None], other=0)
        scale = tl.load(s_rows[:, None, None] + blk, mask=w_ok[:, None, None], other=0)
        x = tl.load(x_rows[:, None] + kx[None, :], mask=x_ok[:, None], other=0.0)
    else:
        packed = tl.load(w_rows[:, None, None] + byte, mask=w_ok[:, None, None] & (byte < K // 2), other=0)
        scale = tl.load(s_rows[:, None, None] + blk, mask=w_ok[:, None, None] & (blk < K // 32), other=0)
        x = tl.load(x_rows[:, None] + kx[None, :], mask=x_ok[:, None] & (kx < K)[None, :], other=0.0)
    return packed, scale, x


@triton.jit
def _mx_gemm_t(
    x_rows,
    x_ok,
    w_rows,
    w_ok,
    s_rows,
    k_lo,
    K,
    STEPS: tl.constexpr,
    BM: tl.constexpr,
    R: tl.constexpr,
    BK: tl.constexpr,
    SHIFT: tl.constexpr,
    EVEN_K: tl.constexpr,
    ASM: tl.constexpr,
):
    """acc [R, BM] FP32 = 2^-SHIFT * W[R, k] @ x[BM, k]^T over the STEPS K steps from k_lo, for MXFP4 W (row
    pointers w_rows to the packed codes, s_rows to the scale bytes) and BF16 x (row pointers x_rows); rows past
    w_ok / x_ok and columns past K read as zero. A compile-time trip count: with a run-time bound (k_lo + a split's
    length) the BK = 512 FC1 loop spilled registers."""
    acc = tl.zeros([R, BM], dtype=tl.float32)
    for i in range(STEPS):
        k0 = k_lo + i * BK
        packed, scale, x = _load_step(w_rows, w_ok, s_rows, x_rows, x_ok, k0, K, BK, EVEN_K)
        even, odd = _decode(packed, scale, SHIFT, ASM)
        x_even, x_odd = tl.split(tl.reshape(x, (BM, BK // 2, 2)))  # columns j: elements 2j and 2j + 1 of the step
        if ASM:
            acc = tl.dot(tl.reshape(even, (R, BK // 2)), tl.trans(x_even), acc)
            acc = tl.dot(tl.reshape(odd, (R, BK // 2)), tl.trans(x_odd), acc)
        else:
            acc = tl.dot(tl.reshape(even, (R, BK // 2)), tl.trans(x_even.to(tl.float32)), acc, input_precision="ieee")
            acc = tl.dot(tl.reshape(odd, (R, BK // 2)), tl.trans(x_odd.to(tl.float32)), acc, input_precision="ieee")
    return acc


@triton.jit
def k3_moe_fc1(
    x_ptr,
    w_ptr,
    s_ptr,
    sorted_ptr,
    block_expert_ptr,
    part_ptr,
    num_pairs,
    inter,
    K,
    stride_x,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_part_split,
    stride_part,
    TOP_K: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    STEPS: tl.constexpr,
    SHIFT: tl.constexpr,
    EVEN_K: tl.constexpr,
    ASM: tl.constexpr,
):
    """part[split, pair, c] = x[token] . gate_e[c] and part[split, pair, inter + c] = x[token] . up_e[c] in FP32,
    over the split's STEPS K steps of BK from split * STEPS * BK, for one expert block and BN columns c.

    The program's 2 BN weight rows are the gate rows of its columns, then their up rows (w13 is [gate | up]).
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if e >= 0:
        r = tl.arange(0, 2 * BN)
        col = pid_n * BN + r % BN
        w_ok = col < inter
        rows = col + (r // BN) * inter
        w_rows = w_ptr + e * stride_we + rows * stride_wn
        s_rows = s_ptr + e * stride_se + rows * stride_sn
        pair = tl.load(sorted_ptr + pid_m * BM + tl.arange(0, BM))
        ok = pair < num_pairs
        x_rows = x_ptr + (pair // TOP_K) * stride_x  # int32 offsets: B * L is far below 2^31
        k_lo = split * (STEPS * BK)
        acc = _mx_gemm_t(x_rows, ok, w_rows, w_ok, s_rows, k_lo, K, STEPS, BM, 2 * BN, BK, SHIFT, EVEN_K, ASM)
        acc = acc * (2.0**SHIFT)  # exact: a power of two
        mask = w_ok[:, None] & ok[None, :]
        out = part_ptr + split * stride_part_split + pair[None, :] * stride_part + rows[:, None]
        tl.store(out, acc, mask=mask)


@triton.jit
def k3_moe_situ(
    part_ptr,
    out_ptr,
    inter,
    stride_part_split,
    stride_part,
    stride_out,
    beta,
    beta_lin,
    SPLITS: tl.constexpr,
    CLAMP_UP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """out[pair, c] = bf16(SiTU(gate, up)), gate and up the sums over FC1's K splits, in split order, of its FP32
    partials (one program per pair and BLOCK columns)."""
    pair = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    gate = tl.zeros([BLOCK], dtype=tl.float32)
    up = tl.zeros([BLOCK], dtype=tl.float32)
    for split in tl.static_range(SPLITS):
        row = part_ptr + split * stride_part_split + pair * stride_part
        gate += tl.load(row + cols, mask=ok, other=0.0)
        up += tl.load(row + inter + cols, mask=ok, other=0.0)
    act = situ_f32(gate, up, beta, beta_lin, CLAMP_UP)
    tl.store(out_ptr + pair * stride_out + cols, bf16_rne(act), mask=ok)


@triton.jit
def k3_moe_fc2(
    a_ptr,
    w_ptr,
    s_ptr,
    sorted_ptr,
    block_expert_ptr,
    route_w_ptr,
    out_ptr,
    num_pairs,
    latent,
    K,
    stride_a,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_out_split,
    stride_out,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    STEPS: tl.constexpr,
    SHIFT: tl.constexpr,
    EVEN_K: tl.constexpr,
    ASM: tl.constexpr,
):
    """out[split, pair, n] = routing_weight[pair] * (a[pair] . w2_e[n]) in FP32 over the split's STEPS K steps of BK
    from split * STEPS * BK, for one expert block and BN rows n."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if e >= 0:
        rows = pid_n * BN + tl.arange(0, BN)
        w_ok = rows < latent
        w_rows = w_ptr + e * stride_we + rows * stride_wn
        s_rows = s_ptr + e * stride_se + rows * stride_sn
        pair = tl.load(sorted_ptr + pid_m * BM + tl.arange(0, BM))
        ok = pair < num_pairs
        a_rows = a_ptr + pair * stride_a
        k_lo = split * (STEPS * BK)
        acc = _mx_gemm_t(a_rows, ok, w_rows, w_ok, s_rows, k_lo, K, STEPS, BM, BN, BK, SHIFT, EVEN_K, ASM)
        route_w = tl.load(route_w_ptr + pair, mask=ok, other=0.0)
        out = acc * (route_w * (2.0**SHIFT))[None, :]
        mask = w_ok[:, None] & ok[None, :]
        dest = out_ptr + split * stride_out_split + pair[None, :] * stride_out + rows[:, None]
        tl.store(dest, out, mask=mask)


@triton.jit
def k3_moe_sum(
    pairs_ptr,
    out_ptr,
    latent,
    stride_split,
    stride_pairs,
    stride_out,
    TOP_K: tl.constexpr,
    SPLITS: tl.constexpr,
    BN: tl.constexpr,
):
    """out[b, n] = bf16(sum over slots 0..k-1, in slot order, of the weighted FP32 expert outputs), each slot's
    output the sum of FC2's K-split partials in split order."""
    b = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    ok = n < latent
    acc = tl.zeros([BN], dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        expert_out = tl.zeros([BN], dtype=tl.float32)
        for split in tl.static_range(SPLITS):
            row = pairs_ptr + split * stride_split + (b * TOP_K + slot) * stride_pairs
            expert_out += tl.load(row + n, mask=ok, other=0.0)
        acc += expert_out
    tl.store(out_ptr + b * stride_out + n, bf16_rne(acc), mask=ok)


def experts(
    latent: Tensor,
    ids: Tensor,
    weights: Tensor,
    w13: MxTensor,
    w2: MxTensor,
    *,
    beta: float,
    beta_lin: float | None,
    tiles: ExpertTiles,
) -> Tensor:
    """This rank's routed sum [B, L] BF16: sum_k weights[b, k] * expert_{ids[b, k]}(latent[b]).

    latent [B, L] BF16; ids [B, k] int32 and weights [B, k] FP32 as `routing.route` makes them. Five launches
    (align, FC1, SiTU, FC2, slot sum) per chunk of at most MAX_PAIRS pairs.
    """
    batch, lat = latent.shape
    top_k = ids.shape[1]
    num_experts, two_inter = w13.data.shape[0], w13.data.shape[1]
    inter = two_inter // 2
    if latent.dtype != torch.bfloat16 or ids.dtype != torch.int32 or weights.dtype != torch.float32:
        raise TypeError(
            f"experts need BF16 latent, int32 ids, FP32 weights; got {latent.dtype}, {ids.dtype}, {weights.dtype}"
        )
    if lat % BLOCK or inter % BLOCK or tuple(w2.data.shape) != (num_experts, lat, inter // 2):
        raise ValueError(
            f"latent {tuple(latent.shape)} does not fit experts w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)}"
        )
    latent = latent.contiguous()
    out = torch.empty(batch, lat, dtype=torch.bfloat16, device=latent.device)
    chunk = max(1, MAX_PAIRS // top_k)
    for t0 in range(0, batch, chunk):
        t1 = min(batch, t0 + chunk)
        _experts_chunk(latent[t0:t1], ids[t0:t1], weights[t0:t1], w13, w2, out[t0:t1], beta, beta_lin, tiles)
    return out


def k_splits(steps: int, wanted: int) -> int:
    """The K splits a GEMM runs: the most, up to `wanted`, that share its `steps` K steps evenly (a compile-time
    trip count per split; K3's latent is 7 steps of 512 or 14 of 256, its expert intermediate 3 (TP8) or 2 (TP16)
    steps of 128)."""
    return max(d for d in range(1, min(wanted, steps) + 1) if steps % d == 0)


def _experts_chunk(
    latent: Tensor,
    ids: Tensor,
    weights: Tensor,
    w13: MxTensor,
    w2: MxTensor,
    out: Tensor,
    beta: float,
    beta_lin: float | None,
    tiles: ExpertTiles,
) -> None:
    batch, lat = latent.shape
    top_k = ids.shape[1]
    num_experts, inter = w13.data.shape[0], w13.data.shape[1] // 2
    pairs = batch * top_k
    group = align(ids.contiguous(), num_experts, tiles.block_m)
    dev = latent.device
    asm = dev.type != "cpu"  # CPU tensors: the kernels run under TRITON_INTERPRET=1, where inline PTX cannot
    fc1_steps = triton.cdiv(lat, tiles.fc1_block_k)
    splits = k_splits(fc1_steps, tiles.fc1_splits)
    part = torch.empty(splits, pairs, 2 * inter, dtype=torch.float32, device=dev)
    k3_moe_fc1[(group.max_blocks, triton.cdiv(inter, tiles.fc1_block_n), splits)](
        latent,
        w13.data,
        w13.scales,
        group.sorted_pairs,
        group.block_expert,
        part,
        pairs,
        inter,
        lat,
        latent.stride(0),
        w13.data.stride(0),
        w13.data.stride(1),
        w13.scales.stride(0),
        w13.scales.stride(1),
        part.stride(0),
        part.stride(1),
        TOP_K=top_k,
        BM=tiles.block_m,
        BN=tiles.fc1_block_n,
        BK=tiles.fc1_block_k,
        STEPS=fc1_steps // splits,
        SHIFT=WEIGHT_SHIFT,
        EVEN_K=lat % tiles.fc1_block_k == 0,
        ASM=asm,
        num_warps=tiles.fc1_warps,
        num_stages=tiles.fc1_stages,
    )
    act = torch.empty(pairs, inter, dtype=torch.bfloat16, device=dev)
    clamp = beta_lin is not None and beta_lin > 0
    k3_moe_situ[(pairs, triton.cdiv(inter, tiles.situ_block_n))](
        part,
        act,
        inter,
        part.stride(0),
        part.stride(1),
        act.stride(0),
        beta,
        beta_lin if clamp else 1.0,
        SPLITS=splits,
        CLAMP_UP=clamp,
        BLOCK=tiles.situ_block_n,
    )
    fc2_steps = triton.cdiv(inter, tiles.fc2_block_k)
    fc2_split = k_splits(fc2_steps, tiles.fc2_splits)
    per_pair = torch.empty(fc2_split, pairs, lat, dtype=torch.float32, device=dev)
    k3_moe_fc2[(group.max_blocks, triton.cdiv(lat, tiles.fc2_block_n), fc2_split)](
        act,
        w2.data,
        w2.scales,
        group.sorted_pairs,
        group.block_expert,
        weights.contiguous(),
        per_pair,
        pairs,
        lat,
        inter,
        act.stride(0),
        w2.data.stride(0),
        w2.data.stride(1),
        w2.scales.stride(0),
        w2.scales.stride(1),
        per_pair.stride(0),
        per_pair.stride(1),
        BM=tiles.block_m,
        BN=tiles.fc2_block_n,
        BK=tiles.fc2_block_k,
        STEPS=fc2_steps // fc2_split,
        SHIFT=WEIGHT_SHIFT,
        EVEN_K=inter % tiles.fc2_block_k == 0,
        ASM=asm,
        num_warps=tiles.fc2_warps,
        num_stages=tiles.fc2_stages,
    )
    k3_moe_sum[(batch, triton.cdiv(lat, tiles.sum_block_n))](
        per_pair,
        out,
        lat,
        per_pair.stride(0),
        per_pair.stride(1),
        out.stride(0),
        TOP_K=top_k,
        SPLITS=fc2_split,
        BN=tiles.sum_block_n,
    )
