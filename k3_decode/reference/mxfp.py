"""OCP Microscaling (MX) block formats MXFP4 and MXFP8 (E4M3), in pure torch on any device.

Source: OCP Microscaling Formats (MX) Specification v1.0 (called "the spec" below). Kimi K3 stores its routed
experts as MXFP4 and the specialized decode quantizes expert activations to MXFP8 (vLLM 0.33.0,
vllm/models/kimi_k3/nvidia/specialized_decode/cutedsl/moe), so these are the reference codecs for both.

Block structure
    Blocks are 32 consecutive elements along the LAST dimension (the GEMM reduction dim K). Each block has one
    scale X = 2^(b - 127) stored as a UE8M0 byte b (b = 255 is NaN; there is no zero and no infinity).
    A value is X * P where P is the element (FP4 E2M1 for MXFP4, FP8 E4M3 "fn" for MXFP8).

MXFP4 storage
    ``data``   uint8 [..., K // 2]: two E2M1 codes per byte. The even-index element (2i) sits in the LOW nibble
               (bits 3..0) and the odd-index element (2i + 1) in the HIGH nibble (bits 7..4), the order of torch's
               ``float4_e2m1fn_x2`` and of compressed-tensors MXFP4 checkpoints.
    ``scales`` uint8 [..., K // 32]: scale byte j covers elements 32j .. 32j + 31.
    An E2M1 code is s e1 e0 m: sign bit 3, then magnitude index 0..7 for {0, 0.5, 1, 1.5, 2, 3, 4, 6}, so the
    magnitude code is the position in that list and an even code has mantissa bit 0.

MXFP8 storage
    ``data``   float8_e4m3fn [..., K] (max 448, no infinity, NaN = 0x7F / 0xFF); ``scales`` as for MXFP4.

Scale rule ("floor", the spec's rule, the default)
    shared_exp = floor(log2(amax)) - emax_elem with emax_elem = 2 for E2M1 (6 = 1.5 * 2^2) and 8 for E4M3
    (448 = 1.75 * 2^8), clamped to the UE8M0 range [-127, 127]. Elements are V / X rounded to nearest, ties to
    even, and magnitudes above the element maximum are clamped to it (the spec clamps normal numbers). With this
    rule the block maximum lands in [4, 8) for E2M1, so values in (6, 8) * X saturate to 6 * X.
Scale rule ("ceil", offered for kernels that avoid saturation)
    shared_exp = the smallest e with amax <= elem_max * 2^e, so nothing saturates; it trades the top binade's
    headroom for never clipping. Computed exactly from the binary exponent, no floating-point log.

Special values (decided here where the spec leaves the choice to the implementation)
    * A block with any NaN or +-Inf gets scale byte 255 (NaN) and element codes 0: E2M1 has no NaN or Inf and
      E4M3 "fn" has no Inf, so the scale is the only place to say it; the whole block dequantizes to NaN.
    * An all-zero block has amax 0, log2 = -inf, clamped to the minimum: scale byte 0 (2^-127), codes 0.
    * Tiny blocks whose shared exponent falls below -127 use byte 0; elements that underflow become +-0.
    * The sign of zero is kept: -0.0, and negative values that round to zero, give E2M1 code 0b1000 (-0).
    * Inputs are converted to float32 first (exact for bf16 / fp16; float64 input is rounded once).
    * Dequantization works in float32: a block whose values exceed the float32 range (MXFP4 scale bytes above
      252, MXFP8 above 246 with full-range elements) becomes +-Inf. The floor rule never makes such a block from
      float32 input; the ceil rule can, for block maxima within a factor 4 of the float32 maximum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

BLOCK = 32
E8M0_BIAS = 127
E8M0_NAN = 255
E8M0_MIN_EXP = -127
E8M0_MAX_EXP = 127

E2M1_MAX = 6.0
E2M1_EMAX = 2
E4M3_MAX = 448.0
E4M3_EMAX = 8

ScaleRule = Literal["floor", "ceil"]
MxFormat = Literal["mxfp4", "mxfp8"]

# Magnitudes of the eight non-negative E2M1 codes, in code order.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

_FLOAT_INPUTS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class MxTensor:
    """One MX-quantized tensor: element data plus one UE8M0 scale byte per 32 elements of the last dim."""

    fmt: MxFormat
    data: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        """Logical (dequantized) shape."""
        k = self.data.shape[-1] * (2 if self.fmt == "mxfp4" else 1)
        return torch.Size((*self.data.shape[:-1], k))

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scales.numel()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.fmt == "mxfp4":
            return dequantize_mxfp4(self.data, self.scales, dtype)
        return dequantize_mxfp8(self.data, self.scales, dtype)


# ---------------------------------------------------------------------------------------------------------------
# Exact powers of two and UE8M0 scales, built from float32 bit patterns so no pow/log rounding can creep in.


def exp2_exact(e: torch.Tensor) -> torch.Tensor:
    """2^e as float32 for integer e in [-149, 127], exactly (subnormals included)."""
    e = e.to(torch.int64)
    if bool(((e < -149) | (e > 127)).any()):
        raise ValueError("exp2_exact: exponent outside the float32 range [-149, 127]")
    normal = (e + 127).clamp(min=1) << 23
    subnormal = torch.ones_like(e) << (e + 149).clamp(min=0, max=22)
    bits = torch.where(e >= -126, normal, subnormal)
    return bits.to(torch.int32).view(torch.float32)


def e8m0_to_float32(scales: torch.Tensor) -> torch.Tensor:
    """Decode UE8M0 bytes: 2^(b - 127), NaN for 255."""
    _require_uint8(scales, "scales")
    b = scales.to(torch.int64)
    value = exp2_exact(b.clamp(max=254) - E8M0_BIAS)
    return torch.where(b == E8M0_NAN, torch.full_like(value, float("nan")), value)


def _binary_exponent(amax: torch.Tensor) -> torch.Tensor:
    """floor(log2(amax)) for finite amax > 0, exact: frexp gives amax = m * 2^E with m in [0.5, 1)."""
    _, e = torch.frexp(amax)
    return e.to(torch.int64) - 1


def shared_exponent(amax: torch.Tensor, elem_max: float, elem_emax: int, rule: ScaleRule) -> torch.Tensor:
    """Unbiased block exponent (int64, clamped to [-127, 127]) for finite, non-negative block maxima."""
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    if rule == "floor":
        exp = _binary_exponent(safe) - elem_emax
    elif rule == "ceil":
        # amax = m * 2^E, elem_max = mm * 2^EE (m, mm in [0.5, 1)); amax <= elem_max * 2^e  <=>
        # e >= E - EE when m <= mm, else e >= E - EE + 1. Comparing mantissas keeps it exact.
        m, e_amax = torch.frexp(safe)
        mm, e_max = math.frexp(elem_max)
        exp = e_amax.to(torch.int64) - e_max + (m > mm).to(torch.int64)
    else:
        raise ValueError(f"unknown scale rule {rule!r}; use 'floor' (OCP MX v1.0) or 'ceil'")
    exp = torch.where(amax > 0, exp, torch.full_like(exp, E8M0_MIN_EXP))
    return exp.clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)


# ---------------------------------------------------------------------------------------------------------------
# E2M1 elements


def e2m1_encode(y: torch.Tensor) -> torch.Tensor:
    """Round already-scaled values to E2M1 codes (uint8, 0..15): nearest, ties to even code, saturate at 6.

    +-Inf saturates to +-6; NaN has no E2M1 code and gives an unspecified code (the block codec never passes one).
    """
    y = y.to(torch.float32)
    grid = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=y.device)
    mag = y.abs()
    lo = (torch.bucketize(mag, grid, right=True) - 1).clamp(0, 7)
    hi = (lo + 1).clamp(max=7)
    # Midpoints of adjacent grid values are exact in float32, so the comparison decides ties exactly.
    mid = (grid[lo] + grid[hi]) * 0.5
    up = (mag > mid) | ((mag == mid) & (hi % 2 == 0))
    code = torch.where(up, hi, lo).to(torch.uint8)
    sign = torch.signbit(y).to(torch.uint8) << 3
    return code | sign


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, 0..15) to float32 values."""
    _require_uint8(codes, "codes")
    grid = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    c = codes.to(torch.int64)
    mag = grid[c & 7]
    return torch.where((c & 8) != 0, -mag, mag)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack E2M1 codes [..., K] (K even) two per byte: element 2i low nibble, element 2i + 1 high nibble."""
    _require_uint8(codes, "codes")
    if codes.ndim == 0 or codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4: the last dim must be even, got shape {tuple(codes.shape)}")
    if bool((codes > 15).any()):
        raise ValueError("pack_fp4: codes must be 4-bit (0..15)")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_fp4: uint8 [..., K / 2] to codes [..., K]."""
    _require_uint8(packed, "packed")
    if packed.ndim == 0:
        raise ValueError("unpack_fp4: expected at least one dimension")
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


