"""Limits of the stock MoE kernels, and the load-time weight checks that enforce them (no triton import here)."""

from __future__ import annotations

from k3_decode.reference.mxfp import MxTensor

WEIGHT_SHIFT = 52
"""The expert kernels' MMA sees each weight as w * 2^-52 (BF16) and scales the FP32 result back by 2^52: the block
scale 2^(b - 127) is one BF16 multiply by 2^(b - 53) of a decoded code (its value times 2^-126), and that factor is
a normal BF16 number for every scale byte up to MAX_SCALE_BYTE (experts.py, "What this version does")."""

MAX_SCALE_BYTE = 180
"""Largest UE8M0 scale byte (|w| < 6 * 2^53) the expert kernels take: 2^(b - 53) must stay below BF16's 2^128.
Real weights sit near 120; 255 is NaN. Blocks with scale bytes below MIN_EXACT_SCALE_BYTE enter the MMA as BF16
subnormals (exact, but a tensor core may flush them): weights below 2^-74 of no consequence next to real ones."""

MIN_EXACT_SCALE_BYTE = 54
"""Smallest scale byte whose weights w * 2^-52 are normal BF16 numbers (0.5 * 2^(54 - 179) = 2^-126)."""

MAX_PAIRS = 4096
"""Most (token, slot) pairs one align launch sorts in one program; `experts` splits larger batches."""

PAIRWISE_MAX_PAIRS = 128
"""Most pairs align places by pairwise comparisons ([P, P] in one program's registers: 128 per thread at 4 warps),
B <= 8 at K3's top-16; above it sorts."""


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
