from __future__ import annotations

import pytest

from harness.isolation import gitdiff, scratch
from harness.isolation.gitdiff import Change, GitError


def test_changes_name_every_side(tmp_path):
    repo = tmp_path / "r"
    body = "x = 1\n" * 40  # long enough for git to see a rename, not an add and a delete
    base, head = scratch.two_commits(
        repo,
        {"a/keep.py": "k\n", "a/edit.py": "1\n", "a/gone.py": "g\n", "v/sample/s.py": body, "sp ace/é.py": "1\n"},
        {
            "a/edit.py": "2\n",
            "a/gone.py": None,
            "v/sample/s.py": None,
            "m/s.py": body,
            "a/new.py": "n\n",
            "sp ace/é.py": "2\n",
        },
    )
    got = sorted(gitdiff.changes(repo, base, head), key=lambda c: c.path)
    assert got == [
        Change("M", "a/edit.py"),
        Change("D", "a/gone.py"),
        Change("A", "a/new.py"),
        Change("R", "m/s.py", "v/sample/s.py"),
        Change("M", "sp ace/é.py"),
    ]
    rename = got[3]
    assert rename.paths() == (("from", "v/sample/s.py"), ("to", "m/s.py"))
    assert rename.describe() == "renamed from v/sample/s.py"
    assert gitdiff.show(repo, head, "a/new.py") == b"n\n"


def test_revisions_and_repos_are_checked(tmp_path):
    repo = tmp_path / "r"
    scratch.two_commits(repo, {"a": "1"}, {"a": "2"})
    assert len(gitdiff.commit(repo, "HEAD~1")) == 40
    with pytest.raises(GitError, match=r"--base 'nope' is not a commit of .* — give a branch, tag or commit hash"):
        gitdiff.commit(repo, "nope", "--base")
    with pytest.raises(GitError, match="is not a commit"):
        gitdiff.commit(repo, "--output=x", "--base")  # never taken for an option
    (tmp_path / "plain").mkdir()
    with pytest.raises(GitError, match="is not inside a git repository"):
        gitdiff.require_repo(tmp_path / "plain")
    with pytest.raises(GitError, match="is not a folder"):
        gitdiff.require_repo(tmp_path / "missing")


def test_merge_base_and_uncommitted(tmp_path):
    repo = tmp_path / "r"
    _, head = scratch.two_commits(repo, {"a": "1"}, {"a": "2"})
    scratch.git(repo, "checkout", "-q", "-b", "feature")
    scratch.commit(repo, {"b": "3"}, "feature work")
    assert gitdiff.merge_base(repo, "HEAD", "main") == head
    assert gitdiff.merge_base(repo, "HEAD", "nope") is None
    (repo / "a").write_text("dirty")
    (repo / "new file").write_text("x")
    assert gitdiff.uncommitted(repo) == ["a", "new file"]


def test_git_missing_is_its_own_error(tmp_path, monkeypatch):
    monkeypatch.setattr(gitdiff.shutil, "which", lambda _name: None)
    with pytest.raises(gitdiff.GitMissing):
        gitdiff.toplevel(tmp_path)