# ---------------------------------------------------------------------------------------------------------------
# Block quantization


def quantize_mxfp4(x: torch.Tensor, scale_rule: ScaleRule = "floor") -> MxTensor:
    """Quantize x [..., K] (K a multiple of 32) to MXFP4."""
    blocks, exp, bad = _prepare_blocks(x, E2M1_MAX, E2M1_EMAX, scale_rule)
    y = blocks * exp2_exact(-exp).unsqueeze(-1)
    data = pack_fp4(e2m1_encode(y).flatten(-2))
    return MxTensor("mxfp4", data, _scale_bytes(exp, bad))


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """MXFP4 (packed codes [..., K/2], scale bytes [..., K/32]) to dtype [..., K]."""
    _check_scales(packed.shape, scales, per_byte=2)
    values = e2m1_decode(unpack_fp4(packed))
    return _apply_scales(values, scales).to(dtype)


def quantize_mxfp8(x: torch.Tensor, scale_rule: ScaleRule = "floor") -> MxTensor:
    """Quantize x [..., K] (K a multiple of 32) to MXFP8 with E4M3 elements, saturating at +-448."""
    blocks, exp, bad = _prepare_blocks(x, E4M3_MAX, E4M3_EMAX, scale_rule)
    y = (blocks * exp2_exact(-exp).unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX)
    # torch's float32 -> float8_e4m3fn conversion rounds to nearest even; the clamp keeps it off the NaN code.
    data = y.to(torch.float8_e4m3fn).flatten(-2)
    return MxTensor("mxfp8", data, _scale_bytes(exp, bad))


