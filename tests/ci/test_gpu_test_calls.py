"""The GPU tests call the project's functions as those functions now are.

CI has no GPU, so the `gpu`-marked tests never run there, and a signature change that misses one of their calls
surfaces only on a GPU machine, where device time is scarce (the KDA step's timing tests kept passing the plan's
overrides by position after the op began taking them by keyword, and failed on the next H200). Here every call a
GPU test module makes to a function of the project's packages, by module attribute (`kda_step_op.decode_step(...)`)
or by imported name, is bound to that function's signature, on the CPU.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from harness.isolation import bindings

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("k3_decode", "harness", "benchmarks")  # the project's own code; a test's own helpers are not bound here
GPU_MARK = "pytest.mark.gpu"
CLASS_LEVEL = (classmethod, staticmethod)  # what `Class.name(...)` calls without an instance


def gpu_test_modules() -> list[Path]:
    here = Path(__file__).resolve()
    return sorted(p for p in (ROOT / "tests").rglob("test_*.py") if p != here and GPU_MARK in p.read_text())


def imported_names(tree: ast.Module) -> dict[str, object]:
    """The names a test module binds at module level by importing from the project's packages (the isolation
    rules' own import bindings), resolved to their objects: a module, or what `from module import name` binds."""
    imports = bindings.collect(tree.body, PACKAGES).imports
    return {name: _load(origin) for name, origin in imports.items() if not origin.foreign}


def _load(origin: bindings.Origin) -> object:
    if origin.is_module:
        return importlib.import_module(origin.dotted)
    module, _, attr = origin.dotted.rpartition(".")
    value = getattr(importlib.import_module(module), attr, None)
    return importlib.import_module(origin.dotted) if value is None else value  # a submodule imported by name


def _callee(func: ast.expr, names: dict[str, object]) -> tuple[str, Callable] | None:
    """The project callable a call's target names, if it names one: a function or a class by name (`name(...)`), a
    module's function or class (`module.name(...)`), or a class's classmethod or staticmethod (`Class.name(...)`)."""
    target: object = None
    if isinstance(func, ast.Name):
        name, target = func.id, names.get(func.id)
    elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        owner, name = names.get(func.value.id), f"{func.value.id}.{func.attr}"
        if isinstance(owner, ModuleType):
            target = getattr(owner, func.attr, None)
        elif inspect.isclass(owner) and isinstance(inspect.getattr_static(owner, func.attr, None), CLASS_LEVEL):
            return name, getattr(owner, func.attr)
    return (name, target) if inspect.isfunction(target) or inspect.isclass(target) else None


def call_problems(source: str, label: str) -> tuple[int, list[str]]:
    """(calls bound, problems): each call to a project function that does not bind to its signature, with where it
    is and why. A call spreading `*args` is not bound; one spreading `**kwargs` is bound partially (its positional
    arguments and named keywords must still fit)."""
    tree = ast.parse(source)
    names = imported_names(tree)
    bound, problems = 0, []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        callee = _callee(node.func, names)
        if callee is None or any(isinstance(a, ast.Starred) for a in node.args):
            continue
        name, function = callee
        signature = inspect.signature(function)
        args = [object()] * len(node.args)
        kwargs = {kw.arg: object() for kw in node.keywords if kw.arg is not None}
        spread = any(kw.arg is None for kw in node.keywords)
        try:
            (signature.bind_partial if spread else signature.bind)(*args, **kwargs)
        except TypeError as exc:
            problems.append(f"{label}:{node.lineno}: {name}{signature}: {exc}")
        bound += 1
    return bound, problems


@pytest.mark.parametrize("path", gpu_test_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_gpu_test_call_binds_to_the_function_it_calls(path: Path):
    _, problems = call_problems(path.read_text(), str(path.relative_to(ROOT)))
    assert problems == [], "\n".join(problems)


def test_the_gpu_tests_are_found_and_their_calls_bound():
    """The scan is not empty: the GPU test modules are found, and the KDA step's calls among the bound ones."""
    modules = gpu_test_modules()
    assert ROOT / "tests/k3_decode/kernels/test_kda_step_gpu.py" in modules and len(modules) >= 15
    bound, _ = call_problems((ROOT / "tests/k3_decode/kernels/test_kda_step_gpu.py").read_text(), "step")
    assert bound >= 10


def test_a_call_with_the_plans_overrides_by_position_is_caught():
    """Broken case: the KDA step's timing call as it was before the op took its overrides by keyword, a call
    missing the op's cache and slots, and a classmethod given a keyword it does not take are caught; the fixed
    call and the plans with overrides they take bind."""
    source = (
        "from k3_decode.kernels import kda_step_op\n"
        "kda_step_op.decode_step(spec, w, packed, cache, slots, out, cluster, resident, warm, group)\n"
        "kda_step_op.plan_for(spec, packed, slots, cluster=2)\n"
        "kda_step_op.decode_step(spec, w, packed, cache, slots, out, **choice)\n"
        "kda_step_op.decode_step(spec, w, packed)\n"
        "from k3_decode.kernels.kda_step_plan import KdaStepPlan\n"
        "KdaStepPlan.for_shape(12, 6288, 1, warps=3)\n"
        "KdaStepPlan.for_shape(12, 6288, 1, wide_warps=True)\n"
    )
    bound, problems = call_problems(source, "t.py")
    assert bound == 6
    assert [p.split(": ")[0] for p in problems] == ["t.py:2", "t.py:5", "t.py:7"], problems
    assert "too many positional arguments" in problems[0] and "missing a required argument" in problems[1]
    assert "unexpected keyword argument 'warps'" in problems[2]
