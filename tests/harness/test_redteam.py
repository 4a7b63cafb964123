from __future__ import annotations

import sys
import types

import pytest

from harness import redteam
from harness.cli import main
from harness.redteam import RedTeamCase
from harness.verdicts import Check, StageRecords


def _case(name: str, value: float) -> RedTeamCase:
    return RedTeamCase(
        "numerics",
        name,
        "test case",
        lambda _tmp: StageRecords("numerics", checks=[Check("max error", value, "<=", 1.0)]),
    )


def _crash(_tmp):
    raise RuntimeError("checker fell over")


@pytest.fixture
def fake_registry(monkeypatch):
    module = types.ModuleType("fake_redteam_cases")
    monkeypatch.setitem(sys.modules, "fake_redteam_cases", module)
    monkeypatch.setattr(redteam, "_registry", lambda: {"numerics": ["fake_redteam_cases"], "isolation": []})
    return module


def test_all_caught_exits_zero(fake_registry, capsys):
    fake_registry.CASES = [_case("zeros", 5.0), _case("stale", 2.0)]
    assert main(["redteam", "--stage", "numerics"]) == 0
    assert "all 2 red-team cases were caught" in capsys.readouterr().err


def test_a_missed_case_fails(fake_registry, capsys):
    fake_registry.CASES = [_case("zeros", 5.0), _case("cheat that passes", 0.1)]
    assert main(["redteam", "--stage", "numerics"]) == 1
    assert "MISSED cheat that passes" in capsys.readouterr().err


def test_a_crashing_check_is_not_a_catch(fake_registry):
    fake_registry.CASES = [RedTeamCase("numerics", "crash", "x", _crash)]
    assert redteam.run_case(fake_registry.CASES[0]).caught is False
    assert main(["redteam", "--stage", "numerics"]) == 1


def test_no_cases_proves_nothing(fake_registry):
    assert main(["redteam", "--stage", "isolation"]) == 3


def test_a_case_that_cannot_run_here_makes_the_red_team_incomplete(fake_registry, capsys):
    fake_registry.CASES = [
        _case("zeros", 5.0),
        RedTeamCase("numerics", "gpu only", "x", _crash, requires=lambda: "needs a CUDA GPU"),
    ]
    assert main(["redteam", "--stage", "numerics"]) == 3
    assert "could not run on this machine" in capsys.readouterr().err
