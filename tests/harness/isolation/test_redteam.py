"""Every isolation red-team case must fail the stage for its own reason, and its repaired twin must pass.

The runtime cases live with their subject (k3_decode/isolation_redteam.py); their control (the honest provider,
which passes) is in tests/k3_decode/runtime/test_isolation_suite.py."""

from __future__ import annotations

import pytest

from harness import redteam
from harness.cli import main
from harness.isolation import redteam as cases_module
from harness.isolation import scratch
from harness.isolation.scope import for_subject
from harness.stages.isolation import records_for
from harness.verdicts import Verdict, derive_verdict
from k3_decode import isolation_redteam as runtime_cases

# Case -> the checks that must fail, and nothing else.
SPECIALIZED = "runtime: tp1 latency_specialized"
EXPECTED = {
    "shared-sampler": ["path vllm/v1/sample/sampler.py"],
    "monkeypatch-functional": ["hygiene monkeypatch at vllm/models/kimi_k3/nvidia/model.py:6"],
    "except-fallback": ["hygiene broad-except-fallback at vllm/models/kimi_k3/nvidia/model.py:12"],
    "env-numerics-switch": ["hygiene env-switch at vllm/models/kimi_k3/nvidia/model.py:10"],
    "kernel-loosens-tolerance": ["co-change rule: a decode-path change may not edit its judge: suites/tolerances.toml"],
    # Each decode step's provider writes the slot after its last one: request 2's (slot 3), then request 4's (5).
    # On the speculative stack (q = 4 slots per request) each verify step does the same: after requests 0 and 1's
    # slots 1-8 comes request 2's first slot (9); after request 3's (13-16), request 4's (17).
    "kda-writes-other-request": [
        f"{SPECIALIZED} decode step 1: layers.4.kda.conv[3:4, 0:768, 0:3] (and 5 more) changed outside the declared "
        "write set",
        f"{SPECIALIZED} decode-single step 2: layers.4.kda.conv[5:6, 0:768, 0:3] (and 5 more) changed outside the "
        "declared write set",
        *(
            f"{SPECIALIZED} q4 {cell} step {step}: layers.4.kda.conv[{slot}:{slot + 1}, 0:768, 0:6] (and 5 more) "
            "changed outside the declared write set"
            for cell, step, slot in (
                ("verify-first", 1, 9),
                ("verify-accepted", 2, 9),
                ("verify-single", 3, 17),
                ("verify-again", 4, 17),
            )
        ),
    ],
    "stock-claimed-specialized": [
        f"{SPECIALIZED}: stock code ran inside specialized provider calls, first at step 1 layer 4 kda",
        f"{SPECIALIZED} q4: stock code ran inside specialized provider calls, first at step 1 layer 4 kda",
    ],
}


def test_every_case_is_registered():
    assert sorted(c.name for c in redteam.cases("isolation")) == sorted(EXPECTED)


@pytest.mark.parametrize("case", cases_module.CASES + runtime_cases.CASES, ids=lambda c: c.name)
def test_case_fails_for_its_own_reason(case, tmp_path):
    records = case.run(tmp_path)
    assert derive_verdict(records.to_json()).verdict is Verdict.FAILED
    assert [c.name for c in records.checks if not c.passed] == EXPECTED[case.name]


def test_the_runtime_cases_name_the_tensor_and_the_stock_code(tmp_path):
    """The failed checks' details say what a reviewer needs: every tensor and slot written, every stock function."""
    wrote = runtime_cases.run_variant("writes-neighbour")
    detail = next(c.detail for c in wrote.checks if not c.passed)
    for layer in (4, 5, 6):
        for tensor in ("conv", "recurrent"):
            assert f"layers.{layer}.kda.{tensor}[3:4," in detail
    stock = runtime_cases.run_variant("stock-inside")
    detail = next(c.detail for c in stock.checks if not c.passed)
    assert (
        "specialized provider redteam-kda-stock-inside ran stock code (k3_decode.stock/kda.py:kda_decode_step" in detail
    )


def test_the_base_of_each_case_is_clean(tmp_path):
    """The unbroken model file passes every hygiene rule, so only the broken line can fail a case."""
    repo = tmp_path / "r"
    base, head = scratch.two_commits(repo, {"README.md": "r\n"}, {cases_module.MODEL: cases_module._MODEL_BASE})
    records = records_for("isolation", repo, base, head, for_subject("vllm-k3"))
    assert derive_verdict(records.to_json()).verdict is Verdict.PASSED


def test_command_exits_zero_when_all_are_caught(capsys):
    assert main(["redteam", "--stage", "isolation"]) == 0
    assert "all 7 red-team cases were caught by the isolation stage" in capsys.readouterr().err
