"""The perf red team: every lie fails exactly the checks it must, the truth passes, and the CLI says so."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.perf import redteam
from harness.redteam import cases, run_case
from harness.verdicts import Verdict, derive_verdict

REPO = Path(__file__).resolve().parents[3]
CASES = {c["name"]: c for c in redteam.data()["cases"]}


def _failed(records) -> list[str]:
    return [c.name for c in records.checks if not c.passed]


def test_the_honest_sweep_passes_every_check(tmp_path):
    """The control: without a lie the same fake sweep passes, so each case's failure is its lie's."""
    records = redteam.judge(tmp_path, redteam.Lie())
    assert _failed(records) == [] and len(records.checks) == 24
    assert derive_verdict(json.loads(json.dumps(records.to_json()))).verdict is Verdict.PASSED
    for cell in records.metrics["cells"]:
        assert cell["interval_narrow"] and cell["itl_ratio"]["high"] <= 1.02


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_case_fails_exactly_its_checks(tmp_path, name):
    case = CASES[name]
    failed = _failed(redteam.judge(tmp_path, redteam.lie(case["candidate"])))
    assert failed, f"{name} was not caught"
    for check in failed:
        assert any(part in check for part in case["fails"]), f"{name} also failed {check!r}"
    for part in case["fails"]:
        assert any(part in check for check in failed), f"{name} did not fail {part!r}"
    assert all("b1/" in c or "b8/" in c for c in failed)  # both cells of the sweep are judged


def test_the_wide_interval_case_passes_by_its_point_estimate_and_fails_by_its_bound(tmp_path):
    records = redteam.judge(tmp_path, redteam.lie(CASES["wide-interval"]["candidate"]))
    for cell in records.metrics["cells"]:
        ratio = cell["itl_ratio"]
        assert ratio["ratio"] <= 1.02 < ratio["high"] and not cell["interval_narrow"]


def test_the_beyond_roofline_case_is_faster_not_slower(tmp_path):
    """It fails as a measurement error while its ratio would have looked like a 5x speedup."""
    records = redteam.judge(tmp_path, redteam.lie(CASES["beyond-roofline"]["candidate"]))
    assert all(cell["itl_ratio"]["high"] < 0.25 for cell in records.metrics["cells"])


def test_a_gate_that_does_not_judge_the_numbers_misses_the_budget_case(monkeypatch):
    """The red team catches a blind gate: with the numbers recorded instead of judged (as on the CPU), the slower
    candidate passes, and the red team reports it as missed."""
    monkeypatch.setattr(redteam, "INFO", dataclasses.replace(redteam.INFO, numbers_meaningful=False))
    slower = next(c for c in cases("perf") if c.name == "slower-than-budget")
    result = run_case(slower)
    assert result.verdict is Verdict.PASSED and not result.caught


def test_an_unknown_lie_is_a_one_line_error():
    with pytest.raises(ValueError, match=r"unknown candidate field 'faster' — use one of") as info:
        redteam.lie({"faster": True})
    assert "\n" not in str(info.value)


def test_the_cli_catches_every_case(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "harness", "redteam", "--stage", "perf", "--json"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"XDG_CONFIG_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(proc.stdout)
    assert {r["case"] for r in results} == set(CASES) and all(r["caught"] for r in results)
    assert f"all {len(CASES)} red-team cases were caught" in proc.stderr
