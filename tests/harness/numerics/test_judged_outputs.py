"""Generic numerics machinery added for ops whose outputs differ in kind: per-output dtype and tolerance entries,
exact entries, purely relative entries, FP8 guard bands, and the red-team wrappers that alter inputs or outputs."""

from __future__ import annotations

import pytest
import torch

from harness.numerics import redteam_kernels as rt
from harness.numerics.cells import Judged, OpCall, OpSpec
from harness.numerics.compare import Tolerance, ToleranceTable, compare
from harness.numerics.hygiene import GUARD, guarded, run_cell
from harness.verdicts import Check

EXACT = Tolerance.exact_match("ids are integers")
RELATIVE = Tolerance(0.0, 0.125, 1.0, 2.0, 10.0, "one E4M3 step")


def failed(checks: list[Check]) -> list[str]:
    return [c.name for c in checks if not c.passed]


def test_exact_entries_catch_one_ulp_and_a_signed_zero():
    ref = torch.tensor([1.0, 2.0, 0.0, 3.0])
    assert not failed(compare("x", ref.clone(), ref, EXACT)[0])
    ulp = ref.clone()
    ulp[1] = torch.nextafter(ulp[1], torch.tensor(3.0))
    assert "x: matched fraction" in failed(compare("x", ulp, ref, EXACT)[0])
    signed = ref.clone()
    signed[2] = -0.0
    assert "x: matched fraction" in failed(compare("x", signed, ref, EXACT)[0])
    assert "x: reference is non-trivial (peak)" in failed(compare("x", torch.zeros(4), torch.zeros(4), EXACT)[0])


def test_purely_relative_entries_need_no_division_by_atol():
    ref = torch.tensor([1.0, 8.0, 0.5])
    ok, _ = compare("c", ref * 1.1, ref, RELATIVE)
    assert not failed(ok)
    assert "c: matched fraction" in failed(compare("c", ref * 1.3, ref, RELATIVE)[0])
    assert "c: reference is non-trivial (peak)" in failed(compare("c", ref * 0, ref * 0, RELATIVE)[0])


def test_exact_table_entries_load_and_judged_outputs_pick_their_entries():
    table = ToleranceTable(
        {
            "op": {
                "float32": {
                    "atol": 1e-3,
                    "rtol": 0.0,
                    "matched_fraction": 1.0,
                    "max_abs": 1e-3,
                    "nontrivial_margin": 1.0,
                    "reason": "r",
                },
                "ids": {"int32": {"exact": True, "reason": "integers"}},
            }
        },
        "test",
    )
    spec = OpSpec("op", "float32", outputs=("x", "ids"), inplace=("s",), judged=(Judged("ids", "int32", "op.ids"),))
    assert (spec.tolerance_of("x"), spec.dtype_of("x")) == ("op", "float32")
    assert (spec.tolerance_of("ids"), spec.dtype_of("ids")) == ("op.ids", "int32")
    assert spec.tolerance_of("s") == "op.state"
    assert table.get("op.ids", "int32").exact


class _IdsCase:
    """ids of the k largest entries per row (an integer output) next to their values (a float output)."""

    def __init__(self):
        self.id, self.axes = "topk/b3", {"batch": 3}
        self.spec = OpSpec("topk", "float32", outputs=("values", "ids"), judged=(Judged("ids", "int64", "topk.ids"),))

    def make(self, seed, device):
        g = torch.Generator().manual_seed(seed)
        return OpCall({"x": torch.randn(3, 16, generator=g).to(device)})

    def reference(self, call):
        v, i = call.tensors["x"].double().topk(4, dim=-1)
        return {"values": v, "ids": i}

    def allowed_writes(self, call):
        return {}


TOPK_TABLE = ToleranceTable(
    {
        "topk": {
            "float32": {
                "atol": 1e-6,
                "rtol": 0.0,
                "matched_fraction": 1.0,
                "max_abs": 1e-6,
                "nontrivial_margin": 10.0,
                "reason": "copies",
            },
            "ids": {"int64": {"exact": True, "reason": "integers"}},
        }
    },
    "test",
)


def _topk(call):
    v, i = call.tensors["x"].topk(4, dim=-1)
    return {"values": v, "ids": i}


def test_a_cell_with_an_integer_output_passes_and_a_wrong_id_fails():
    cpu = torch.device("cpu")
    assert run_cell(_IdsCase(), _topk, cpu, TOPK_TABLE).passed
    broken = rt.maps_outputs(_topk, lambda call, out: {**out, "ids": out["ids"].flip(-1)})
    names = [c.name for c in run_cell(_IdsCase(), broken, cpu, TOPK_TABLE).checks if not c.passed]
    assert "ids: matched fraction" in names
    wrong_dtype = rt.maps_outputs(_topk, lambda call, out: {**out, "ids": out["ids"].to(torch.int32)})
    names = [c.name for c in run_cell(_IdsCase(), wrong_dtype, cpu, TOPK_TABLE).checks if not c.passed]
    assert "ids: dtype" in names


def test_reads_altered_inputs_restores_the_callers_tensors():
    seen = {}

    def impl(call):
        seen["x"] = call.tensors["x"].clone()
        return {"y": call.tensors["x"] * 2}

    x = torch.arange(4.0)
    call = OpCall({"x": x.clone()})
    out = rt.reads_altered_inputs(impl, lambda c: {"x": torch.zeros(4)})(call)
    assert torch.equal(seen["x"], torch.zeros(4)) and torch.equal(out["y"], torch.zeros(4))
    assert torch.equal(call.tensors["x"], x)


def test_fp8_guard_bands_hold_nan_and_catch_an_overrun():
    t = torch.randn(8, 4).to(torch.float8_e4m3fn)
    view, flat = guarded(t)
    assert torch.equal(view.view(torch.uint8), t.view(torch.uint8))
    assert bool(flat[:GUARD].float().isnan().all())
    from harness.numerics.hygiene import _bands_intact

    assert _bands_intact(flat)
    flat[GUARD + t.numel()] = 1.0  # one element past the end
    assert not _bands_intact(flat)


@pytest.mark.parametrize("bad", [{"atol": 1.0}, {"max_abs": 0.0}])
def test_exact_entries_refuse_numeric_bounds(bad):
    table = ToleranceTable({"x": {"int32": {"exact": True, "reason": "r", **bad}}}, "t")
    with pytest.raises(KeyError, match="is exact; drop"):
        table.get("x", "int32")
