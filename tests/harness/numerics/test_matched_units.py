"""Matched fractions counted over units the case defines (`matched_unit` in a tolerance entry), not elements: the
unit name comes from the table and its size from the case, so the harness knows no model; one unit may be off by
the entry's allowance, a second may not, errors scattered over many units fail, and max_abs binds every element."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from harness.numerics import redteam_kernels as rt
from harness.numerics.compare import Tolerance, ToleranceError, ToleranceTable, compare
from harness.numerics.hygiene import run_cell
from harness.verdicts import Check
from tests.harness.numerics.toy_op import TABLE, ToyCase, correct, reference

CPU = torch.device("cpu")
FORBIDDEN = (reference.__code__,)
GROUP = 4  # elements per unit in the compare tests
PER_GROUP = Tolerance(1e-2, 0.0, 0.99, 0.5, 1.0, "groups move together", matched_unit="group", unmatched_units=1)
PER_ELEMENT = Tolerance(1e-2, 0.0, 0.99, 0.5, 1.0, "elements")


def failed(checks: list[Check]) -> list[str]:
    return [c.name for c in checks if not c.passed]


def fraction(checks: list[Check]) -> Check:
    return next(c for c in checks if c.name == "x: matched fraction")


def _off(ref: torch.Tensor, flat: list[int], by: float = 0.1) -> torch.Tensor:
    out = ref.clone().flatten()
    out[flat] += by
    return out.view_as(ref)


def test_one_unit_off_passes_and_a_second_fails_however_few_units():
    ref = torch.ones(2, 8 * GROUP)  # 16 units: 1% of them is no unit at all, the allowance is one
    checks, metrics = compare("x", _off(ref, list(range(GROUP, 2 * GROUP))), ref, PER_GROUP, GROUP)
    assert not failed(checks)
    assert (metrics["units"], metrics["matched_units"]) == (16, 15)
    assert metrics["matched_fraction"] == 60 / 64  # by elements it would fail 0.99
    assert (fraction(checks).value, fraction(checks).limit) == (15 / 16, 15 / 16)  # min(0.99, 1 - 1/16)
    assert "15 of 16 groups" in fraction(checks).detail
    two = _off(ref, [0, 5 * GROUP + 1])  # one element in each of two units
    assert failed(compare("x", two, ref, PER_GROUP, GROUP)[0]) == ["x: matched fraction"]


def test_errors_scattered_over_many_units_fail_where_the_element_count_passes():
    ref = torch.ones(8, 200 * GROUP)  # 1600 units, 6400 elements
    scattered = _off(ref, [u * GROUP + u % GROUP for u in range(40)])  # 40 elements (0.6%) in 40 units (2.5%)
    assert not failed(compare("x", scattered, ref, PER_ELEMENT)[0])
    assert failed(compare("x", scattered, ref, PER_GROUP, GROUP)[0]) == ["x: matched fraction"]
    whole = _off(ref, list(range(16 * GROUP)))  # 16 whole units: 1% of 1600, the same 64 elements as 1% ...
    assert not failed(compare("x", whole, ref, PER_GROUP, GROUP)[0])
    assert "x: matched fraction" in failed(compare("x", _off(ref, list(range(17 * GROUP))), ref, PER_GROUP, GROUP)[0])


def test_max_abs_binds_the_unit_the_allowance_lets_off():
    ref = torch.ones(2, 8 * GROUP)
    assert failed(compare("x", _off(ref, [3], by=0.6), ref, PER_GROUP, GROUP)[0]) == ["x: max abs error"]


@pytest.mark.parametrize("size", [None, 3, 0])
def test_a_unit_the_case_does_not_define_or_that_does_not_tile_fails(size):
    ref = torch.ones(2, 8 * GROUP)
    check = fraction(compare("x", ref.clone(), ref, PER_GROUP, size)[0])
    assert not check.passed and check.value is None
    assert "group" in check.detail


def test_entries_counting_elements_are_unchanged_and_ignore_a_unit_size():
    ref = torch.ones(100)
    one_off = _off(ref, [7])
    assert fraction(compare("x", one_off, ref, PER_ELEMENT, GROUP)[0]).value == 0.99
    assert "x: matched fraction" in failed(compare("x", _off(ref, [7, 8]), ref, PER_ELEMENT)[0])
    nan = torch.full((3,), float("nan"))
    for tol in (PER_ELEMENT, PER_GROUP):  # a reference with no finite element proves nothing, in units or not
        check = fraction(compare("x", nan.clone(), nan, tol, 1)[0])
        assert check.value == 0.0 and not check.passed


def test_units_whose_reference_is_all_nan_are_not_counted():
    ref = torch.ones(4 * GROUP)
    ref[:GROUP] = float("nan")  # a defined NaN unit, judged by the NaN/Inf check
    checks, metrics = compare("x", ref.clone(), ref, PER_GROUP, GROUP)
    assert not failed(checks) and metrics["units"] == 3


def _entry(**extra) -> ToleranceTable:
    base = {"atol": 1e-2, "rtol": 0.0, "matched_fraction": 0.99, "max_abs": 0.5, "nontrivial_margin": 1.0}
    return ToleranceTable({"op": {"float32": {**base, "reason": "r", **extra}}}, "test")


def test_the_table_loads_units_and_refuses_a_bad_allowance():
    tol = _entry(matched_unit="head", unmatched_units=2).get("op", "float32")
    assert (tol.matched_unit, tol.unmatched_units) == ("head", 2)
    assert _entry().get("op", "float32").matched_unit == "element"
    for bad in (-1, 1.5, True):
        with pytest.raises(ToleranceError, match="unmatched_units"):
            _entry(unmatched_units=bad).get("op", "float32")
    exact = ToleranceTable({"x": {"int32": {"exact": True, "reason": "r", "matched_unit": "head"}}}, "t")
    with pytest.raises(ToleranceError, match="is exact; drop matched_unit"):
        exact.get("x", "int32")


# --- through the runner: the case declares the unit's size ---------------------------------------------------------

UNIT = 16  # a toy "group" of the toy op's output rows (64 wide): 4 per request


@dataclass
class GroupedToyCase(ToyCase):
    def unit_size(self, name: str, unit: str) -> int | None:
        return UNIT if (name, unit) == ("y", "group") else None


def _table(case_entry: dict) -> ToleranceTable:
    """The toy op's own table (toy_op.TABLE) with its output entry replaced, its state entry kept."""
    return ToleranceTable({"toy": {**TABLE.entries["toy"], "bfloat16": case_entry}}, "test")


