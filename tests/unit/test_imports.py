"""The package's imports, read from its source: no cycle, and few imports inside functions.

The graph counts every import that runs: at module level and inside functions (not those
under ``if TYPE_CHECKING:``). An import inside a function is kept only where it must be
(an optional dependency, Django's app registry, a module Celery loads on every start),
each with a ``#`` comment giving the reason on its line or the line above.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from celery import Task

from celery_fenced import roles
from celery_fenced.backends import FencedDatabaseBackend
from celery_fenced.execution import FencedExecution, FencedTask

PACKAGE = Path(__file__).resolve().parents[2] / "celery_fenced"
#: imports inside functions the package may keep, each with its reason
MOST_IN_FUNCTIONS = 10


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    line: int
    targets: tuple[str, ...]  # the package's modules it loads
    in_function: bool


@functools.cache
def module_names() -> dict[str, Path]:
    names = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if "migrations" in path.parts:
            continue
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def targets(
    node: ast.Import | ast.ImportFrom, module: str, path: Path, known: set[str]
) -> Iterator[str]:
    """The package's modules ``node`` loads: ``from a import b`` loads ``a.b`` when that is a
    module, else ``a``."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names if alias.name in known)
        return
    base = node.module or ""
    if node.level:
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        package = package[: len(package) - node.level + 1]
        base = ".".join([*package, base] if base else package)
    for alias in node.names:
        name = f"{base}.{alias.name}"
        if name in known:
            yield name
        elif base in known:
            yield base


def is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def visit(node: ast.AST, in_function: bool, module: str, path: Path) -> Iterator[Import]:
    if isinstance(node, ast.If) and is_type_checking(node):
        for child in node.orelse:
            yield from visit(child, in_function, module, path)
        return
    if isinstance(node, ast.Import | ast.ImportFrom):
        loads = tuple(targets(node, module, path, set(module_names())))
        yield Import(module, node.lineno, loads, in_function)
    inside = in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    for child in ast.iter_child_nodes(node):
        yield from visit(child, inside, module, path)


def imports() -> Iterator[tuple[Import, list[str]]]:
    """Every import that runs, with its module's source lines."""
    for module, path in module_names().items():
        source = path.read_text()
        lines = source.splitlines()
        for found in visit(ast.parse(source), False, module, path):
            yield found, lines


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (its modules in order), or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := walk(nxt)) is not None:
                return found
        state[node] = "done"
        stack.pop()
        return None

    for start in sorted(graph):
        if start not in state and (found := walk(start)) is not None:
            return found
    return None


def has_reason(lines: list[str], line: int) -> bool:
    own, above = lines[line - 1], lines[line - 2].strip() if line > 1 else ""
    return "#" in own or above.startswith("#")


def test_imports__no_cycle_counting_those_in_functions() -> None:
    graph: dict[str, set[str]] = {}
    for found, _ in imports():
        graph.setdefault(found.module, set()).update(t for t in found.targets if t != found.module)
    assert cycle(graph) is None


def test_imports__few_in_functions_each_with_its_reason() -> None:
    inside = [(found, lines) for found, lines in imports() if found.in_function]
    unexplained = [f"{f.module}:{f.line}" for f, lines in inside if not has_reason(lines, f.line)]
    assert len(inside) <= MOST_IN_FUNCTIONS, [f"{f.module}:{f.line}" for f, _ in inside]
    assert unexplained == []


def test_cycle__found_in_a_graph_that_has_one() -> None:
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": {"c"}, "d": {"a", "c"}}) is None


@pytest.mark.parametrize(
    ("task", "fenced"),
    [(FencedTask(), True), (type("Plain", (Task,), {})(), False), (object(), False)],
)
def test_is_fenced_task__as_isinstance_of_the_execution(task: object, fenced: bool) -> None:
    assert roles.is_fenced_task(task) is fenced is isinstance(task, FencedExecution)


@pytest.mark.parametrize(
    ("backend", "fenced"),
    [
        (FencedDatabaseBackend, True),
        (type("Peer", (FencedDatabaseBackend,), {}), True),
        (object, False),
        (object(), False),
    ],
)
def test_is_fenced_backend__as_issubclass_of_the_backend(backend: object, fenced: bool) -> None:
    assert roles.is_fenced_backend(backend) is fenced


def test_names_imported_on_first_use__looked_up_once_then_kept() -> None:
    """``celery_fenced.acquire`` and the other names imported on first use are found
    through the module's ``__getattr__`` once, then as plain attributes of the package."""
    import celery_fenced
    from celery_fenced import store

    for name in ("acquire", "force_release", "HeldLease"):
        celery_fenced.__dict__.pop(name, None)
        assert getattr(celery_fenced, name) is getattr(store, name)
        assert celery_fenced.__dict__[name] is getattr(store, name)
