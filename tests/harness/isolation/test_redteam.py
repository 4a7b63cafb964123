"""Every isolation red-team case must fail the stage for its own reason, and its repaired twin must pass."""

from __future__ import annotations

import pytest

from harness import redteam
from harness.cli import main
from harness.isolation import redteam as cases_module
from harness.isolation import scratch
from harness.isolation.scope import for_subject
from harness.stages.isolation import records_for
from harness.verdicts import Verdict, derive_verdict

# Case -> the one check that must fail.
EXPECTED = {
    "shared-sampler": "path vllm/v1/sample/sampler.py",
    "monkeypatch-functional": "hygiene monkeypatch at vllm/models/kimi_k3/nvidia/model.py:6",
    "except-fallback": "hygiene broad-except-fallback at vllm/models/kimi_k3/nvidia/model.py:12",
    "env-numerics-switch": "hygiene env-switch at vllm/models/kimi_k3/nvidia/model.py:10",
    "kernel-loosens-tolerance": "co-change rule: a decode-path change may not edit its judge: suites/tolerances.toml",
}


def test_every_case_is_registered():
    assert sorted(c.name for c in redteam.cases("isolation")) == sorted(EXPECTED)


@pytest.mark.parametrize("case", cases_module.CASES, ids=lambda c: c.name)
def test_case_fails_for_its_own_reason(case, tmp_path):
    records = case.run(tmp_path)
    assert derive_verdict(records.to_json()).verdict is Verdict.FAILED
    assert [c.name for c in records.checks if not c.passed] == [EXPECTED[case.name]]


def test_the_base_of_each_case_is_clean(tmp_path):
    """The unbroken model file passes every hygiene rule, so only the broken line can fail a case."""
    repo = tmp_path / "r"
    base, head = scratch.two_commits(repo, {"README.md": "r\n"}, {cases_module.MODEL: cases_module._MODEL_BASE})
    records = records_for("isolation", repo, base, head, for_subject("vllm-k3"))
    assert derive_verdict(records.to_json()).verdict is Verdict.PASSED


def test_command_exits_zero_when_all_are_caught(capsys):
    assert main(["redteam", "--stage", "isolation"]) == 0
    assert "all 5 red-team cases were caught by the isolation stage" in capsys.readouterr().err
