"""`k3gate isolation`: exit codes as for `k3gate run`, per-file reasons, one-line usage errors."""

from __future__ import annotations

import json

import pytest

from harness.cli import main
from harness.isolation import gitdiff, scratch

MODEL = "vllm/models/kimi_k3/nvidia/model.py"
SAMPLER = "vllm/v1/sample/sampler.py"


@pytest.fixture
def repo(tmp_path):
    path = tmp_path / "vllm"
    scratch.two_commits(path, {MODEL: "x = 1\n", SAMPLER: "s = 1\n"}, {MODEL: "x = 2\n"})
    return path


def test_pass(repo, capsys):
    assert main(["isolation", "--repo", str(repo), "--base", "HEAD~1", "--subject", "vllm-k3"]) == 0
    err = capsys.readouterr().err
    assert "1 changed paths; within the scope: 1 model" in err and "PASSED" in err


def test_fail_names_the_file_and_reason(repo, capsys):
    scratch.commit(repo, {SAMPLER: "s = 2\n"}, "sampler")
    assert main(["isolation", "--repo", str(repo), "--base", "HEAD~2", "--subject", "vllm-k3", "--json"]) == 1
    out = capsys.readouterr()
    assert f"FAIL {SAMPLER} (review: sampling): shared component 'sampling'" in out.err
    data = json.loads(out.out)
    assert data["verdict"]["verdict"] == "FAILED"
    failed = [c["name"] for c in data["records"]["checks"] if not c["passed"]]
    assert failed == [f"path {SAMPLER}"]
    assert {p["path"] for p in data["judgement"]["paths"]} == {MODEL, SAMPLER}


def test_hygiene_findings_name_file_line_rule(repo, capsys):
    scratch.commit(repo, {MODEL: "import torch.nn.functional as F\nF.silu = None\n"}, "patch")
    assert main(["isolation", "--repo", str(repo), "--base", "HEAD~1", "--subject", "vllm-k3"]) == 1
    assert f"FAIL {MODEL}:2: [monkeypatch] assigns F.silu" in capsys.readouterr().err


def test_scope_file(repo, tmp_path, capsys):
    scope = tmp_path / "scope.toml"
    scope.write_text('[isolation]\nmodel = ["vllm/**"]\n')
    scratch.commit(repo, {SAMPLER: "s = 2\n"}, "sampler")
    assert main(["isolation", "--repo", str(repo), "--base", "HEAD~2", "--scope", str(scope)]) == 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--base", "nope", "--subject", "vllm-k3"], "--base 'nope' is not a commit"),
        (["--base", "HEAD", "--head", "nope", "--subject", "vllm-k3"], "--head 'nope' is not a commit"),
        (["--base", "HEAD", "--subject", "k4"], "unknown subject 'k4'"),
        (["--base", "HEAD", "--scope", "missing.toml"], "--scope missing.toml does not exist"),
    ],
)
def test_usage_errors_exit_2_with_one_line(repo, capsys, argv, message):
    assert main(["isolation", "--repo", str(repo), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and err.startswith("k3gate: error:")


def test_not_a_repository(tmp_path, capsys):
    assert main(["isolation", "--repo", str(tmp_path), "--base", "HEAD", "--subject", "vllm-k3"]) == 2
    assert "is not inside a git repository" in capsys.readouterr().err


def test_subject_or_scope_is_required(repo):
    with pytest.raises(SystemExit) as exc:
        main(["isolation", "--repo", str(repo), "--base", "HEAD"])
    assert exc.value.code == 2


def test_git_vanishing_mid_run_is_incomplete(repo, monkeypatch, capsys):
    def no_git(*_args):
        raise gitdiff.GitMissing("git is not installed, so no diff can be read")

    monkeypatch.setattr(gitdiff, "changes", no_git)
    assert main(["isolation", "--repo", str(repo), "--base", "HEAD~1", "--subject", "vllm-k3"]) == 3
    assert "NOT_RUN: git is not installed" in capsys.readouterr().err


def test_no_git_at_all_is_incomplete(repo, monkeypatch, capsys):
    monkeypatch.setattr(gitdiff.shutil, "which", lambda _name: None)
    assert main(["isolation", "--repo", str(repo), "--base", "HEAD~1", "--subject", "vllm-k3"]) == 3
    assert "NOT_RUN: git is not installed" in capsys.readouterr().err
