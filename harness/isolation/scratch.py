"""Tiny git repositories built from file maps: the red team's broken changes and the tests' fixtures."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

from harness.isolation.gitdiff import GitMissing

# Fixed identity and dates, so a scratch commit never depends on the user's git config.
_ENV = {
    "GIT_AUTHOR_NAME": "k3gate",
    "GIT_AUTHOR_EMAIL": "k3gate@localhost",
    "GIT_COMMITTER_NAME": "k3gate",
    "GIT_COMMITTER_EMAIL": "k3gate@localhost",
    "GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z",
    "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z",
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": "/dev/null",
}


def git(repo: Path, *args: str) -> str:
    exe = shutil.which("git")
    if exe is None:
        raise GitMissing("git is not installed, so no scratch repository can be built")
    proc = subprocess.run(
        [exe, "-C", str(repo), *args], capture_output=True, text=True, env={**os.environ, **_ENV}, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.stdout.strip()


def init(repo: Path) -> Path:
    repo.mkdir(parents=True, exist_ok=True)
    git(repo, "init", "-q", "-b", "main")
    return repo


def commit(repo: Path, files: Mapping[str, str | None], message: str) -> str:
    """Write (or, for None, delete) the files and commit them; returns the commit hash."""
    for rel, text in files.items():
        path = repo / rel
        if text is None:
            path.unlink()
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "--allow-empty", "-m", message)
    return git(repo, "rev-parse", "HEAD")


def two_commits(repo: Path, base: Mapping[str, str | None], head: Mapping[str, str | None]) -> tuple[str, str]:
    """A repository whose first commit holds `base` and whose second applies `head` on top."""
    init(repo)
    return commit(repo, base, "base"), commit(repo, head, "change")
