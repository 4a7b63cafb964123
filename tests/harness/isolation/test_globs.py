from __future__ import annotations

import pytest

from harness.isolation.globs import GlobError, compile_glob, first_match, matches


@pytest.mark.parametrize(
    ("path", "pattern", "expected"),
    [
        ("vllm/models/kimi_k3/model.py", "vllm/models/kimi_k3/**", True),
        ("vllm/models/kimi_k3/nvidia/a/b.py", "vllm/models/kimi_k3/**", True),
        ("vllm/models/kimi_k3_evil/model.py", "vllm/models/kimi_k3/**", False),
        ("vllm/models/kimi_k3", "vllm/models/kimi_k3/**", False),
        ("vllm/models/x/model.py", "vllm/models/*", False),  # `*` stays inside one folder name
        ("vllm/models/x.py", "vllm/models/*", True),
        ("tests/kimi_k3/test_a.py", "tests/**/kimi_k3/**", True),  # `**/` also matches no folder
        ("tests/models/deep/kimi_k3/test_a.py", "tests/**/kimi_k3/**", True),
        ("vllm/v1/core/kv_cache_utils.py", "vllm/v1/core/kv_cache_*.py", True),
        ("vllm/v1/core/sched/kv_cache_utils.py", "vllm/v1/core/kv_cache_*.py", False),
        ("README.md", "*", True),
        ("docs/README.md", "*", False),
        ("a.b", "a?b", True),
        ("a/b", "a?b", False),
        ("suites/tolerances.toml", "suites/tolerances.toml", True),
        ("suites/tolerances.tomlx", "suites/tolerances.toml", False),
        ("a+b/c", "a+b/*", True),  # regex characters are literal
    ],
)
def test_matches(path, pattern, expected):
    assert matches(path, pattern) is expected


@pytest.mark.parametrize("bad", ["", "/abs/**", "a**/b", "a\\b"])
def test_bad_globs_are_refused(bad):
    with pytest.raises(GlobError):
        compile_glob(bad)


def test_first_match_keeps_order():
    assert first_match("a/b.py", ["x/**", "a/*", "a/**"]) == "a/*"
    assert first_match("q.py", ["x/**"]) is None
