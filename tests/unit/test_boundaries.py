"""The package's boundaries, checked on its source: the store owns the lease tables.

- Only ``celery_fenced.store`` imports its dialects (the SQL of each database).
- Only the store writes the lease tables: outside it, the modules that import the lease
  models (the read side: the operations API, the admin, the timeline) make no call that
  writes or locks rows.
- Nothing outside the store sets a ``HeldLease``'s state: no assignment to a lease's
  attributes, no private attribute of one read.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "celery_fenced"
STORE = PACKAGE / "store"
#: ORM calls that write or lock rows (``update`` is checked on query chains only); the SQL
#: that writes lives in the dialects, which only the store imports
WRITES = {
    "bulk_create",
    "bulk_update",
    "create",
    "delete",
    "get_or_create",
    "raw",
    "select_for_update",
    "update_or_create",
}
QUERY_CHAIN = {"objects", "_default_manager", "using", "filter", "exclude", "all"}
HELD_STATE = {"released", "expires_at", "token", "key", "owner", "alias", "ttl", "delivery"}


def modules(outside_store: bool = True) -> Iterator[tuple[str, ast.Module]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        if "migrations" in path.parts or (outside_store and STORE in path.parents):
            continue
        yield str(path.relative_to(PACKAGE.parent)), ast.parse(path.read_text())


def imported(tree: ast.Module) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def chain_names(node: ast.expr) -> set[str]:
    """The attribute and call names of a chain like ``Lease.objects.using(a).filter()``."""
    names: set[str] = set()
    while True:
        if isinstance(node, ast.Call):
            node = node.func
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
            node = node.value
        else:
            return names


def test_only_the_store_imports_its_dialects() -> None:
    offenders = [
        (name, module)
        for name, tree in modules()
        for module in imported(tree)
        if module.startswith("celery_fenced.store.dialects")
        or module == "celery_fenced.store.dialects"
        or module.endswith("store.dialects")
    ]
    assert offenders == []


def test_outside_the_store_nothing_writes_or_locks_the_lease_tables() -> None:
    offenders = []
    for name, tree in modules():
        if not any(m.startswith("celery_fenced.models") for m in imported(tree)):
            continue
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            call = node.func.attr
            receiver = chain_names(node.func.value)
            if call in WRITES or (call == "update" and receiver & QUERY_CHAIN):
                offenders.append(f"{name}:{node.lineno} .{call}()")
    assert offenders == []


def test_outside_the_store_no_held_lease_state_is_set_or_private_part_read() -> None:
    offenders = []
    for name, tree in modules():
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else []
            for target in targets:
                if (
                    isinstance(target, ast.Attribute)
                    and target.attr in HELD_STATE
                    and isinstance(target.value, ast.Name)
                    and target.value.id == "lease"
                ):
                    offenders.append(f"{name}:{node.lineno} lease.{target.attr} = …")
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("lease", "x", "held")
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and node.attr not in ("_state", "_meta")  # a model instance's, not a lease's
            ):
                offenders.append(f"{name}:{node.lineno} {node.value.id}.{node.attr}")
    assert offenders == []


@pytest.mark.parametrize(
    "rule",
    [
        test_only_the_store_imports_its_dialects,
        test_outside_the_store_nothing_writes_or_locks_the_lease_tables,
        test_outside_the_store_no_held_lease_state_is_set_or_private_part_read,
    ],
)
def test_the_rules_see_a_breach(
    rule: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each rule fails on a module that breaks it (so none passes by seeing nothing)."""
    package = tmp_path / "celery_fenced"
    (package / "store").mkdir(parents=True)
    (package / "bad.py").write_text(
        "from celery_fenced.store import dialects\n"
        "from celery_fenced.models import Lease\n"
        "Lease.objects.using('default').filter(key='k').update(token=1)\n"
        "lease.released = True\n"
        "lease._confirmed_at\n"
    )
    monkeypatch.setattr(__import__(__name__, fromlist=["x"]), "PACKAGE", package)
    monkeypatch.setattr(__import__(__name__, fromlist=["x"]), "STORE", package / "store")
    with pytest.raises(AssertionError):
        rule()  # type: ignore[operator]