GROUPED = _table(
    {
        "atol": 1e-2,
        "rtol": 1e-2,
        "matched_unit": "group",
        "matched_fraction": 0.99,
        "unmatched_units": 1,
        "max_abs": 0.5,
        "nontrivial_margin": 10.0,
        "reason": "a group moves as one",
    }
)


def _shifted(groups: list[tuple[int, int]]):
    def run(call):
        out = correct(call)
        y = out["y"].float()
        for row, g in groups:
            y[row, g * UNIT : (g + 1) * UNIT] += 0.2
        return {"y": y.to(torch.bfloat16)}

    return run


def test_the_runner_asks_the_case_for_the_unit_size():
    assert run_cell(GroupedToyCase(4), correct, CPU, GROUPED, FORBIDDEN).passed
    one = run_cell(GroupedToyCase(4), _shifted([(0, 1)]), CPU, GROUPED, FORBIDDEN)
    assert one.passed, [c.name for c in one.checks if not c.passed]
    two = run_cell(GroupedToyCase(4), _shifted([(0, 1), (2, 3)]), CPU, GROUPED, FORBIDDEN)
    assert "y: matched fraction" in [c.name for c in two.checks if not c.passed]


def test_a_case_without_the_unit_fails_rather_than_being_judged_by_elements():
    result = run_cell(ToyCase(4), correct, CPU, GROUPED, FORBIDDEN)
    names = [c.name for c in result.checks if not c.passed]
    assert "y: matched fraction" in names and "fresh values in reused buffers: y: matched fraction" in names


def test_stale_values_in_reused_buffers_still_fail_per_group():
    result = run_cell(GroupedToyCase(4), rt.caches_by_address(correct), CPU, GROUPED, FORBIDDEN)
    names = [c.name for c in result.checks if not c.passed]
    assert "fresh values in reused buffers: y: matched fraction" in names
