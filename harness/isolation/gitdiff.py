"""The git facts the isolation checks need: which paths a change touches, and their text at the change's head."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from harness.errors import UsageError

STATUS = {"A": "added", "M": "modified", "D": "deleted", "R": "renamed", "C": "copied", "T": "type changed"}


class GitError(UsageError):
    pass


class GitMissing(RuntimeError):
    """No git executable: the checks cannot run at all (NOT_RUN, not a usage error)."""


@dataclass(frozen=True)
class Change:
    status: str  # one letter of STATUS (U and X pass through as they come)
    path: str  # the path at head; for a deletion, the path that was deleted
    old_path: str = ""  # the path at base, for a rename or a copy

    def paths(self) -> tuple[tuple[str, str], ...]:
        """(side, path) pairs to judge. A rename empties its old path, so both sides count."""
        if self.status == "R":
            return (("from", self.old_path), ("to", self.path))
        return (("", self.path),)

    @property
    def exists_at_head(self) -> bool:
        return self.status != "D"

    def describe(self) -> str:
        what = STATUS.get(self.status, self.status)
        return f"{what} from {self.old_path}" if self.old_path else what


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    exe = shutil.which("git")
    if exe is None:
        raise GitMissing("git is not installed, so no diff can be read")
    return subprocess.run([exe, "-C", str(repo), *args], capture_output=True, timeout=300, check=False)


def toplevel(folder: Path) -> Path | None:
    """The root of the git work tree holding `folder`, or None if it is not in one."""
    proc = _git(folder, "rev-parse", "--show-toplevel")
    return Path(proc.stdout.decode().strip()) if proc.returncode == 0 else None


def require_repo(repo: Path) -> Path:
    if not repo.is_dir():
        raise GitError(f"--repo {repo} is not a folder — give the root of a git checkout")
    top = toplevel(repo)
    if top is None:
        raise GitError(f"--repo {repo} is not inside a git repository — give a git checkout (git init/clone)")
    return top


def commit(repo: Path, rev: str, flag: str = "revision") -> str:
    proc = _git(repo, "rev-parse", "--verify", "--quiet", "--end-of-options", f"{rev}^{{commit}}")
    if proc.returncode != 0:
        raise GitError(f"{flag} {rev!r} is not a commit of {repo} — give a branch, tag or commit hash (git log)")
    return proc.stdout.decode().strip()


def merge_base(repo: Path, a: str, b: str) -> str | None:
    proc = _git(repo, "merge-base", a, b)
    return proc.stdout.decode().strip() if proc.returncode == 0 else None


def changes(repo: Path, base: str, head: str) -> list[Change]:
    proc = _git(repo, "diff", "--name-status", "-z", "-M", "--no-ext-diff", "--no-textconv", base, head, "--")
    if proc.returncode != 0:
        raise GitError(f"git diff {base}..{head} failed: {proc.stderr.decode().strip()} — check both revisions")
    fields = proc.stdout.decode("utf-8", "surrogateescape").split("\0")
    out: list[Change] = []
    i = 0
    while i < len(fields) and fields[i]:
        status = fields[i][0]
        if status in "RC":
            out.append(Change(status, fields[i + 2], fields[i + 1]))
            i += 3
        else:
            out.append(Change(status, fields[i + 1]))
            i += 2
    return out


def show(repo: Path, rev: str, path: str) -> bytes:
    return show_many(repo, rev, [path])[path]


def show_many(repo: Path, rev: str, paths: list[str]) -> dict[str, bytes]:
    """The contents of many files at one revision, through one `git cat-file --batch` (a process per file is
    most of the time on a large change)."""
    if any("\n" in p for p in paths):
        raise GitError("a path holds a newline, which git cat-file cannot be asked for — rename the file")
    exe = shutil.which("git")
    if exe is None:
        raise GitMissing("git is not installed, so no file can be read")
    request = "".join(f"{rev}:{p}\n" for p in paths).encode("utf-8", "surrogateescape")
    proc = subprocess.run(
        [exe, "-C", str(repo), "cat-file", "--batch"], input=request, capture_output=True, timeout=300, check=False
    )
    if proc.returncode != 0:
        raise GitError(f"cannot read files at {rev}: {proc.stderr.decode().strip()}")
    out: dict[str, bytes] = {}
    data, pos = proc.stdout, 0
    for path in paths:
        end = data.index(b"\n", pos)
        header = data[pos:end].split()
        if len(header) != 3 or header[1] != b"blob":
            raise GitError(f"cannot read {path} at {rev}: git answered {data[pos:end].decode(errors='replace')!r}")
        size = int(header[2])
        out[path] = data[end + 1 : end + 1 + size]
        pos = end + 1 + size + 1  # the blob is followed by a newline
    return out


def uncommitted(repo: Path) -> list[str]:
    """Paths with uncommitted changes (tracked or untracked, not ignored)."""
    proc = _git(repo, "status", "--porcelain", "-z", "--untracked-files=all")
    if proc.returncode != 0:
        return []
    entries = proc.stdout.decode("utf-8", "surrogateescape").split("\0")
    paths, skip = [], False
    for entry in entries:
        if skip:  # the second field of a rename entry is its old path
            skip = False
            continue
        if len(entry) > 3:
            paths.append(entry[3:])
            skip = entry[0] in "RC"
    return sorted(paths)
