"""Shared helpers of the stock MoE/MLP tests (no tests here): tolerance checks and k3-mini weights + oracles."""

from __future__ import annotations

import tomllib
from pathlib import Path

import torch
from torch import Tensor

from harness.numerics.compare import ToleranceTable, compare
from k3_decode.config import K3_MINI, ModelDims
from k3_decode.reference import moe as ref
from k3_decode.weights import MoeWeights, SyntheticWeights

TOLERANCES = ToleranceTable(
    tomllib.loads((Path(__file__).parent / "test_moe_tolerances.toml").read_text()), "test_moe_tolerances.toml"
)
REL_L2 = 1e-2
"""||out - ref|| / ||ref|| bound for every BF16 op: BF16 operands land between 1e-3 and 1e-2 (measured ~2e-3..4e-3)."""


def failures(entry: str, out: Tensor, expected: Tensor, rel_l2: float | None = REL_L2) -> list[str]:
    """What fails when `out` is held to the tolerance entry "op.dtype" against `expected` (empty: it passes)."""
    op, dtype = entry.rsplit(".", 1)
    checks, _ = compare(entry, out, expected, TOLERANCES.get(op, dtype))
    failed = [c.describe() for c in checks if not c.passed]
    if rel_l2 is not None and out.shape == expected.shape:
        e = expected.double().cpu()
        rel = float((out.double().cpu() - e).norm() / e.norm())
        if not rel <= rel_l2:
            failed.append(f"{entry}: rel-L2 {rel:.3e} > {rel_l2}")
    return failed


def assert_matches(entry: str, out: Tensor, expected: Tensor, rel_l2: float | None = REL_L2) -> None:
    failed = failures(entry, out, expected, rel_l2)
    assert not failed, "; ".join(failed)


def moe_weights(tp: int, rank: int = 0, dims: ModelDims = K3_MINI, layer: int = 1) -> MoeWeights:
    weights = SyntheticWeights(dims, tp, rank).mlp(layer)
    assert isinstance(weights, MoeWeights)
    return weights


def hidden(batch: int, dims: ModelDims = K3_MINI, seed: int = 0, device: str = "cpu") -> Tensor:
    """Unit-RMS BF16 rows, as the post-attention RMSNorm hands them to the MLP."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, dims.hidden_size, generator=g).to(torch.bfloat16).to(device)


def oracle_moe(x: Tensor, weights: ref.LatentMoeWeights, dims: ModelDims) -> tuple[ref.MoePartial, ref.MoeTrace]:
    """The oracle's single-rank partial and its combine with the all-reduce elided (one rank's shapes)."""
    partial = ref.latent_moe_partial(x, weights, dims)
    return partial, ref.latent_moe_combine([partial], weights, dims)
