"""Invariants of the GitHub workflows that keep the self-hosted GPU gate safe on a public repository.

zizmor and the workflow schema (scripts/lint-ci) catch generic mistakes; these tests pin down this project's
own rules, so a later edit that weakens one fails here with the rule's name.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
from ruamel.yaml import YAML

from harness.config.loader import builtin_names

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = ROOT / ".github" / "workflows"
GATE = WORKFLOWS / "gpu-gate.yml"
PINNED = re.compile(r"^[\w.-]+/[\w.-]+(/[\w./-]+)?@[0-9a-f]{40} # v\d+(\.\d+)*$")
LABEL = re.compile(r"github\.event\.label\.name == '(k3gate:[\w-]+)'")


def load(path: Path) -> dict[str, Any]:
    return YAML(typ="safe").load(path.read_text())


def workflows() -> list[Path]:
    return sorted(WORKFLOWS.glob("*.yml"))


def steps(job: dict[str, Any]) -> list[dict[str, Any]]:
    return job.get("steps", [])


def is_self_hosted(job: dict[str, Any]) -> bool:
    runs_on = job.get("runs-on")
    return isinstance(runs_on, list) and "self-hosted" in runs_on


@pytest.fixture(scope="module")
def gate() -> dict[str, Any]:
    return load(GATE)


def gpu_jobs(gate: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: job for name, job in gate["jobs"].items() if is_self_hosted(job)}


@pytest.mark.parametrize("path", workflows(), ids=lambda p: p.name)
def test_every_action_is_pinned_to_a_commit_with_its_version(path):
    for line in path.read_text().splitlines():
        match = re.match(r"^\s*(?:- )?uses: (.+)$", line)
        if match:
            assert PINNED.match(match.group(1)), f"{path.name}: not pinned to a SHA with a version: {line.strip()}"


@pytest.mark.parametrize("path", workflows(), ids=lambda p: p.name)
def test_no_expression_is_expanded_inside_a_shell_script(path):
    # Expressions in `run:` are pasted into the script before the shell sees it: data from a pull request
    # (titles, branch names, labels) would become code. Scripts read such data from env: instead.
    for name, job in load(path)["jobs"].items():
        for step in steps(job):
            assert "${{" not in step.get("run", ""), f"{path.name}: job {name}: step {step.get('name')!r}"


def test_the_gate_runs_only_on_a_maintainers_label_of_a_pr_to_main(gate):
    assert gate["on"] == {"pull_request_target": {"types": ["labeled"], "branches": ["main"]}}
    assert gate["permissions"] == {}, "the default token of every job must start with no permission"


def test_gpu_jobs_are_gated_and_hold_no_credential(gate):
    jobs = gpu_jobs(gate)
    assert {tuple(j["runs-on"]) for j in jobs.values()} == {
        ("self-hosted", "linux", "gb300"),
        ("self-hosted", "linux", "h200"),
    }
    text = GATE.read_text()
    for name, job in jobs.items():
        assert LABEL.search(job["if"]), f"{name}: runs without a maintainer's label"
        assert job["environment"] == "gpu-gate", f"{name}: no environment with required reviewers"
        assert job["permissions"] == {"contents": "read"}, f"{name}: more than a read-only token"
        block = re.search(rf"\n  {name}:\n(.*?)(?=\n  \S|\Z)", text, re.S).group(1)
        assert "secrets." not in block and "id-token" not in block, f"{name}: a secret or an OIDC token"
        uses = [s["uses"].split("@")[0] for s in steps(job) if "uses" in s]
        assert uses == ["actions/checkout", "actions/upload-artifact"], f"{name}: runs actions {uses}"
        (checkout,) = [s for s in steps(job) if s.get("uses", "").startswith("actions/checkout@")]
        assert checkout["with"]["ref"] == "${{ github.event.pull_request.head.sha }}", f"{name}: not the approved SHA"
        assert checkout["with"]["persist-credentials"] is False, f"{name}: leaves the token in .git/config"
        (upload,) = [s for s in steps(job) if s.get("uses", "").startswith("actions/upload-artifact@")]
        assert upload["with"]["name"] == "k3gate-bundle" and upload["with"]["path"].endswith(".tar.gz")


def test_each_label_names_a_shipped_config(gate):
    labels = {m for job in gpu_jobs(gate).values() for m in LABEL.findall(job["if"])}
    assert labels == {"k3gate:tp8-gb300", "k3gate:tp16-gb300", "k3gate:h200"}
    assert {label.removeprefix("k3gate:") for label in labels} <= set(builtin_names())
    attest_config = gate["jobs"]["attest"]["env"]["CONFIG"]
    for label in labels:
        assert f"'{label}'" in attest_config or label == "k3gate:tp8-gb300", f"attest cannot name the config of {label}"


def test_only_the_attest_job_can_sign_and_it_never_runs_pr_code(gate):
    signers = [name for name, job in gate["jobs"].items() if job.get("permissions", {}).get("id-token") == "write"]
    assert signers == ["attest"]
    attest = gate["jobs"]["attest"]
    assert not is_self_hosted(attest) and attest["runs-on"].startswith("ubuntu-")
    assert set(attest["needs"]) == set(gpu_jobs(gate)), "attest must wait for every GPU job"
    for step in steps(attest):
        if step.get("uses", "").startswith("actions/checkout@"):
            assert not {"ref", "repository"} & set(step.get("with", {})), "attest checks out something other than base"
            assert step["with"]["persist-credentials"] is False
    runs = " ".join(s.get("run", "") for s in steps(attest))
    assert "k3gate verify" in runs and "k3gate attest" in runs and "--expect-commit" in runs
    assert attest["env"]["K3GATE_SIGSTORE_REPOSITORY"] == "${{ github.repository }}"


def test_the_shipped_sigstore_policy_names_this_workflow(gate):
    policy = tomllib.loads((ROOT / "harness" / "bundle" / "sigstore_policy.toml").read_text())
    assert policy["workflow"] == GATE.relative_to(ROOT).as_posix()
    assert policy["ref"] == f"refs/heads/{gate['on']['pull_request_target']['branches'][0]}"
    assert policy["runner_environment"] == "github-hosted"


def test_the_cpu_workflow_runs_the_readme_test_command_and_the_image_test():
    ci = load(WORKFLOWS / "ci.yml")
    runs = [s.get("run") for job in ci["jobs"].values() for s in steps(job)]
    assert "scripts/test" in runs and "scripts/test-docker" in runs
    assert all(not is_self_hosted(job) for job in ci["jobs"].values())
    assert ci["permissions"] == {"contents": "read"}
