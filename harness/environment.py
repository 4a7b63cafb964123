"""Capture of the environment a run used: OS, Python, packages, GPU, allow-listed variables, git state.

Only allow-listed environment variables are recorded, and even those are dropped when their name looks like
a credential: a bundle is published with a pull request.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.hardware import detect

ENV_PREFIXES = (
    "CUDA_",
    "NCCL_",
    "VLLM_",
    "PYTORCH_",
    "TORCH_",
    "CUTE_DSL_",
    "NVSHMEM_",
    "TRITON_",
    "K3GATE_",
)
ENV_NAMES = (
    "OMP_NUM_THREADS",
    "CI",
    "GITHUB_SHA",
    "GITHUB_REF",
    "GITHUB_REPOSITORY",
    "GITHUB_RUN_ID",
    "GITHUB_RUN_ATTEMPT",
    "GITHUB_WORKFLOW",
    "RUNNER_OS",
    "SOURCE_DATE_EPOCH",
)
SECRET_PATTERN = re.compile(r"TOKEN|SECRET|PASS|CREDENTIAL|PRIVATE|_KEY$|^KEY|AUTH|COOKIE|SESSION", re.IGNORECASE)


def allowed_env(environ: dict[str, str]) -> dict[str, str]:
    return {
        k: v
        for k, v in sorted(environ.items())
        if (k.startswith(ENV_PREFIXES) or k in ENV_NAMES) and not SECRET_PATTERN.search(k)
    }


def packages() -> list[str]:
    """`name==version` of every installed distribution, sorted (what `pip freeze --all` lists)."""
    seen = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name and name.lower() not in seen:
            seen[name.lower()] = f"{name}=={dist.version}"
    return sorted(seen.values(), key=str.lower)


def _git(root: Path, *args: str, env: dict[str, str] | None = None) -> str | None:
    if shutil.which("git") is None:
        return None
    try:
        return subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, timeout=60, check=True, env=env
        ).stdout.decode(errors="replace")
    except (OSError, subprocess.SubprocessError):
        return None


@dataclass(frozen=True)
class GitState:
    commit: str | None
    dirty: bool
    diff_sha256: str | None  # of `git diff HEAD --binary` plus the names of untracked files
    reason: str = ""
    # The git tree id of the files as they were (worktree_tree): `git rev-parse <commit>^{tree}` gives the same id
    # exactly when a commit holds the same files, so a dirty run is still tied to a commit by anyone with the repo.
    tree: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "commit": self.commit,
            "dirty": self.dirty,
            "diff_sha256": self.diff_sha256,
            "reason": self.reason,
            "tree": self.tree,
        }


COMMIT_ENV = "K3GATE_COMMIT"


def git_state(root: Path) -> GitState:
    commit = _git(root, "rev-parse", "HEAD")
    if commit is None:
        declared = os.environ.get(COMMIT_ENV, "").strip()
        if declared:
            # A copy of the tree without .git (a container, a device sandbox): the commit is declared, not verified.
            return GitState(declared, False, None, f"declared by {COMMIT_ENV}; no git checkout here to verify it")
        return GitState(None, False, None, "not a git checkout (an installed release: see the package versions)")
    status = _git(root, "status", "--porcelain") or ""
    diff = (_git(root, "diff", "HEAD", "--binary") or "").encode()
    untracked = (_git(root, "ls-files", "--others", "--exclude-standard") or "").encode()
    digest = hashlib.sha256(diff + b"\0" + untracked).hexdigest() if status.strip() else None
    tree = worktree_tree(root) if status.strip() else _git(root, "rev-parse", "HEAD^{tree}")
    return GitState(commit.strip(), bool(status.strip()), digest, tree=tree.strip() if tree else None)


def worktree_tree(root: Path) -> str | None:
    """The tree id git would give the checkout's files as they are now (tracked ones with their changes, untracked
    ones that are not ignored), built in a scratch index and a scratch object folder: the checkout's own index and
    object store are left as they were."""
    objects = _git(root, "rev-parse", "--git-path", "objects")
    if objects is None:
        return None
    with tempfile.TemporaryDirectory(prefix="k3gate-tree-") as tmp:
        (Path(tmp) / "objects").mkdir()  # git takes a missing object folder for no repository at all
        env = {
            **os.environ,
            "GIT_INDEX_FILE": str(Path(tmp) / "index"),
            "GIT_OBJECT_DIRECTORY": str(Path(tmp) / "objects"),
            "GIT_ALTERNATE_OBJECT_DIRECTORIES": str((root / objects.strip()).resolve()),
        }
        for args in (("read-tree", "HEAD"), ("add", "-A")):
            if _git(root, *args, env=env) is None:
                return None
        tree = _git(root, "write-tree", env=env)
    return tree.strip() if tree else None


def source_root() -> Path:
    """The folder holding the harness package (a git checkout in development, site-packages when installed)."""
    return Path(__file__).resolve().parent.parent


def torch_info() -> dict[str, Any]:
    if importlib.util.find_spec("torch") is None:
        return {"installed": False}
    import torch

    info: dict[str, Any] = {
        "installed": True,
        "version": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
    }
    if info["cuda_available"]:
        info["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    return info


def nvidia_smi_report() -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        return subprocess.run([exe, "-q"], capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def k3gate_version() -> str:
    try:
        return importlib.metadata.version("k3gate")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


@dataclass
class Environment:
    summary: dict[str, Any]
    packages: list[str]
    nvidia_smi: str | None


def capture() -> Environment:
    hw = detect()
    git = git_state(source_root())
    pkgs = packages()
    summary = {
        "os": {
            "system": platform.system(),
            "release": platform.release(),
            "machine": platform.machine(),
            "platform": platform.platform(),
        },
        "python": {"version": platform.python_version(), "implementation": platform.python_implementation()},
        "k3gate": {"version": k3gate_version(), "git": git.to_json()},
        "torch": torch_info(),
        "gpu": {
            "kind": hw.kind,
            "count": hw.count,
            "names": list(hw.names),
            "compute_capability": hw.compute_capability,
            "driver": hw.driver,
            "query": hw.detail,
        },
        "env": allowed_env(dict(os.environ)),
        "packages_count": len(pkgs),
        "argv0": Path(sys.argv[0]).name,
    }
    return Environment(summary=summary, packages=pkgs, nvidia_smi=nvidia_smi_report())
