"""Limits of the stock MoE kernels, and the load-time weight checks that enforce them (no triton import here)."""

from __future__ import annotations

from k3_decode.reference.mxfp import MxTensor

MAX_SCALE_BYTE = 200
"""Largest UE8M0 scale byte (|w| < 6 * 2^73) the expert kernels take. They scale each 32-wide block's FP32 dot of
FP16 activations (< 2^16) and codes (<= 6 * 2^-14) by 2^(b - 113), so a block sum is at most 768 * 2^(b - 113) and
a K of 2^12 elements adds 2^7: b <= 200 keeps that far below FP32's 2^128. Real weights sit near 120; 255 is NaN."""

MAX_PAIRS = 4096
"""Most (token, slot) pairs one align launch sorts in one program; `experts` splits larger batches."""


def check_expert_weights(w13: MxTensor, w2: MxTensor, latent_size: int) -> None:
    """Load-time checks (they read the scales, so call them once per layer, not per step)."""
    if w13.fmt != "mxfp4" or w2.fmt != "mxfp4":
        raise ValueError(f"stock experts need MXFP4 weights, got w13 {w13.fmt} and w2 {w2.fmt}")
    e, rows, lat = w13.shape
    if lat != latent_size or rows % 2 or tuple(w2.shape) != (e, latent_size, rows // 2):
        raise ValueError(
            f"expert shapes w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} are not [E, 2I, {latent_size}] and "
            f"[E, {latent_size}, I]"
        )
    for name, t in (("w13.data", w13.data), ("w13.scales", w13.scales), ("w2.data", w2.data), ("w2.scales", w2.scales)):
        if not t.is_contiguous():
            raise ValueError(f"expert {name} must be contiguous; call .contiguous() when loading")
    for name, scales in (("w13", w13.scales), ("w2", w2.scales)):
        top = int(scales.max())
        if top > MAX_SCALE_BYTE:
            raise ValueError(
                f"expert {name} has a scale byte {top} (> {MAX_SCALE_BYTE}: NaN or |w| >= 2^74); the stock MXFP4 "
                "kernels cannot represent it, fix the checkpoint"
            )
