"""The isolation stage inside a run: which repository and base its static half judges, when it cannot judge
anything, and how the runtime half joins the verdict."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.config.loader import load_config
from harness.hardware import Hardware
from harness.isolation import gitdiff, scratch
from harness.stages import isolation as stage_module
from harness.stages import registered
from harness.stages.base import StageContext
from harness.stages.isolation import IsolationStage, RuntimeHalf, combine, runtime_half
from harness.verdicts import Check, StageRecords, Verdict, derive_verdict

MODEL = "vllm/models/kimi_k3/nvidia/model.py"
REPO_ROOT = str(Path(__file__).resolve().parents[3])
NO_SUITE = "not run: subject vllm-k3 has no runtime isolation suite in this build"


@pytest.fixture
def quiet_runtime(monkeypatch):
    """The runtime half as a passing stub, for tests of the static half on k3-hopper configs."""
    half = RuntimeHalf(True, checks=[Check("runtime: stub", 0, "==", 0)], metrics={"not_run": []})
    monkeypatch.setattr(stage_module, "runtime_half", lambda stage, ctx: half)


def _ctx(tmp_path, config: str) -> StageContext:
    return StageContext(load_config(config), Hardware("none", 0), tmp_path / "bundle", lambda *_: None)


def _run(tmp_path, config: str = "tp8-gb300"):
    records = IsolationStage().run(_ctx(tmp_path, config))
    return records, derive_verdict(records.to_json())


@pytest.fixture
def vllm_repo(tmp_path, monkeypatch):
    """A vLLM-like repository on a feature branch whose change is a clean K3 edit."""
    repo = tmp_path / "vllm"
    scratch.two_commits(repo, {MODEL: "x = 1\n", "vllm/v1/sample/sampler.py": "s = 1\n"}, {"README.md": "r\n"})
    scratch.git(repo, "checkout", "-q", "-b", "k3-decode")
    scratch.commit(repo, {MODEL: "x = 2\n", "vllm/models/kimi_k3/nvidia/new.py": "y = 1\n"}, "k3 change")
    monkeypatch.setenv("K3GATE_VLLM_REPO", str(repo))
    monkeypatch.delenv("K3GATE_BASE", raising=False)
    return repo


def test_registered():
    assert any(isinstance(s, IsolationStage) for s in registered())


def test_clean_change_passes_with_evidence_and_honest_metrics(tmp_path, vllm_repo):
    records, verdict = _run(tmp_path)
    assert verdict.verdict is Verdict.PASSED, verdict.reason
    assert records.metrics["base_chosen_by"] == "merge-base of HEAD and main"
    assert records.metrics["paths_by_area"] == {"model": 2}
    assert records.metrics["runtime_audit"].startswith(NO_SUITE)
    assert records.metrics["not_run"][0]["name"] == "runtime half"
    assert records.metrics["uncommitted_paths_not_judged"] == 0
    (rel,) = records.evidence
    judged = json.loads((tmp_path / "bundle" / rel).read_text())
    assert {p["path"]: p["area"] for p in judged["paths"]} == {
        MODEL: "model",
        "vllm/models/kimi_k3/nvidia/new.py": "model",
    }
    assert judged["python_checked"] == sorted([MODEL, "vllm/models/kimi_k3/nvidia/new.py"])


def test_change_to_the_sampler_fails_naming_it(tmp_path, vllm_repo):
    scratch.commit(vllm_repo, {"vllm/v1/sample/sampler.py": "s = 2\n"}, "touch the sampler")
    (vllm_repo / "untracked.py").write_text("u")
    records, verdict = _run(tmp_path)
    assert verdict.verdict is Verdict.FAILED
    assert "path vllm/v1/sample/sampler.py ('review: sampling'" in verdict.reason
    assert records.metrics["uncommitted_paths_not_judged"] == 1


def test_base_from_the_environment(tmp_path, vllm_repo, monkeypatch):
    monkeypatch.setenv("K3GATE_BASE", "HEAD")
    records, verdict = _run(tmp_path)
    assert verdict.verdict is Verdict.PASSED and records.metrics["paths_changed"] == 0
    assert records.metrics["base_chosen_by"] == "K3GATE_BASE=HEAD"
    monkeypatch.setenv("K3GATE_BASE", "no-such-rev")
    records, verdict = _run(tmp_path)
    assert verdict.verdict is Verdict.NOT_RUN and "K3GATE_BASE 'no-such-rev' is not a commit" in verdict.reason


@pytest.mark.parametrize(
    ("setup", "reason"),
    [
        ("unset", "set K3GATE_VLLM_REPO to a git checkout"),
        ("plain folder", "is not a git checkout — point it at a clone"),
        ("no main", "no branch main or origin/main to start the change from — set K3GATE_BASE"),
        ("no git", "git is not installed"),
    ],
)
def test_not_run_says_why(tmp_path, monkeypatch, setup, reason):
    monkeypatch.delenv("K3GATE_BASE", raising=False)
    monkeypatch.delenv("K3GATE_VLLM_REPO", raising=False)
    if setup == "plain folder":
        monkeypatch.setenv("K3GATE_VLLM_REPO", str(tmp_path))
    elif setup == "no main":
        repo = tmp_path / "r"
        scratch.init(repo)
        scratch.git(repo, "checkout", "-q", "-b", "trunk")
        scratch.commit(repo, {MODEL: "x\n"}, "one")
        monkeypatch.setenv("K3GATE_VLLM_REPO", str(repo))
    elif setup == "no git":
        monkeypatch.setenv("K3GATE_VLLM_REPO", str(tmp_path))
        monkeypatch.setattr(gitdiff.shutil, "which", lambda _name: None)
    records, verdict = _run(tmp_path)
    assert verdict.verdict is Verdict.NOT_RUN
    assert reason in verdict.reason
    assert records.metrics["runtime_audit"].startswith(NO_SUITE)


def test_self_scope_judges_the_gates_own_repository(tmp_path, monkeypatch, quiet_runtime):
    """k3-hopper judges the repository holding the gate: a kernel change that edits the tolerances fails."""
    repo = tmp_path / "gate"
    kernel = "k3_decode/kernels/kda.py"
    scratch.two_commits(repo, {kernel: "a = 1\n", "suites/tolerances.toml": "x = 1\n"}, {"README.md": "r\n"})
    scratch.git(repo, "checkout", "-q", "-b", "faster-kda")
    monkeypatch.setattr(stage_module, "GATE_ROOT", repo / "k3_decode")
    monkeypatch.delenv("K3GATE_BASE", raising=False)
    scratch.commit(repo, {kernel: "a = 2\n", "tests/k3_decode/test_kda.py": "t = 1\n"}, "kernel and its test")
    assert _run(tmp_path / "1", "cpu-smoke")[1].verdict is Verdict.PASSED
    scratch.commit(repo, {"suites/tolerances.toml": "x = 2\n"}, "loosen")
    _, verdict = _run(tmp_path / "2", "cpu-smoke")
    assert verdict.verdict is Verdict.FAILED
    assert "co-change rule: a decode-path change may not edit its judge: suites/tolerances.toml" in verdict.reason


def test_gate_outside_a_checkout_is_not_run(tmp_path, monkeypatch, quiet_runtime):
    monkeypatch.setattr(stage_module, "GATE_ROOT", tmp_path)
    _, verdict = _run(tmp_path, "cpu-smoke")
    assert verdict.verdict is Verdict.NOT_RUN and "not running from a git checkout" in verdict.reason
    assert "(the 1 checks that ran passed)" in verdict.reason


def test_subject_without_code_scope_is_not_run(tmp_path, monkeypatch):
    class Bare:
        name = "k3-hopper"

    monkeypatch.setattr("harness.subjects.load_subject", lambda _name: Bare())
    _, verdict = _run(tmp_path, "cpu-smoke")
    assert verdict.verdict is Verdict.NOT_RUN and "declares no code scope" in verdict.reason


# -- the runtime half ---------------------------------------------------------------------------------------------


def test_runtime_half_on_cpu_smoke_writes_ledgers_timeline_and_coverage(tmp_path):
    half = runtime_half("isolation", _ctx(tmp_path, "cpu-smoke"))
    assert half.ran and half.checks and all(c.passed for c in half.checks), [c.name for c in half.checks]
    assert all(c.name.startswith("runtime: ") for c in half.checks[:-1])
    assert sorted(half.evidence) == [
        "stages/isolation/coverage.json",
        "stages/isolation/ledger-tp1-auto-q4.json",
        "stages/isolation/ledger-tp1-auto.json",
        "stages/isolation/ledger-tp2-auto-q4.json",
        "stages/isolation/ledger-tp2-auto.json",
        "stages/isolation/timeline.json",
    ]
    for rel in half.evidence:
        text = (tmp_path / "bundle" / rel).read_text()
        assert REPO_ROOT not in text and str(tmp_path) not in text  # no machine paths in a bundle
    not_run = {i["name"]: i["reason"] for i in half.metrics["not_run"]}
    assert (
        "specialized kernels are not built"
        in not_run[
            "runtime: tp1 latency_specialized, tp1 latency_specialized q4, tp2 latency_specialized, "
            "tp2 latency_specialized q4: every cell"
        ]
    )
    coverage = next(reason for name, reason in not_run.items() if name.startswith("line coverage"))
    assert coverage.startswith("no file matches k3_decode/kernels/**/*.py")
    assert [t["title"] for t in half.metrics["timelines"]] == [
        "Fallback timeline: tp1 auto",
        "Fallback timeline: tp1 auto q4",
        "Fallback timeline: tp2 auto",
        "Fallback timeline: tp2 auto q4",
    ]
    assert json.loads((tmp_path / "bundle" / "stages/isolation/coverage.json").read_text())["fraction"] is None


def test_config_whose_gpu_is_absent_cannot_pass(tmp_path):
    half = runtime_half("isolation", _ctx(tmp_path, "h200"))
    assert not half.ran and half.reason.startswith("config h200 ")
    static = StageRecords("isolation", checks=[Check("hygiene monkeypatch", 0, "==", 0)])
    verdict = derive_verdict(combine("isolation", static, half).to_json())
    assert verdict.verdict is Verdict.NOT_RUN
    assert (
        verdict.reason.startswith("runtime half: config h200 ") and "(the 1 checks that ran passed)" in verdict.reason
    )


PASS, FAIL = Check("a", 0, "==", 0), Check("b", 1, "==", 0)


@pytest.mark.parametrize(
    ("static", "runtime", "want"),
    [
        (StageRecords("isolation", checks=[PASS]), RuntimeHalf(True, checks=[PASS]), Verdict.PASSED),
        (StageRecords("isolation", checks=[PASS]), RuntimeHalf(True, checks=[FAIL]), Verdict.FAILED),
        (StageRecords("isolation", checks=[FAIL]), RuntimeHalf(False, "no GPU"), Verdict.FAILED),
        (StageRecords.not_run("isolation", "no git"), RuntimeHalf(True, checks=[FAIL]), Verdict.FAILED),
        (StageRecords.not_run("isolation", "no git"), RuntimeHalf(True, checks=[PASS]), Verdict.NOT_RUN),
        (StageRecords("isolation", checks=[PASS]), RuntimeHalf(False, "no GPU"), Verdict.NOT_RUN),
        (StageRecords("isolation", checks=[PASS]), RuntimeHalf(False, "no suite", absent=True), Verdict.PASSED),
        (StageRecords.not_run("isolation", "no git"), RuntimeHalf(False, "no suite", absent=True), Verdict.NOT_RUN),
    ],
)
def test_one_verdict_from_both_halves(static, runtime, want):
    """A failure of either half fails the stage; it passes only when every half that exists ran and passed."""
    assert derive_verdict(combine("isolation", static, runtime).to_json()).verdict is want
