"""Static hygiene checks on a model's changed Python files: what the code does to the rest of the process.

Each rule is about a way a fast-path change can reach outside its model without touching another file:
patching another module's objects, registering into a global registry on import, swallowing errors so that a
broken fast path falls back unseen, and reading the environment to switch numerics without a reviewer knowing.
The checks are static, so they see what the code says, not what it does at run time; the runtime audit
(hashing state before and after a step) is the other half of isolation.
"""

from __future__ import annotations

import ast
import tomllib
from dataclasses import dataclass
from fnmatch import fnmatchcase
from functools import cache
from importlib import resources

from harness.isolation.bindings import Origin, Scope, chain, collect, resolve, root_name
from harness.isolation.scope import CodeScope

MONKEYPATCH = "monkeypatch"
IMPORT_REGISTRY = "import-time-registry"
BROAD_EXCEPT = "broad-except-fallback"
ENV_SWITCH = "env-switch"
UNPARSEABLE = "unparseable"

RULES: dict[str, str] = {
    MONKEYPATCH: "model code may not change another module's objects (attribute or item assignment, "
    "setattr/delattr, in-place mutation)",
    IMPORT_REGISTRY: "importing model code may not register anything into a process-wide registry",
    BROAD_EXCEPT: "a handler for Exception, BaseException or a bare except must re-raise, never fall back silently",
    ENV_SWITCH: "an environment variable read by model code (a switch that may change numerics) must be declared, "
    "with a reason, in the scope file",
    UNPARSEABLE: "model Python code must parse, or none of the other rules can be checked",
}

_SCOPE_NODES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


@dataclass(frozen=True)
class HygieneRules:
    registry_calls: tuple[str, ...]
    mutating_methods: frozenset[str]
    attribute_setters: frozenset[str]
    broad_exceptions: frozenset[str]
    suppressors: frozenset[str]
    env_mappings: frozenset[str]
    env_getters: frozenset[str]


@cache
def default_rules() -> HygieneRules:
    raw = tomllib.loads(resources.files("harness.isolation").joinpath("rules.toml").read_text())
    return HygieneRules(
        registry_calls=tuple(raw["registry_calls"]),
        mutating_methods=frozenset(raw["mutating_methods"]),
        attribute_setters=frozenset(raw["attribute_setters"]),
        broad_exceptions=frozenset(raw["broad_exceptions"]),
        suppressors=frozenset(raw["suppressors"]),
        env_mappings=frozenset(raw["env_mappings"]),
        env_getters=frozenset(raw["env_getters"]),
    )


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    rule: str
    message: str
    accepted: str = ""  # the scope file's reason when a reviewer declared this (an env switch, a registration)

    def text(self) -> str:
        note = f" (declared in the scope: {self.accepted})" if self.accepted else ""
        return f"{self.path}:{self.line}: [{self.rule}] {self.message}{note}"

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"path": self.path, "line": self.line, "rule": self.rule, "message": self.message}
        if self.accepted:
            out["accepted"] = self.accepted
        return out


def _is_main_guard(test: ast.expr) -> bool:
    return (
        isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Name)
        and test.left.id == "__name__"
        and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in test.comparators)
    )


def _str_arg(node: ast.Call | ast.Subscript | ast.Compare) -> str:
    if isinstance(node, ast.Call):
        value = node.args[0] if node.args else None
    elif isinstance(node, ast.Subscript):
        value = node.slice
    else:
        value = node.left
    return value.value if isinstance(value, ast.Constant) and isinstance(value.value, str) else ""


