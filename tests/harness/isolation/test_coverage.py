"""Line coverage of a subject's specialized modules: measured while a block runs, held to the scope's floor, and
NOT_RUN with the reason — never a pass — when there is nothing to measure or it cannot be measured here."""

from __future__ import annotations

import importlib
import sys

import pytest

from harness.isolation import coverage
from harness.isolation.coverage import CoverageScopeError, matching_files, measure, parse

KERNEL = """def launch(x):
    if x > 0:
        return x
    return -x


def unused():
    return 0
"""


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A folder with a package `pkgcov` whose kernels/ holds one module, importable from the test."""
    kernels = tmp_path / "pkgcov" / "kernels"
    kernels.mkdir(parents=True)
    (tmp_path / "pkgcov" / "__init__.py").write_text("")
    (kernels / "__init__.py").write_text("")
    (kernels / "fused.py").write_text(KERNEL)
    (tmp_path / "pkgcov" / "stock.py").write_text("def f():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("pkgcov")]:
        del sys.modules[name]


def _scope(floor: float = 0.5, modules: tuple[str, ...] = ("pkgcov/kernels/**/*.py",)):
    return parse({"modules": list(modules), "floor": floor, "why": "kernels run under the suite"}, "test")


def test_only_files_matching_the_globs_count(repo):
    assert matching_files(_scope(), repo) == ["pkgcov/kernels/__init__.py", "pkgcov/kernels/fused.py"]
    assert matching_files(_scope(modules=("pkgcov/*.py",)), repo) == ["pkgcov/__init__.py", "pkgcov/stock.py"]


def test_coverage_above_the_floor_passes_and_below_it_fails(repo):
    with measure(_scope(floor=0.5), repo, "the test") as result:
        importlib.import_module("pkgcov.kernels.fused").launch(1)
    check = result.check()
    assert check is not None and check.passed and result.not_run_item() is None
    # Imported while measured: the def lines and the taken branch ran; `return -x` and unused's body did not.
    assert check.value == pytest.approx(4 / 6, abs=1e-4)
    assert "pkgcov/kernels/fused.py 4/6 (missed lines 4,8)" in check.detail
    strict = coverage.CoverageResult(_scope(floor=0.9), "the test", result.files)
    failed = strict.check()
    assert failed is not None and not failed.passed and failed.name.startswith("line coverage of the specialized")


def test_a_module_that_never_ran_counts_as_uncovered(repo):
    with measure(_scope(), repo, "the test") as result:
        pass
    check = result.check()
    assert check is not None and check.value == 0.0 and not check.passed


def test_no_matching_module_is_not_run_never_a_pass(repo):
    with measure(_scope(modules=("pkgcov/specialized/**/*.py",)), repo, "the test") as result:
        pass
    assert result.check() is None
    item = result.not_run_item()
    assert item is not None and item.reason.startswith("no file matches pkgcov/specialized/**/*.py")


def test_files_without_statements_are_not_run(repo):
    with measure(_scope(modules=("pkgcov/kernels/__init__.py",)), repo, "the test") as result:
        pass
    assert result.check() is None
    item = result.not_run_item()
    assert item is not None and "hold no statements" in item.reason


def test_another_active_tracer_is_not_run(repo):
    def tracer(frame, event, arg):
        return None

    sys.settrace(tracer)
    try:
        with measure(_scope(), repo, "the test") as result:
            pass
    finally:
        sys.settrace(None)
    item = result.not_run_item()
    assert item is not None and "another tracer" in item.reason and result.check() is None


def test_coverage_py_missing_is_not_run(repo, monkeypatch):
    monkeypatch.setitem(sys.modules, "coverage", None)  # import coverage now raises ImportError
    with measure(_scope(), repo, "the test") as result:
        pass
    item = result.not_run_item()
    assert item is not None and item.reason.startswith("coverage.py is not installed here")


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ([], "is not a table"),
        ({"modules": ["a/**"], "floor": 0.9}, r"isolation.coverage.why: is missing"),
        ({"modules": ["a/**"], "floor": 0.9, "why": "x", "extra": 1}, "extra: is not a key"),
        ({"modules": [], "floor": 0.9, "why": "x"}, "is not a non-empty list of globs"),
        ({"modules": ["/abs/**"], "floor": 0.9, "why": "x"}, "must be a non-empty path relative"),
        ({"modules": ["a/**"], "floor": 0, "why": "x"}, r"floor: 0 is not a fraction in \(0, 1\]"),
        ({"modules": ["a/**"], "floor": True, "why": "x"}, "floor: True is not a fraction"),
        ({"modules": ["a/**"], "floor": 0.9, "why": " "}, "why: is empty"),
        ({"modules": ["a/**"], "floor": 0.9, "why": "x", "exclude": ["a/b.py"]}, "exclude: .* is not a table"),
        ({"modules": ["a/**"], "floor": 0.9, "why": "x", "exclude": {"a/b.py": ""}}, "exclude: .* is not a table"),
    ],
)
def test_a_malformed_table_is_a_one_line_error(table, message):
    with pytest.raises(CoverageScopeError, match=message):
        parse(table, "test")


def test_excluded_files_are_not_measured_and_the_reason_is_said(repo):
    table = {"modules": ["pkgcov/kernels/**"], "floor": 0.9, "why": "w", "exclude": {"pkgcov/kernels/f*.py": "why"}}
    scope = parse(table, "test")
    assert matching_files(scope, repo) == ["pkgcov/kernels/__init__.py"]
    table["exclude"] = {"pkgcov/kernels/*.py": "compiled only"}
    with measure(parse(table, "test"), repo, "the test") as result:
        pass
    item = result.not_run_item()
    assert item is not None and "not measured: pkgcov/kernels/*.py: compiled only" in item.reason


def test_the_shipped_k3_hopper_table_measures_the_kernels_only_where_they_can_run(monkeypatch):
    from pathlib import Path

    from k3_decode import subject
    from k3_decode.kernels import providers

    root = Path(__file__).resolve().parents[3]
    monkeypatch.setattr(providers, "not_built_reason", lambda: None)  # as on an H200 with CuTe DSL
    scope = parse(subject.K3_HOPPER.coverage_scope(), "k3-hopper")
    assert scope.modules == ("k3_decode/kernels/**/*.py",) and 0 < scope.floor <= 1
    assert all(why.strip() for why in scope.exclude.values())
    measured = matching_files(scope, root)
    # The registered kernels are measured; the build tooling is not, with its reason.
    assert {
        "k3_decode/kernels/attn_res.py",
        "k3_decode/kernels/kda_in_proj.py",
        "k3_decode/kernels/kda_step.py",
        "k3_decode/kernels/kda_o_proj.py",
        "k3_decode/kernels/providers.py",
    } <= set(measured)
    assert not any(m.endswith("builds.py") for m in measured)
    # Where they cannot run, every kernel module is excluded with the machine's reason: nothing matches (NOT_RUN).
    monkeypatch.setattr(providers, "not_built_reason", lambda: "no CUDA device (test)")
    off = parse(subject.K3_HOPPER.coverage_scope(), "k3-hopper")
    assert matching_files(off, root) == [] and "cannot run on this machine (no CUDA device (test))" in "".join(
        off.exclude.values()
    )
    assert "coverage" not in subject.K3_HOPPER.code_scope()  # the static code scope does not see the runtime's table
