"""The numerics stage's TP cells (suites/k3/tp.py) on the CPU: two gloo ranks at k3-mini dims pass every check;
results that show a wrong bit, a diverging rank or a failed oracle become failing checks; a TP size without its
GPUs is NOT_RUN with the count it needs."""

from __future__ import annotations

import json

import pytest

from suites.k3.tp import TpNumerics, checks_for

pytestmark = pytest.mark.slow


def test_tp2_on_cpu_ranks_passes_every_check() -> None:
    checks, not_run, metrics = TpNumerics("k3-mini", (2,), (1, 3), "cpu").run()
    assert not_run == []
    assert checks and all(c.passed for c in checks), [c for c in checks if not c.passed]
    names = {c.name for c in checks}
    assert "TP2 rank 1: all-reduce cells with the oracle's bits" in names
    assert "TP2 rank 0 stack ordered replication" in names and "TP2 rank 1 stack ordered oracle" in names
    assert metrics["tp2"]["all_reduce_cells"] == 2 * 2  # two batches x two widths, transport ordered


def test_failures_reported_by_ranks_fail_their_checks() -> None:
    bits = [{"ordered B1 width 64": "ok"}, {"ordered B1 width 64": "rank 1: 3 values differ; first at row 0"}]
    stacks = [
        {"ordered": {"oracle": [], "replication": ["layer 4 mlp_output: ranks disagree"], "audit": []}},
        {"ordered": {"oracle": ["layer 5 attn_output: rms_rel 0.1"], "replication": [], "audit": []}},
    ]
    failed = {c.name: c.detail for c in checks_for(2, bits, stacks) if not c.passed}
    assert failed == {
        "TP2 rank 1: all-reduce cells with the oracle's bits": (
            "ordered B1 width 64: rank 1: 3 values differ; first at row 0"
        ),
        "TP2 rank 0 stack ordered replication": "layer 4 mlp_output: ranks disagree",
        "TP2 rank 1 stack ordered oracle": "layer 5 attn_output: rms_rel 0.1",
    }


def test_a_tp_size_without_its_gpus_is_not_run(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    checks, not_run, _ = TpNumerics("k3", (8,), (1,), "cuda").run()
    assert checks == [] and not_run == ["TP8 needs 8 GPUs on one host, this host has 2"]


def test_the_subject_gives_tp_cells_only_to_distributed_configs() -> None:
    from harness.config.loader import load_config
    from harness.subjects import load_subject

    subject = load_subject("k3-hopper")
    assert subject.distributed_numerics(load_config("cpu-smoke")) is None
    assert subject.distributed_numerics(load_config("h200")) is None  # one rank's shard on one GPU
    cells = subject.distributed_numerics(load_config("tp8-h200"))
    assert cells is not None and cells.tps == (8,) and cells.kind == "cuda"
    assert cells.batches == (1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64)


def test_the_cpu_tp2_config_runs_the_tp_cells_in_the_numerics_stage(tmp_path) -> None:
    from harness.cli import main

    out = tmp_path / "run"
    assert main(["run", "--config", "cpu-tp2", "--stages", "numerics", "--out", str(out)]) == 0
    records = json.loads((out / "stages" / "numerics" / "records.json").read_text())
    tp = [c for c in records["checks"] if c["name"].startswith("TP2 ")]
    assert records["status"] == "ran" and records["metrics"]["tensor_parallel"]["tp2"]["ranks"] == 2
    assert {c["name"] for c in tp} >= {
        "TP2 rank 0: all-reduce cells with the oracle's bits",
        "TP2 rank 1 stack ordered oracle",
        "TP2 rank 1 stack ordered replication",
        "TP2 rank 0 stack ordered audit",
    }