def dequantize_mxfp8(data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """MXFP8 (E4M3 data [..., K], scale bytes [..., K/32]) to dtype [..., K]."""
    if data.dtype != torch.float8_e4m3fn:
        raise TypeError(f"dequantize_mxfp8: data must be float8_e4m3fn, got {data.dtype}")
    _check_scales(data.shape, scales, per_byte=1)
    return _apply_scales(data.to(torch.float32), scales).to(dtype)


def _prepare_blocks(
    x: torch.Tensor, elem_max: float, elem_emax: int, rule: ScaleRule
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split x into [..., K/32, 32] float32 blocks; return them, the shared exponents, and the non-finite mask."""
    if x.dtype not in _FLOAT_INPUTS:
        raise TypeError(f"MX quantization needs a floating tensor (fp16/bf16/fp32/fp64), got {x.dtype}")
    if x.ndim == 0 or x.shape[-1] == 0 or x.shape[-1] % BLOCK:
        raise ValueError(
            f"MX quantization needs the last dim to be a positive multiple of {BLOCK} (one scale per {BLOCK} "
            f"elements), got shape {tuple(x.shape)}"
        )
    blocks = x.to(torch.float32).unflatten(-1, (-1, BLOCK))
    # amax propagates NaN and Inf, so one finiteness test per block finds every poisoned block.
    amax = blocks.abs().amax(dim=-1)
    bad = ~torch.isfinite(amax)
    if bool(bad.any()):
        # A non-finite block is stored as a NaN scale with zero codes; zero it and give it a harmless exponent.
        amax = torch.where(bad, torch.zeros_like(amax), amax)
        blocks = torch.where(bad.unsqueeze(-1), torch.zeros_like(blocks), blocks)
    return blocks, shared_exponent(amax, elem_max, elem_emax, rule), bad


def _scale_bytes(exp: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    biased = torch.where(bad, torch.full_like(exp, E8M0_NAN), exp + E8M0_BIAS)
    return biased.to(torch.uint8)


def _apply_scales(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    blocks = values.unflatten(-1, (-1, BLOCK))
    return (blocks * e8m0_to_float32(scales).unsqueeze(-1)).flatten(-2)


def _check_scales(data_shape: torch.Size, scales: torch.Tensor, per_byte: int) -> None:
    _require_uint8(scales, "scales")
    if len(data_shape) == 0:
        raise ValueError("MX data needs at least one dimension")
    k = data_shape[-1] * per_byte
    expected = (*data_shape[:-1], k // BLOCK)
    if k % BLOCK or tuple(scales.shape) != expected:
        raise ValueError(
            f"MX data of shape {tuple(data_shape)} holds K={k} elements per row and needs scales of shape "
            f"{expected} (one per {BLOCK}); got {tuple(scales.shape)}"
        )


def _require_uint8(t: torch.Tensor, what: str) -> None:
    if t.dtype != torch.uint8:
        raise TypeError(f"{what} must be uint8, got {t.dtype}")
