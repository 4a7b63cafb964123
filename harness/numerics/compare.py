"""Comparing an implementation's output with its oracle under a tolerance entry."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

import torch

from harness.verdicts import Check


@dataclass(frozen=True)
class Tolerance:
    """One entry of the tolerance table (suites/tolerances.toml); `reason` says why the numbers are what they are."""

    atol: float
    rtol: float
    matched_fraction: float  # share of elements that must be within atol + rtol*|ref|
    max_abs: float  # no element may be further off than this, matched or not
    nontrivial_margin: float  # the reference must reach margin * atol somewhere: zeros cannot pass
    reason: str
    exact: bool = False  # every element bit-equal to the reference (ids, state copied unchanged)

    @classmethod
    def exact_match(cls, reason: str) -> Tolerance:
        return cls(0.0, 0.0, 1.0, 0.0, 0.0, reason, exact=True)


class ToleranceError(KeyError):
    pass


@dataclass(frozen=True)
class ToleranceTable:
    """The versioned tolerance table: `[op.dtype]` entries (see suites/tolerances.toml)."""

    entries: dict[str, Any]
    source: str

    @classmethod
    def load(cls, package: str = "suites", name: str = "tolerances.toml") -> ToleranceTable:
        return cls(_table(package, name), f"{package}/{name}")

    def get(self, op: str, dtype: str) -> Tolerance:
        try:
            node = self.entries
            for part in op.split("."):  # "kda_decode.state" is the TOML table [kda_decode.state.<dtype>]
                node = node[part]
            entry = {k: v for k, v in node[dtype].items() if k in Tolerance.__dataclass_fields__}
        except (KeyError, TypeError):
            raise ToleranceError(f"no tolerance for op {op!r} dtype {dtype!r} in {self.source}") from None
        if entry.get("exact"):
            # An exact entry carries only its reason: numeric bounds beside it would be ignored, so they are refused.
            extra = sorted(set(entry) - {"exact", "reason"})
            if extra:
                raise ToleranceError(f"[{op}.{dtype}] in {self.source} is exact; drop {', '.join(extra)}")
            return Tolerance.exact_match(entry.get("reason", ""))
        return Tolerance(**entry)


@cache
def _table(package: str, name: str) -> dict[str, Any]:
    return tomllib.loads(resources.files(package).joinpath(name).read_text())


def compare(name: str, actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance) -> tuple[list[Check], dict]:
    """Checks that `actual` matches `expected` (computed in fp32 or wider) under `tol`."""
    checks: list[Check] = []
    if actual.shape != expected.shape:
        return [Check(f"{name}: shape", list(actual.shape), "==", list(expected.shape))], {}
    a = actual.detach().to(torch.float64).cpu()
    e = expected.detach().to(torch.float64).cpu()
    ref_finite = torch.isfinite(e)
    nonfinite = int((~torch.isfinite(a) & ref_finite).sum())
    err = (a - e).abs()
    err = torch.where(ref_finite, err, torch.zeros_like(err))
    ok = err <= tol.atol + tol.rtol * e.abs()
    if tol.exact:
        # Bit-equal: +0.0 and -0.0 differ, which a numeric difference of zero would hide.
        ok = ok & (torch.signbit(a) == torch.signbit(e))
    # Where the reference is NaN or Inf (a defined behaviour of the stock path), the output must be the same.
    special = ~ref_finite
    a_s, e_s = a[special], e[special]
    same_special = bool(((torch.isnan(a_s) & torch.isnan(e_s)) | (a_s == e_s)).all())
    n = max(e.numel(), 1)
    matched = float(ok[ref_finite].sum()) / max(int(ref_finite.sum()), 1) if e.numel() else 1.0
    max_err = float(err.max()) if e.numel() else 0.0
    ref_peak = float(e[ref_finite].abs().max()) if bool(ref_finite.any()) else 0.0
    checks += [
        Check(f"{name}: non-finite values where the reference is finite", nonfinite, "==", 0),
        Check(f"{name}: NaN/Inf where the reference has them", same_special, "==", True),
        Check(f"{name}: matched fraction", round(matched, 6), ">=", tol.matched_fraction),
        Check(f"{name}: max abs error", max_err, "<=", tol.max_abs),
    ]
    if tol.atol == 0:
        # Exact or purely relative: no absolute slack to hide behind, but a reference that is zero everywhere
        # would still prove nothing.
        checks.append(Check(f"{name}: reference is non-trivial (peak)", ref_peak, ">", 0.0))
    else:
        checks.append(
            Check(f"{name}: reference is non-trivial (peak / atol)", ref_peak / tol.atol, ">=", tol.nontrivial_margin)
        )
    metrics = {"max_abs_error": max_err, "matched_fraction": matched, "ref_peak": ref_peak, "elements": n}
    return checks, metrics
