"""The judgement of one change, end to end on small repositories: what passes, what fails and why."""

from __future__ import annotations

from harness.isolation import scratch
from harness.isolation.judge import STATIC_ONLY, judge, to_records
from harness.isolation.scope import for_subject
from harness.verdicts import Verdict, derive_verdict

MODEL = "vllm/models/kimi_k3/nvidia/model.py"


def _verdict(tmp_path, base: dict, head: dict):
    repo = tmp_path / "r"
    base_rev, head_rev = scratch.two_commits(repo, base, head)
    report = judge(repo, base_rev, head_rev, for_subject("vllm-k3"))
    records = to_records(report, "isolation")
    return report, records, derive_verdict(records.to_json())


def test_a_path_outside_every_area_fails(tmp_path):
    other = "vllm/models/deepseek_v41/model.py"
    _, records, verdict = _verdict(tmp_path, {MODEL: "a = 1\n", other: "b = 1\n"}, {MODEL: "a = 2\n", other: "b = 2\n"})
    assert verdict.verdict is Verdict.FAILED
    (failed,) = [c for c in records.checks if not c.passed]
    assert failed.name == f"path {other}" and failed.value == "outside" and "leaves the model's area" in failed.detail


def test_declared_switches_pass_and_stay_on_record(tmp_path):
    head = {MODEL: "from vllm import envs\n\ndef f():\n    return envs.VLLM_KIMI_K3_AUX_ATTN_RES_STREAM\n"}
    report, records, verdict = _verdict(tmp_path, {MODEL: "a = 1\n"}, head)
    assert verdict.verdict is Verdict.PASSED, verdict.reason
    assert records.metrics["declared_findings"] == 1 and report.failing_findings == []
    assert report.to_json()["findings"][0]["accepted"].startswith("K3 only")


def test_undeclared_switch_fails_naming_file_and_line(tmp_path):
    head = {MODEL: "from vllm import envs\n\ndef f():\n    return envs.VLLM_K3_SECRET_FAST\n"}
    _, _, verdict = _verdict(tmp_path, {MODEL: "a = 1\n"}, head)
    assert verdict.verdict is Verdict.FAILED
    assert f"hygiene env-switch at {MODEL}:4 (1 == 0)" in verdict.reason


def test_only_changed_model_python_is_checked(tmp_path):
    patch = "import torch\ntorch.x = 1\n"
    base = {MODEL: "a = 1\n", "vllm/models/kimi_k3/untouched.py": patch, "tests/models/kimi_k3/test_a.py": "a\n"}
    head = {MODEL: "a = 2\n", "tests/models/kimi_k3/test_a.py": patch}
    report, records, verdict = _verdict(tmp_path, base, head)
    assert verdict.verdict is Verdict.PASSED, verdict.reason  # the test file is not model code
    assert report.python_checked == [MODEL]
    assert records.metrics["paths_by_area"] == {"allowed": 1, "model": 1}
    assert records.metrics["runtime_audit"] == STATIC_ONLY


def test_a_deleted_model_file_is_classified_but_not_parsed(tmp_path):
    gone = "vllm/models/kimi_k3/old.py"
    report, _, verdict = _verdict(tmp_path, {gone: "def f(:\n", MODEL: "a\n"}, {gone: None})
    assert verdict.verdict is Verdict.PASSED and report.python_checked == []


def test_many_findings_are_summarized_in_the_detail(tmp_path):
    head = {MODEL: "import os\n" + "".join(f"x{i} = os.environ.get('V{i}')\n" for i in range(30))}
    _, records, _ = _verdict(tmp_path, {MODEL: "a\n"}, head)
    (failed,) = [c for c in records.checks if not c.passed]
    assert failed.value == 30 and failed.detail.endswith("and 10 more (see the evidence)")
