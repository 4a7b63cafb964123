"""Path globs for scope files: `**` spans folders, `*` and `?` stay inside one folder name.

fnmatch lets `*` cross `/`, which would let `pkg/models/*` admit every file below it; scope globs must mean
exactly what a reviewer reads.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import cache


class GlobError(ValueError):
    pass


@cache
def compile_glob(pattern: str) -> re.Pattern[str]:
    if not pattern or pattern.startswith("/") or "\\" in pattern:
        raise GlobError(f"glob {pattern!r} must be a non-empty path relative to the repository root, with '/'")
    parts = pattern.split("/")
    out: list[str] = []
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if part == "**":
            # `a/**` matches everything below a; `a/**/b` matches a/b, a/x/b, a/x/y/b.
            out.append(".*" if last else "(?:[^/]+/)*")
            continue
        if "**" in part:
            raise GlobError(f"glob {pattern!r}: '**' must be a whole path segment, as in 'dir/**/name'")
        out.append(_segment(part) + ("" if last else "/"))
    return re.compile("".join(out) + r"\Z")


def _segment(part: str) -> str:
    pieces = []
    for ch in part:
        if ch == "*":
            pieces.append("[^/]*")
        elif ch == "?":
            pieces.append("[^/]")
        else:
            pieces.append(re.escape(ch))
    return "".join(pieces)


def matches(path: str, pattern: str) -> bool:
    return compile_glob(pattern).match(path) is not None


def first_match(path: str, patterns: Iterable[str]) -> str | None:
    return next((p for p in patterns if matches(path, p)), None)
