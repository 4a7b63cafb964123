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
    # What the matched fraction counts. "element" (the default) counts elements; any other name is a unit the
    # case defines for the output (Case.unit_size: so many consecutive elements of the last dimension), matched
    # only when every element in it is. An op whose rounding moves whole groups at once (one attention head's v
    # row) declares that group, so one such shift counts once, however few elements the cell has.
    matched_unit: str = "element"
    # Units that may be off whatever the fraction says (each still within max_abs): a cell of few units could
    # otherwise not absorb a single one.
    unmatched_units: int = 0

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
        unmatched = entry.get("unmatched_units", 0)
        if not isinstance(unmatched, int) or isinstance(unmatched, bool) or unmatched < 0:
            raise ToleranceError(f"[{op}.{dtype}] in {self.source}: unmatched_units must be an integer >= 0")
        return Tolerance(**entry)


@cache
def _table(package: str, name: str) -> dict[str, Any]:
    return tomllib.loads(resources.files(package).joinpath(name).read_text())


def compare(
    name: str, actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance, unit_size: int | None = None
) -> tuple[list[Check], dict]:
    """Checks that `actual` matches `expected` (computed in fp32 or wider) under `tol`.

    unit_size: elements per unit of `tol.matched_unit` (consecutive along the last dimension), from the case;
    ignored where the entry counts elements. None for an entry that counts another unit (the case defines no such
    unit for this output) fails the matched fraction rather than judging elements against a bound written for units.
    """
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
    fraction, units = _matched_units(name, ok, ref_finite, tol, unit_size)
    checks += [
        Check(f"{name}: non-finite values where the reference is finite", nonfinite, "==", 0),
        Check(f"{name}: NaN/Inf where the reference has them", same_special, "==", True),
        fraction,
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
    metrics = {"max_abs_error": max_err, "matched_fraction": matched, "ref_peak": ref_peak, "elements": n, **units}
    return checks, metrics


def _matched_units(
    name: str, ok: torch.Tensor, ref_finite: torch.Tensor, tol: Tolerance, unit_size: int | None
) -> tuple[Check, dict[str, Any]]:
    """The matched-fraction check over `tol.matched_unit`, and the unit counts for the metrics.

    At least `matched_fraction` of the units must match, except that `unmatched_units` of them may always be off:
    the bound is min(matched_fraction, 1 - unmatched_units / units). For elements with no such allowance this is
    the plain element fraction.
    """
    unit = tol.matched_unit
    unit_size = 1 if unit == "element" else unit_size
    check_name = f"{name}: matched fraction"
    if unit_size is None or unit_size < 1 or (unit_size > 1 and (ok.dim() == 0 or ok.shape[-1] % unit_size)):
        why = "defines no size" if unit_size is None or unit_size < 1 else f"'s {unit} of {unit_size} does not tile"
        detail = f"the tolerance counts matches per {unit}; the case {why} for this output (shape {list(ok.shape)})"
        return Check(check_name, None, ">=", tol.matched_fraction, detail), {}
    # Elements whose reference is NaN/Inf are judged by the NaN/Inf check; a unit holding only such elements is
    # not counted at all, as such elements are not in the element fraction.
    good = (ok | ~ref_finite).reshape(-1, unit_size).all(dim=-1)
    counted = ref_finite.reshape(-1, unit_size).any(dim=-1)
    total, matched = int(counted.sum()), int((good & counted).sum())
    # A reference with no finite element at all proves nothing: it fails, as before units existed.
    fraction = matched / total if total else (0.0 if ok.numel() else 1.0)
    limit = tol.matched_fraction
    if tol.unmatched_units and total:
        # Rounded as the value is, so `matched == total - unmatched_units` passes exactly.
        limit = min(limit, round(1 - tol.unmatched_units / total, 6))
    detail = ""
    metrics: dict[str, Any] = {}
    if unit != "element" or tol.unmatched_units:
        detail = (
            f"{matched} of {total} {unit}s match ({unit_size} elements each); allowed off: "
            f"max({tol.unmatched_units}, {1 - tol.matched_fraction:.3g} x {total}) {unit}s"
        )
        metrics = {"matched_unit": unit, "units": total, "matched_units": matched}
    return Check(check_name, round(fraction, 6), ">=", limit, detail), metrics
