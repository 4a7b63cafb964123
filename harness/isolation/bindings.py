"""Which names in a Python module are bound by imports, scope by scope, so a rule can tell `F.silu = f`
(patching torch) from `self.silu = f` (the module's own state)."""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


@dataclass(frozen=True)
class Origin:
    """Where an imported name comes from."""

    dotted: str  # e.g. "torch.nn.functional" or "os.environ"
    is_module: bool  # bound by `import x` (certainly a module) rather than `from x import y`
    foreign: bool  # from another package, not the model's own code


@dataclass
class Scope:
    imports: dict[str, Origin] = field(default_factory=dict)
    others: set[str] = field(default_factory=set)  # names bound any other way (assignment, parameter, def)
    is_class: bool = False


def _is_own(module: str, own_packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in own_packages)


def _bind_import(scope: Scope, node: ast.Import | ast.ImportFrom, own: tuple[str, ...]) -> None:
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.asname:
                scope.imports[alias.asname] = Origin(alias.name, True, not _is_own(alias.name, own))
            else:
                root = alias.name.split(".")[0]
                scope.imports[root] = Origin(root, True, not _is_own(alias.name, own))
        return
    relative = node.level > 0
    base = node.module or ""
    for alias in node.names:
        if alias.name == "*":
            continue
        dotted = f"{base}.{alias.name}" if base else alias.name
        foreign = not relative and not _is_own(dotted, own)
        scope.imports[alias.asname or alias.name] = Origin(("." * node.level) + dotted, False, foreign)


def _targets(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Starred):
        return _targets(node.value)
    if isinstance(node, ast.Tuple | ast.List):
        return [n for elt in node.elts for n in _targets(elt)]
    return []


_BODIES = ("body", "orelse", "finalbody", "handlers", "cases")


def _statements(body: list[ast.stmt]):
    """Every statement of one scope (through if/for/while/try/with/match), not inside nested functions or classes.
    Only statements bind names at scope level, except the walrus, whose targets are not tracked: they rarely
    shadow an import, and walking every expression would triple the time on large files."""
    stack: list[ast.AST] = list(reversed(body))
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, _SCOPES):
            continue
        for name in _BODIES:
            children = getattr(node, name, None)
            if children:
                stack.extend(reversed(children))


def collect(
    body: list[ast.stmt], own: tuple[str, ...], args: ast.arguments | None = None, is_class: bool = False
) -> Scope:
    scope = Scope(is_class=is_class)
    if args is not None:
        every = [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
        scope.others.update(a.arg for a in every if a is not None)
    for node in _statements(body):
        if isinstance(node, ast.Import | ast.ImportFrom):
            _bind_import(scope, node, own)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            scope.others.add(node.name)
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                scope.others.update(_targets(t))
        elif isinstance(node, ast.AugAssign | ast.AnnAssign | ast.For | ast.AsyncFor):
            scope.others.update(_targets(node.target))
        elif isinstance(node, ast.With | ast.AsyncWith):
            for item in node.items:
                if item.optional_vars is not None:
                    scope.others.update(_targets(item.optional_vars))
        elif isinstance(node, ast.ExceptHandler) and node.name:
            scope.others.add(node.name)
    return scope


def resolve(name: str, stack: list[Scope]) -> Origin | None:
    """The import a name refers to at this point, or None when it is local, a builtin, or unknown."""
    innermost = len(stack) - 1
    for i in range(innermost, -1, -1):
        scope = stack[i]
        # Class bodies are not enclosing scopes for the functions inside them (Python's rule).
        if scope.is_class and i != innermost:
            continue
        # Imports first: `try: import x` / `except ImportError: x = None` binds x twice, and it is still the
        # import that a later `x.attr = ...` patches.
        if name in scope.imports:
            return scope.imports[name]
        if name in scope.others:
            return None
    return None


def chain(expr: ast.AST) -> tuple[str, list[str]] | None:
    """(root name, attribute names) of `a.b.c`, or None for anything but a plain dotted name."""
    attrs: list[str] = []
    while isinstance(expr, ast.Attribute):
        attrs.append(expr.attr)
        expr = expr.value
    if isinstance(expr, ast.Name):
        return expr.id, list(reversed(attrs))
    return None


def root_name(expr: ast.AST) -> str | None:
    """The name at the bottom of `a.b[0].c`, through attributes, subscripts and calls' receivers."""
    while isinstance(expr, ast.Attribute | ast.Subscript | ast.Starred):
        expr = expr.value
    return expr.id if isinstance(expr, ast.Name) else None
