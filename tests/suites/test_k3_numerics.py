from __future__ import annotations

import json
import random

import torch

from harness.bundle.verify import verify
from harness.cli import main
from harness.config.loader import load_config
from suites.k3.suite import K3Suite


def test_cpu_smoke_numerics_passes_on_the_stock_path(tmp_path, capsys):
    assert main(["run", "--config", "cpu-smoke", "--stages", "numerics", "--out", str(tmp_path / "b"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    numerics = next(v for v in summary["verdicts"] if v["stage"] == "numerics")
    assert numerics["verdict"] == "PASSED"
    records = json.loads((tmp_path / "b" / "stages" / "numerics" / "records.json").read_text())
    assert records["metrics"]["implementations"] == {"stock": "torch-cpu"}
    assert records["metrics"]["cells"] >= 10 and records["metrics"]["cells_failed"] == 0
    assert {"stock kda_decode", "stock kda_verify"} <= set(records["metrics"]["pass_map"])
    assert {"stock attn_res", "stock mla_decode", "stock moe_route", "stock moe", "stock dense_mlp"} <= set(
        records["metrics"]["pass_map"]
    )
    assert verify(tmp_path / "b").ok


def test_cells_follow_the_config_and_include_off_grid_shapes():
    suite = K3Suite("k3-hopper", "k3-mini")
    cells = suite.cells(load_config("cpu-smoke"), random.Random(1))
    grid = set(suite.grid["axes"]["batches"])
    assert {c.axes["tp"] for c in cells if "tp" in c.axes} == {1, 2}
    assert any(c.axes["batch"] not in grid for c in cells)  # robust-kbench: hard-coded shapes fail here
    assert all(c.axes["q"] > 1 for c in cells if c.spec.op == "kda_verify")


def test_numerics_red_team_is_caught(capsys):
    code = main(["redteam", "--stage", "numerics", "--json"])
    results = {r["case"]: r for r in json.loads(capsys.readouterr().out)}
    for name, r in results.items():
        if name == "side-stream" and not torch.cuda.is_available():
            assert r["verdict"] == "NOT_RUN"
        else:
            assert r["caught"], (name, r)
    assert code == (0 if torch.cuda.is_available() else 3)
