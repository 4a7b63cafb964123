"""The K3 grid: which cells a config gets, per op and tier, and that every judged output has a tolerance with a
reason. Cells are only constructed here (no tensors), so the real-shape H200 grid is checked on the CPU."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest

from harness.config.loader import load_config
from harness.numerics.compare import ToleranceError, ToleranceTable
from suites.k3.suite import K3Suite, covering, shares

CPU_SUITE = K3Suite("k3-hopper", "k3-mini")
H200_SUITE = K3Suite("k3-hopper", "k3")


def _cells(suite: K3Suite, config: str, tier: str | None = None, seed: int = 1):
    cfg = load_config(config)
    if tier:
        cfg = dataclasses.replace(cfg, tier=tier)
    return suite.cells(cfg, random.Random(seed)), cfg


def test_covering_shows_every_axis_value_before_spreading():
    combos = [(a, b, c) for a in (1, 2) for b in (1, 2, 4, 8) for c in ("x", "y", "z")]
    picked = covering(combos, 4)
    assert len(picked) == 4
    for axis, values in enumerate(((1, 2), (1, 2, 4, 8), ("x", "y", "z"))):
        assert {p[axis] for p in picked} == set(values)
    assert covering(combos, 100) == combos
    assert picked == covering(combos, 4)  # deterministic


def test_shares_fill_the_cap_without_exceeding_any_op():
    assert shares([3, 3, 6, 21, 48], 30) == [3, 3, 6, 9, 9]
    assert sum(shares([1, 2, 100], 64)) == 64
    assert shares([5, 5], 100) == [5, 5]


def test_cpu_smoke_covers_every_op_site_context_and_split_policy():
    cells, cfg = _cells(CPU_SUITE, "cpu-smoke")
    per_op = Counter(c.spec.op for c in cells)
    assert set(per_op) == set(CPU_SUITE.grid["ops"])
    grid = sum(per_op.values()) - len(per_op) * CPU_SUITE.grid["random_cells"]["smoke"]
    assert grid <= cfg.data["tiers"]["smoke"]["max_cells"]
    assert {c.axes["site"] for c in cells if c.spec.op == "attn_res"} == set(CPU_SUITE.grid["ops"]["attn_res"]["sites"])
    mla_cells = [c for c in cells if c.spec.op == "mla_decode"]
    wl = cfg.data["workload"]
    assert {1, *wl["contexts"], wl["max_context"]} <= {c.axes["context"] for c in mla_cells}
    assert {c.axes["splits"] for c in mla_cells} == {"auto", "max"}
    assert {c.axes["router"] for c in cells if c.spec.op == "moe_route"} == {"synthetic", "ties"}
    grid_batches = set(CPU_SUITE.grid["axes"]["batches"])
    for op in per_op:  # robust-kbench: shapes off the published grid
        assert any(c.axes["batch"] not in grid_batches for c in cells if c.spec.op == op), op


def test_h200_standard_tier_has_every_prepared_batch_for_every_op_at_tp8_and_tp16():
    cells, cfg = _cells(H200_SUITE, "h200", "standard")
    batches = set(cfg.data["workload"]["batches"])
    for op in H200_SUITE.grid["ops"]:
        mine = [c for c in cells if c.spec.op == op]
        assert batches <= {c.axes["batch"] for c in mine}, op
        if "tp" in H200_SUITE.grid["ops"][op]["axes"]:
            assert {c.axes["tp"] for c in mine} == {8, 16}, op
    mla_cells = [c for c in cells if c.spec.op == "mla_decode"]
    limit = H200_SUITE.grid["ops"]["mla_decode"]["max_cached_tokens"]
    assert all(c.batch * c.context <= limit for c in mla_cells)
    assert {1, 255, 4096, 65537, 131072} <= {c.context for c in mla_cells}
    assert any(c.context % 64 and c.context > 64 for c in mla_cells)  # a partial last page at long context


@pytest.mark.parametrize(("suite", "config"), [(CPU_SUITE, "cpu-smoke"), (H200_SUITE, "h200")])
def test_every_judged_output_has_a_tolerance_with_a_reason(suite, config):
    table = ToleranceTable.load()
    cells, _ = _cells(suite, config, "standard")
    seen = set()
    for c in cells:
        for name in (*c.spec.outputs, *c.spec.inplace):
            key = (c.spec.tolerance_of(name), c.spec.dtype_of(name))
            if key in seen:
                continue
            seen.add(key)
            tol = table.get(*key)  # raises when missing
            assert len(tol.reason) >= 60 and "DRAFT" not in tol.reason, key


def test_an_exact_entry_refuses_numeric_bounds():
    table = ToleranceTable({"x": {"int32": {"exact": True, "atol": 1.0, "reason": "r"}}}, "test")
    with pytest.raises(ToleranceError, match=r"\[x\.int32\] in test is exact; drop atol"):
        table.get("x", "int32")


def test_margins_tool_reports_the_use_of_each_tolerance(capsys):
    from suites import margins

    assert (
        margins.main(["--config", "cpu-smoke", "--ops", "moe_latent_down,attn_res", "--seeds", "1", "--per-op", "2"])
        == 0
    )
    out = capsys.readouterr().out
    assert "moe_latent_down  latent   use" in out and "attn_res         out      use" in out
