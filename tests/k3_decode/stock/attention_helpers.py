"""Shared builders and the tolerance check for the stock attention-side tests (CPU, interpreter and GPU).

Inputs are realistic rather than arbitrary: activations come out of the real (synthetic) projection weights, cache
states are random but of the magnitudes the model keeps, FP8 cache rows are quantized normal rows.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from k3_decode.config import ModelDims
from k3_decode.reference import kda as rk
from k3_decode.reference import mla as rm
from k3_decode.stock.mla import PagedLatentCache
from k3_decode.weights import KdaWeights, MlaWeights, SyntheticWeights

TOLERANCE_FILE = Path(__file__).with_name("attention_tolerances.toml")


@dataclass(frozen=True)
class Tolerance:
    rms_rel: float  # rms(got - ref) / rms(ref)
    peak_rel: float  # max|got - ref| / max|ref|
    reason: str


def load_tolerances(table: str = "ops") -> dict[str, Tolerance]:
    raw = tomllib.loads(TOLERANCE_FILE.read_text())[table]
    return {op: Tolerance(row["rms_rel"], row["peak_rel"], row["reason"]) for op, row in raw.items()}


def error_metrics(got: Tensor, ref: Tensor) -> tuple[float, float]:
    g, r = got.double().cpu(), ref.double().cpu()
    err = g - r
    rms_ref = float(r.square().mean().sqrt())
    return float(err.square().mean().sqrt()) / rms_ref, float(err.abs().max()) / float(r.abs().max())


def assert_close(got: Tensor, ref: Tensor, tol: Tolerance, what: str) -> tuple[float, float]:
    """Within `tol`, and not trivially: a zero, constant or wrongly scaled output fails even under loose numbers."""
    if tuple(got.shape) != tuple(ref.shape):
        raise AssertionError(f"{what}: shape {tuple(got.shape)} != reference {tuple(ref.shape)}")
    g, r = got.double().cpu(), ref.double().cpu()
    assert bool(torch.isfinite(g).all()), f"{what}: non-finite output"
    rms_ref, rms_got = float(r.square().mean().sqrt()), float(g.square().mean().sqrt())
    assert rms_ref > 0, f"{what}: the reference is all zeros, so the comparison proves nothing"
    assert 0.5 < rms_got / rms_ref < 2.0, f"{what}: output rms {rms_got:.4g} vs reference {rms_ref:.4g}"
    assert float(g.std()) > 0, f"{what}: constant output"
    rms_rel, peak_rel = error_metrics(g, r)
    assert rms_rel <= tol.rms_rel and peak_rel <= tol.peak_rel, (
        f"{what}: rms_rel {rms_rel:.3g} (tol {tol.rms_rel}), peak_rel {peak_rel:.3g} (tol {tol.peak_rel})"
    )
    return rms_rel, peak_rel


# --- KDA --------------------------------------------------------------------------------------------------------


def kda_layer(dims: ModelDims) -> int:
    return next(i for i in range(1, dims.num_layers) if dims.layer_kind(i) == "kda")


def mla_layer(dims: ModelDims) -> int:
    return next(i for i in range(dims.num_layers) if dims.layer_kind(i) == "mla")


def reference_kda_weights(w: KdaWeights) -> rk.KdaWeights:
    return rk.KdaWeights(f_b=w.f_b, conv=w.conv, a_log=w.a_log, dt_bias=w.dt_bias, o_norm=w.o_norm)


def random_kda_cache(spec: rk.KdaSpec, slots: int, num_spec: int, gen: torch.Generator, device: str) -> rk.KdaCache:
    """Conv taps ~ the unit-RMS projection outputs; recurrent states of the size the delta rule keeps them."""
    cache = rk.KdaCache.zeros(spec, slots, num_spec)
    cache.conv.copy_(torch.randn(cache.conv.shape, generator=gen))
    cache.recurrent.copy_(torch.randn(cache.recurrent.shape, generator=gen) * 0.3)
    return rk.KdaCache(cache.conv.to(device), cache.recurrent.to(device))


def clone_cache(cache: rk.KdaCache) -> rk.KdaCache:
    return rk.KdaCache(cache.conv.clone(), cache.recurrent.clone())


def projected_rows(weight: Tensor, lead: tuple[int, ...], gen: torch.Generator) -> Tensor:
    """The projection of unit-normal BF16 inputs through `weight` [rows, hidden], BF16 like the GEMM output."""
    x = torch.randn(*lead, weight.shape[1], generator=gen).to(torch.bfloat16).to(weight.device)
    return torch.nn.functional.linear(x, weight)


def weights_for(dims: ModelDims, tp: int, device: str, seed: int = 0) -> SyntheticWeights:
    return SyntheticWeights(dims, tp, rank=0, seed=seed, device=device)


# --- MLA --------------------------------------------------------------------------------------------------------


def reference_mla_weights(w: MlaWeights) -> rm.MlaWeights:
    return rm.MlaWeights(q_a_norm=w.q_a_norm, kv_a_norm=w.kv_a_norm, q_b=w.q_b, w_uk=w.w_uk, w_uv=w.w_uv)


@dataclass
class PagedSetup:
    paged: PagedLatentCache
    max_context: int


def random_paged_cache(
    dims: ModelDims,
    seq_lens: list[int],
    page_size: int,
    gen: torch.Generator,
    device: str,
    k_scale: float,
    q_scale: float,
) -> PagedSetup:
    """A paged FP8 cache of quantized unit-normal rows, pages shuffled across requests; zero-length requests are
    padding (slot -1) and their block-table rows point at a page no real request owns."""
    row = dims.mla.cache_row
    pages_per = [max(1, math.ceil(n / page_size)) for n in seq_lens]
    total = sum(pages_per) + 1
    cache = rm.quantize_e4m3(torch.randn(total, page_size, row, generator=gen), k_scale)
    order = torch.randperm(total, generator=gen)
    width = max(pages_per)
    table = torch.full((len(seq_lens), width), int(order[-1]), dtype=torch.int32)
    at = 0
    for b, n in enumerate(pages_per):
        table[b, :n] = order[at : at + n]
        at += n
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    slots = rm.decode_slot_mapping(table, lens, page_size)
    paged = PagedLatentCache(
        cache.to(device), table.to(device), lens.to(device), slots.to(device), k_scale=k_scale, q_scale=q_scale
    )
    return PagedSetup(paged, max(seq_lens))


def oracle_mla(projected: Tensor, w: MlaWeights, dims: ModelDims, paged: PagedLatentCache, cache: Tensor) -> Tensor:
    """The oracle's decode with the stock path's FP8 query and BF16 cache row rounding, on a copy of the cache."""
    return rm.mla_decode(
        projected,
        reference_mla_weights(w),
        dims.mla,
        cache,
        paged.block_table,
        paged.seq_lens,
        paged.slot_mapping,
        paged.k_scale,
        dims.rms_norm_eps,
        q_scale=paged.q_scale,
        kv_row_dtype=torch.bfloat16,
    )