class _Checker(ast.NodeVisitor):
    def __init__(self, path: str, scope: CodeScope, rules: HygieneRules) -> None:
        self.path = path
        self.scope = scope
        self.rules = rules
        self.own = scope.model_packages()
        self.stack: list[Scope] = []
        self.import_time = True
        self.findings: list[Finding] = []
        self.handled: set[int] = set()  # env-mapping nodes already reported through a more specific pattern
        self.registering_functions: dict[str, str] = {}  # module-level function -> registry call it makes

    # -- helpers ------------------------------------------------------------------------------------------
    def _add(self, node: ast.AST, rule: str, message: str, accepted: str = "") -> None:
        self.findings.append(Finding(self.path, getattr(node, "lineno", 0), rule, message, accepted))

    def _resolve(self, expr: ast.AST) -> tuple[Origin, str, list[str]] | None:
        parts = chain(expr)
        if parts is None:
            return None
        origin = resolve(parts[0], self.stack)
        if origin is None:
            return None
        return origin, ".".join([origin.dotted, *parts[1]]), parts[1]

    def _foreign_root(self, expr: ast.AST) -> Origin | None:
        name = root_name(expr)
        origin = resolve(name, self.stack) if name else None
        return origin if origin is not None and origin.foreign else None

    def _is_builtin(self, name: str) -> bool:
        return all(name not in s.imports and name not in s.others for s in self.stack)

    def _env_read(self, node: ast.AST, variable: str) -> None:
        if variable:
            why = self.scope.env.get(variable, "")
            undeclared = "" if why else ", which the scope file does not declare"
            self._add(node, ENV_SWITCH, f"reads environment variable {variable}{undeclared}", why)
        else:
            self._add(
                node,
                ENV_SWITCH,
                "reads the environment by a computed name or as a whole mapping, which no declaration can cover",
            )

    def _env_module_variable(self, full: str) -> str | None:
        for module in self.scope.env_modules:
            if full.startswith(module + "."):
                return full[len(module) + 1 :].split(".")[0]
        return None

    # -- scopes -------------------------------------------------------------------------------------------
    def visit_Module(self, node: ast.Module) -> None:
        self.stack.append(collect(node.body, self.own))
        self.registering_functions = self._registering_functions(node)
        for stmt in node.body:
            self.visit(stmt)
        self.stack.pop()

    def _registering_functions(self, module: ast.Module) -> dict[str, str]:
        """Module-level functions that, when called, register into a foreign registry (directly or through
        another such function), so `_setup()` at the top level is caught like the call inside it."""
        direct: dict[str, str] = {}
        calls: dict[str, set[str]] = {}
        for fn in module.body:
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            self.stack.append(collect(fn.body, self.own, fn.args))
            calls[fn.name] = set()
            for sub in ast.walk(fn):
                if not isinstance(sub, ast.Call):
                    continue
                resolved = self._resolve(sub.func)
                if resolved and resolved[0].foreign and self._is_registry(resolved[1]):
                    direct.setdefault(fn.name, resolved[1])
                elif isinstance(sub.func, ast.Name):
                    calls[fn.name].add(sub.func.id)
            self.stack.pop()
        changed = True
        while changed:
            changed = False
            for name, callees in calls.items():
                if name in direct:
                    continue
                hit = next((c for c in sorted(callees) if c in direct), None)
                if hit is not None:
                    direct[name] = f"{hit}() -> {direct[hit]}"
                    changed = True
        return direct

    def _visit_decorators(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> None:
        for dec in node.decorator_list:
            if self.import_time and not isinstance(dec, ast.Call):
                resolved = self._resolve(dec)
                if resolved and resolved[0].foreign and self._is_registry(resolved[1]):
                    why = self._registration_reason(resolved[1])
                    self._add(dec, IMPORT_REGISTRY, f"decorator {resolved[1]} registers {node.name} on import", why)
            self.visit(dec)

    def _visit_function(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        if not isinstance(node, ast.Lambda):
            self._visit_decorators(node)
            if node.returns is not None:
                self.visit(node.returns)
        for default in [*node.args.defaults, *(d for d in node.args.kw_defaults if d is not None)]:
            self.visit(default)
        body = node.body if isinstance(node.body, list) else [ast.Expr(node.body)]
        outer = self.import_time
        self.stack.append(collect(body, self.own, node.args))
        self.import_time = False
        for stmt in body:
            self.visit(stmt)
        self.stack.pop()
        self.import_time = outer

    visit_FunctionDef = _visit_function
    visit_AsyncFunctionDef = _visit_function
    visit_Lambda = _visit_function

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._visit_decorators(node)
        for expr in [*node.bases, *node.keywords]:
            self.visit(expr)
        self.stack.append(collect(node.body, self.own, is_class=True))
        for stmt in node.body:
            self.visit(stmt)
        self.stack.pop()

    def visit_If(self, node: ast.If) -> None:
        if self.import_time and len(self.stack) == 1 and _is_main_guard(node.test):
            return  # runs only as a script, never on import
        self.generic_visit(node)

    # -- monkeypatching -----------------------------------------------------------------------------------
    def _check_store(self, target: ast.AST) -> None:
        if isinstance(target, ast.Tuple | ast.List):
            for elt in target.elts:
                self._check_store(elt)
            return
        if isinstance(target, ast.Starred):
            self._check_store(target.value)
            return
        if not isinstance(target, ast.Attribute | ast.Subscript):
            return
        origin = self._foreign_root(target)
        if origin is None:
            return
        what = ast.unparse(target)
        base = self._resolve(target.value)
        if isinstance(target, ast.Subscript) and base and base[1] in self.rules.env_mappings:
            self.handled.add(id(target.value))
            self._add(target, MONKEYPATCH, f"writes {what}: changes the process environment for every module")
        else:
            self._add(target, MONKEYPATCH, f"assigns {what}, which belongs to imported {origin.dotted}")

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            self._check_store(target)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._check_store(node.target)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self._check_store(node.target)
        self.generic_visit(node)

    def visit_Delete(self, node: ast.Delete) -> None:
        for target in node.targets:
            self._check_store(target)
        self.generic_visit(node)

    # -- calls --------------------------------------------------------------------------------------------
    def _is_registry(self, full: str) -> bool:
        return any(fnmatchcase(full, p) for p in self.rules.registry_calls)

    def _registration_reason(self, full: str) -> str:
        return next((why for pattern, why in self.scope.registrations.items() if fnmatchcase(full, pattern)), "")

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Name) and func.id in self.rules.attribute_setters and self._is_builtin(func.id):
            origin = self._foreign_root(node.args[0]) if node.args else None
            if origin is not None:
                self._add(node, MONKEYPATCH, f"{func.id}() on {ast.unparse(node.args[0])}, from {origin.dotted}")
        resolved = self._resolve(func)
        if resolved and resolved[0].foreign:
            self._check_foreign_call(node, *resolved)
        elif self.import_time and isinstance(func, ast.Name) and self._module_function(func.id):
            via = self.registering_functions[func.id]
            self._add(node, IMPORT_REGISTRY, f"calls {func.id}() on import, which registers via {via}")
        self.generic_visit(node)

    def _check_foreign_call(self, node: ast.Call, origin: Origin, full: str, attrs: list[str]) -> None:
        func = node.func
        if full in self.rules.env_getters:
            self.handled.add(id(func))
            if isinstance(func, ast.Attribute):
                self.handled.add(id(func.value))
            self._env_read(node, _str_arg(node))
        receiver_is_module = not attrs or (isinstance(func, ast.Attribute) and self._is_module_name(func.value))
        if attrs and attrs[-1] in self.rules.mutating_methods and not receiver_is_module:
            receiver = ast.unparse(func.value) if isinstance(func, ast.Attribute) else full
            self._add(node, MONKEYPATCH, f"calls {receiver}.{attrs[-1]}(), changing an object of {origin.dotted}")
        if self.import_time and self._is_registry(full):
            self._add(node, IMPORT_REGISTRY, f"calls {full}() on import", self._registration_reason(full))

    def _module_function(self, name: str) -> bool:
        """Whether a call at import time reaches a module-level function that registers something."""
        shadowed = any(name in s.others or name in s.imports for s in self.stack[1:])
        return name in self.registering_functions and name in self.stack[0].others and not shadowed

    def _is_module_name(self, expr: ast.AST) -> bool:
        if not isinstance(expr, ast.Name):
            return False
        origin = resolve(expr.id, self.stack)
        return origin is not None and origin.is_module

    # -- environment --------------------------------------------------------------------------------------
    def visit_Subscript(self, node: ast.Subscript) -> None:
        if isinstance(node.ctx, ast.Load):
            resolved = self._resolve(node.value)
            if resolved and resolved[0].foreign and resolved[1] in self.rules.env_mappings:
                self.handled.add(id(node.value))
                self._env_read(node, _str_arg(node))
        self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> None:
        for op, right in zip(node.ops, node.comparators, strict=True):
            resolved = self._resolve(right) if isinstance(op, ast.In | ast.NotIn) else None
            if resolved and resolved[0].foreign and resolved[1] in self.rules.env_mappings:
                self.handled.add(id(right))
                self._env_read(node, _str_arg(node))
        self.generic_visit(node)

    def _check_load(self, node: ast.Attribute | ast.Name) -> bool:
        """Report an environment read by a dotted name; True when the name was one (do not descend)."""
        if not isinstance(node.ctx, ast.Load) or id(node) in self.handled:
            return id(node) in self.handled
        resolved = self._resolve(node)
        if not resolved or not resolved[0].foreign:
            return False
        variable = self._env_module_variable(resolved[1])
        if variable is not None:
            self._env_read(node, variable)
            return True
        if resolved[1] in self.rules.env_mappings:
            self._env_read(node, "")
            return True
        return False

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if not self._check_load(node):
            self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        self._check_load(node)

    # -- error handling -----------------------------------------------------------------------------------
    def _broad(self, expr: ast.expr | None) -> str | None:
        if expr is None:
            return "a bare except"
        if isinstance(expr, ast.Tuple):
            return next((b for e in expr.elts if (b := self._broad(e))), None)
        if isinstance(expr, ast.Name) and self._is_builtin(expr.id) and expr.id in self.rules.broad_exceptions:
            return expr.id
        resolved = self._resolve(expr)
        if resolved and resolved[1] in self.rules.broad_exceptions:
            return resolved[1]
        return None

    def _visit_try(self, node: ast.Try | ast.TryStar) -> None:
        for handler in node.handlers:
            broad = self._broad(handler.type)
            if broad and not _reraises(handler.body):
                self._add(
                    handler,
                    BROAD_EXCEPT,
                    f"{broad} around the block at line {node.lineno} swallows every error and does not re-raise: "
                    "a failing fast path would fall back silently",
                )
        self.generic_visit(node)

    visit_Try = _visit_try
    visit_TryStar = _visit_try

    def visit_With(self, node: ast.With | ast.AsyncWith) -> None:
        for item in node.items:
            call = item.context_expr
            if not isinstance(call, ast.Call):
                continue
            resolved = self._resolve(call.func)
            if resolved and resolved[1] in self.rules.suppressors:
                broad = next((b for a in call.args if (b := self._broad(a))), None)
                if broad:
                    self._add(call, BROAD_EXCEPT, f"{resolved[1]}({broad}) swallows every error of its block")
        self.generic_visit(node)

    visit_AsyncWith = visit_With


def _reraises(body: list[ast.stmt]) -> bool:
    stack: list[ast.AST] = list(body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Raise):
            return True
        if not isinstance(node, _SCOPE_NODES):
            stack.extend(ast.iter_child_nodes(node))
    return False


def check_source(path: str, text: str, scope: CodeScope, rules: HygieneRules | None = None) -> list[Finding]:
    """Every finding in one file, those the scope declares included (marked `accepted`)."""
    try:
        tree = ast.parse(text, filename=path)
    except SyntaxError as exc:
        return [Finding(path, exc.lineno or 0, UNPARSEABLE, f"does not parse: {exc.msg}")]
    checker = _Checker(path, scope, rules or default_rules())
    checker.visit(tree)
    return sorted(set(checker.findings), key=lambda f: (f.line, f.rule, f.message))
