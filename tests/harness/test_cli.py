from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness import pipeline
from harness.bundle.verify import verify
from harness.cli import main
from harness.stages import EnvironmentStage
from harness.verdicts import Check, StageRecords

REPO = Path(__file__).resolve().parents[2]


def test_run_end_to_end_in_a_real_process(tmp_path):
    """What a newcomer sees: the default config on a CPU machine is incomplete (exit 3), never green."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    proc = subprocess.run(
        [sys.executable, "-m", "harness", "run", "--out", str(tmp_path / "b"), "--json"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 3, proc.stderr
    assert "using config cpu-smoke (no CUDA GPU found)" in proc.stderr
    assert "created your signing key" in proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["outcome"] == "INCOMPLETE" and summary["exit_code"] == 3
    verdicts = {v["stage"]: v["verdict"] for v in summary["verdicts"]}
    assert verdicts["environment"] == verdicts["bundle"] == "PASSED"
    assert verify(Path(summary["archive"])).ok
    report = subprocess.run(
        [sys.executable, "-m", "harness", "report", summary["archive"]],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert report.returncode == 0
    assert "INCOMPLETE" in report.stdout and "**scope** (NOT_RUN)" in report.stdout


def test_html_report_is_self_contained(tmp_path, capsys):
    assert main(["run", "--config", "cpu-smoke", "--out", str(tmp_path / "b"), "--quiet"]) == 3
    out = tmp_path / "r.html"
    assert main(["report", str(tmp_path / "b"), "--format", "html", "--out", str(out)]) == 0
    html = out.read_text()
    assert html.startswith("<!doctype html>") and "INCOMPLETE" in html
    for external in ("href=", "<script", "@import", "url("):
        assert external not in html
    assert html.count("src=") == html.count("src='data:")  # images are embedded, never fetched


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--stages", "numerix"], "unknown stage 'numerix'"),
        (["--stages", ","], "--stages is empty"),
        (["--key", "missing.key"], "does not exist"),
        (["--config", "gb200"], "unknown config 'gb200'"),
    ],
)
def test_run_usage_errors(tmp_path, capsys, argv, message):
    out = tmp_path / "b"
    assert main(["run", "--out", str(out), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists() and not out.with_name("b.partial").exists()


def test_run_refuses_a_non_empty_out(tmp_path, capsys):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x").write_text("x")
    assert main(["run", "--out", str(tmp_path / "b")]) == 2
    assert "already exists and is not empty" in capsys.readouterr().err


def test_stage_selection_limits_required(tmp_path, capsys):
    assert main(["run", "--config", "cpu-smoke", "--stages", "numerics", "--out", str(tmp_path / "b"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert [v["stage"] for v in summary["verdicts"]] == ["environment", "numerics", "bundle"]
    assert summary["outcome"] == "PASSED"  # isolation, scope and perf are required by cpu-smoke but not selected


@dataclass(frozen=True)
class FakeStage:
    name: str
    behaviour: str
    needs_hardware: bool = False
    description: str = "test stage"

    def run(self, ctx):
        if self.behaviour == "raise":
            raise RuntimeError("kernel exploded")
        value = 0.5 if self.behaviour == "pass" else 7.0
        return StageRecords(stage=self.name, checks=[Check("max abs error", value, "<=", 1.0)])


def with_stages(monkeypatch, *stages):
    monkeypatch.setattr(pipeline, "registered", lambda: [EnvironmentStage(), *stages])


def test_crashing_stage_is_error_and_the_bundle_is_still_written(tmp_path, monkeypatch, capsys):
    with_stages(monkeypatch, FakeStage("numerics", "raise"))
    assert main(["run", "--config", "cpu-smoke", "--stages", "numerics", "--out", str(tmp_path / "b"), "--json"]) == 3
    summary = json.loads(capsys.readouterr().out)
    numerics = next(v for v in summary["verdicts"] if v["stage"] == "numerics")
    assert numerics["verdict"] == "ERROR" and "kernel exploded" in numerics["reason"]
    assert "RuntimeError: kernel exploded" in (tmp_path / "b" / "stages" / "numerics" / "traceback.txt").read_text()
    assert verify(tmp_path / "b").ok


def test_failing_and_passing_stages_set_the_exit_code(tmp_path, monkeypatch):
    with_stages(monkeypatch, FakeStage("numerics", "fail"))
    assert main(["run", "--config", "cpu-smoke", "--stages", "numerics", "--out", str(tmp_path / "f")]) == 1
    with_stages(monkeypatch, FakeStage("numerics", "pass"))
    assert main(["run", "--config", "cpu-smoke", "--stages", "numerics", "--out", str(tmp_path / "p")]) == 0
    assert verify(tmp_path / "p").ok


def test_absent_hardware_is_not_run_with_the_reason(tmp_path, monkeypatch, capsys):
    with_stages(monkeypatch, FakeStage("numerics", "pass", needs_hardware=True))
    assert main(["run", "--config", "h200", "--stages", "numerics", "--out", str(tmp_path / "b"), "--json"]) == 3
    numerics = next(v for v in json.loads(capsys.readouterr().out)["verdicts"] if v["stage"] == "numerics")
    assert numerics["verdict"] == "NOT_RUN" and "needs 1x H200, this machine has no CUDA GPU" in numerics["reason"]


def test_interrupted_run_leaves_no_finished_looking_bundle(tmp_path, monkeypatch):
    def boom(*_a, **_k):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline.writer, "seal", boom)
    assert main(["run", "--config", "cpu-smoke", "--stages", "numerics", "--out", str(tmp_path / "b")]) == 130
    assert not (tmp_path / "b").exists() and not (tmp_path / "b.tar.gz").exists()
    assert (tmp_path / "b.partial").is_dir()


def test_credentials_never_reach_the_environment_capture():
    from harness.environment import allowed_env

    env = {
        "K3GATE_KEY_PASSPHRASE": "x",
        "VLLM_API_KEY": "x",
        "NCCL_IB_HCA": "mlx5",
        "GITHUB_TOKEN": "x",
        "HF_TOKEN": "x",
        "CUDA_VISIBLE_DEVICES": "0",
        "VLLM_SESSION_COOKIE": "x",
    }
    assert allowed_env(env) == {"CUDA_VISIBLE_DEVICES": "0", "NCCL_IB_HCA": "mlx5"}


def test_a_tree_without_git_can_declare_its_commit(tmp_path, monkeypatch):
    from harness.environment import COMMIT_ENV, git_state

    monkeypatch.delenv(COMMIT_ENV, raising=False)
    assert git_state(tmp_path).commit is None
    monkeypatch.setenv(COMMIT_ENV, "0123abcd")
    state = git_state(tmp_path)
    assert state.commit == "0123abcd" and "not verified" not in state.reason and "declared" in state.reason


def test_a_dirty_tree_is_tied_to_the_commit_that_holds_the_same_files(tmp_path):
    """The tree id recorded for a dirty run equals `<commit>^{tree}` of a commit made from those files, and taking
    it leaves the checkout's index and object store as they were. Broken case: one byte more, another id."""
    import subprocess

    from harness.environment import git_state

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(tmp_path), *args], capture_output=True, text=True, check=True).stdout

    git("init", "-q")
    git("config", "user.email", "t@example.org")
    git("config", "user.name", "t")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("commit", "-qm", "one")
    clean = git_state(tmp_path)
    assert not clean.dirty and clean.tree == git("rev-parse", "HEAD^{tree}").strip()

    (tmp_path / "a.py").write_text("x = 2\n")
    (tmp_path / "new.py").write_text("y = 3\n")  # untracked, not ignored: it ran, so it counts
    objects_before, staged_before = git("count-objects", "-v"), git("ls-files", "--stage")
    dirty = git_state(tmp_path)
    assert dirty.dirty and dirty.tree and dirty.tree != clean.tree
    assert git("count-objects", "-v") == objects_before and git("ls-files", "--stage") == staged_before
    assert git("status", "--porcelain").splitlines() == [" M a.py", "?? new.py"]

    git("add", "-A")
    git("commit", "-qm", "two")
    assert dirty.tree == git("rev-parse", "HEAD^{tree}").strip()
    (tmp_path / "a.py").write_text("x = 2\n\n")
    assert git_state(tmp_path).tree != dirty.tree
