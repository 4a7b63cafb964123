"""Small @triton.jit helpers shared by the stock MoE kernels.

Every helper uses only integer and FP32 arithmetic: Triton 3.9's CPU interpreter mishandles BF16 arithmetic (a BF16
add gave NaN) and truncates on FP32 -> BF16 casts, so BF16 results are rounded here by hand (round to nearest even)
and handed back as BF16 bit patterns; on the GPU this costs a few integer ops in epilogues only.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def bf16_rne(x):
    """FP32 -> BF16, round to nearest, ties to even; NaN stays a quiet NaN."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(x != x, 0x7FC0, rounded)
    return rounded.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def tanh_f32(x):
    """tanh in FP32 to a few ulps: an odd series near 0 (where 1 - exp(-2|x|) would cancel), exp elsewhere.

    For |x| < 0.125 the series to x^9 is exact to ~1e-12 relative; above, t = exp(-2|x|) <= 0.78, so 1 - t keeps
    its relative precision; for large |x|, t underflows to 0 and the result is exactly +-1.
    """
    a = tl.abs(x)
    x2 = x * x
    series = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0)))))
    t = tl.exp(-2.0 * a)
    big = (1.0 - t) / (1.0 + t)
    return tl.where(a < 0.125, series, tl.where(x < 0, -big, big))


@triton.jit
def situ_f32(gate, up, beta, beta_lin, CLAMP_UP: tl.constexpr):
    """SiTU(g, u) = beta*tanh(g/beta)*sigmoid(g) * beta_lin*tanh(u/beta_lin), in FP32.

    vLLM 0.33.0 (vllm/model_executor/layers/activation.py `SituAndMul`); CLAMP_UP False means beta_lin <= 0,
    where the up branch is used unclamped.
    """
    gated = beta * tanh_f32(gate / beta) * tl.sigmoid(gate)
    if CLAMP_UP:
        up = beta_lin * tanh_f32(up / beta_lin)
    return gated * up


@triton.jit
def pow2_f32(e):
    """2^e as FP32 for int32 e in [-126, 127], built from its exponent bits (exact, no exp2 rounding)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def exponent_of(x):
    """floor(log2(x)) for FP32 x > 0 (subnormals read as -127); 0 for x == 0."""
    e = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    return tl.where(x > 0, e, 0)
