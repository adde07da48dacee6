"""Security: SQL is parametrized, and a token is never taken from the message.

- Hostile keys and owners round-trip as data through every store operation, on SQLite and
  PostgreSQL; a spy on the connection sees them only among the statements' parameters.
- Statically: every f-string of SQL in the package interpolates only table names and fixed
  fragments (constants, the dialect's clock/JSON snippets, placeholders), never a runtime
  value; every raw ``execute`` gets such a string and its values separately.
- With a real worker: a token, key or lease forged in the message's headers or kwargs is
  ignored; the execution holds the token the database granted.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import connections
from django_celery_results.models import TaskResult

from celery_fenced import acquire, fenced_update, force_release
from celery_fenced.models import Lease, LeaseEvent
from devtools.workers import send, wait_for
from testproject.demo.models import Report
from tests.conftest import DATABASE_ALIASES

PACKAGE = Path(__file__).resolve().parents[2] / "celery_fenced"

HOSTILE = [
    "'); DROP TABLE demo_report; --",
    "x' OR '1'='1",
    "\\'; DELETE FROM celery_fenced_lease; --",
    "%s %(key)s %% ? $1 :key {key}",
    'ключ:漢字:🙂 " ` ; /* */',
]


@pytest.fixture
def statements(alias: str) -> Iterator[list[tuple[str, Any]]]:
    """Every statement sent on ``alias``: its SQL text and its parameters."""
    seen: list[tuple[str, Any]] = []

    def spy(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        seen.append((sql, params))
        return execute(sql, params, many, context)

    with connections[alias].execute_wrapper(spy):
        yield seen


@pytest.mark.django_db(transaction=True, databases=DATABASE_ALIASES)
@pytest.mark.parametrize("key", HOSTILE)
def test_sql__hostile_key_round_trips_as_data_through_every_operation(
    alias: str, key: str, statements: list[tuple[str, Any]]
) -> None:
    report = Report.objects.using(alias).create(name="target")
    lease = acquire(key, ttl=30, owner=key, using=alias, renew_interval=1e-6)
    lease.renew()
    lease.check()  # past its (tiny) renew interval: asks the database
    with lease.guard():
        fenced_update(Report.objects.using(alias).filter(pk=report.pk), token=1, body=key)
    assert lease.release()
    again = acquire(key, ttl=30, owner=key, using=alias)
    assert force_release(key, by=key, using=alias) == again.token == 2

    assert list(Lease.objects.using(alias).values_list("key", "owner")) == [(key, key)]
    events = LeaseEvent.objects.using(alias).order_by("id")
    assert [(e.kind, e.token) for e in events] == [("force_released", 2)]  # the anomaly
    assert {e.lease.key for e in events} == {key}
    assert {**events.last().detail, "acquired_at": None} == {"by": key, "acquired_at": None}
    assert Report.objects.using(alias).get(pk=report.pk).body == key
    tables = connections[alias].introspection.table_names()
    assert {"demo_report", Lease._meta.db_table, LeaseEvent._meta.db_table} <= set(tables)
    # the key travelled only as a parameter, never inside the SQL text
    assert statements
    assert not [sql for sql, _ in statements if key in sql]
    assert any(key in (params or ()) for _, params in statements)


# -- static: SQL text is built from fixed fragments only ----------------------------------
SQL = re.compile(r"\b(SELECT|INSERT INTO|UPDATE|DELETE FROM|WHERE|RETURNING|VALUES)\b")


class FixedSQL:
    """Decides whether an expression of one module is a fixed SQL fragment.

    For the modules outside the SQL dialects (theirs execute only statements of their
    statements modules: ``tests/unit/test_sql_as_data.py``). Fixed: constants; module
    names bound to constants or ``Model._meta.db_table``; ``self.X`` class constants
    (upper case); f-strings of fixed parts; ``a if cond else b`` of fixed parts;
    ``", ".join([fixed] * n)``; local names bound only to fixed values; calls of the
    module's own methods whose arguments are fixed and whose returns are fixed; a parameter
    every caller passes fixed.
    """

    def __init__(self, tree: ast.Module) -> None:
        self.tree = tree
        self.constants = {
            t.id
            for node in tree.body
            if isinstance(node, ast.Assign)
            for t in node.targets
            if isinstance(t, ast.Name) and self._constant_value(node.value)
        }
        self.class_constants = {
            t.id
            for cls in tree.body
            if isinstance(cls, ast.ClassDef)
            for node in cls.body
            if isinstance(node, ast.Assign | ast.AnnAssign)
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(t, ast.Name)
            and t.id.isupper()
            and (node.value is None or self._constant_value(node.value))
        }
        self.functions: dict[str, list[ast.FunctionDef]] = {}
        self.parents: dict[ast.AST, ast.FunctionDef] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef):
                self.functions.setdefault(node.name, []).append(node)
                for child in ast.walk(node):  # walked outer first: the innermost wins
                    self.parents[child] = node
        self._memo: dict[tuple[str, Any], bool] = {}

    @staticmethod
    def _constant_value(node: ast.expr) -> bool:
        if isinstance(node, ast.Constant) and isinstance(node.value, str | int | float):
            return True
        return isinstance(node, ast.Attribute) and ast.unparse(node).endswith("._meta.db_table")

    def fixed(self, node: ast.expr | None, where: ast.FunctionDef | None) -> bool:
        if node is None:
            return False
        if self._constant_value(node):
            return True
        if isinstance(node, ast.JoinedStr):
            return all(
                self.fixed(v.value, where)
                for v in node.values
                if isinstance(v, ast.FormattedValue)
            )
        if isinstance(node, ast.Name):
            return node.id in self.constants or self._name(node.id, where)
        if isinstance(node, ast.Attribute):
            return ast.unparse(node.value) == "self" and node.attr in self.class_constants
        if isinstance(node, ast.IfExp):  # a choice between fixed fragments
            return self.fixed(node.body, where) and self.fixed(node.orelse, where)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return self.fixed(node.left, where) and self.fixed(node.right, where)
        if isinstance(node, ast.Call):
            return self._call(node, where)
        return False

    def _call(self, node: ast.Call, where: ast.FunctionDef | None) -> bool:
        func = node.func
        if not isinstance(func, ast.Attribute):
            return False
        args = [*node.args, *(k.value for k in node.keywords)]
        if func.attr == "join" and isinstance(func.value, ast.Constant) and len(args) == 1:
            arg = args[0]
            return (
                isinstance(arg, ast.BinOp)
                and isinstance(arg.op, ast.Mult)
                and isinstance(arg.left, ast.List)
                and all(self.fixed(e, where) for e in arg.left.elts)
            )
        if ast.unparse(func.value) != "self" or func.attr not in self.functions:
            return False
        return all(self.fixed(a, where) for a in args) and self._returns_fixed(func.attr)

    def _returns_fixed(self, name: str) -> bool:
        memo = ("returns", name)
        if memo not in self._memo:
            self._memo[memo] = False  # a cycle is not proof
            self._memo[memo] = all(
                self.fixed(node.value, function)
                for function in self.functions[name]
                for node in ast.walk(function)
                if isinstance(node, ast.Return)
            )
        return self._memo[memo]

    def _name(self, name: str, where: ast.FunctionDef | None) -> bool:
        if where is None:
            return False
        params = [a.arg for a in where.args.args]
        if name in params:
            return self._parameter(where.name, params.index(name) - (params[:1] == ["self"]))
        values = []
        for node in ast.walk(where):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    names = target.elts if isinstance(target, ast.Tuple) else [target]
                    if any(isinstance(t, ast.Name) and t.id == name for t in names):
                        values.append(node.value)
            elif isinstance(node, ast.For | ast.comprehension) and name in {
                n.id for n in ast.walk(node.target) if isinstance(n, ast.Name)
            }:
                return False
        return bool(values) and all(self.fixed(v, where) for v in values)

    def _parameter(self, function: str, index: int) -> bool:
        """Every call of ``self.<function>`` in the module passes a fixed value there."""
        memo = ("param", (function, index))
        if memo not in self._memo:
            self._memo[memo] = False
            calls = [
                node
                for node in ast.walk(self.tree)
                if isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == function
            ]
            self._memo[memo] = bool(calls) and all(
                index < len(c.args) and self.fixed(c.args[index], self.parents.get(c))
                for c in calls
            )
        return self._memo[memo]


def sql_sources(path: Path) -> list[tuple[str, ast.expr, ast.FunctionDef | None, FixedSQL]]:
    """Every SQL f-string and every ``execute``'d SQL argument of the module at ``path``."""
    tree = ast.parse(path.read_text())
    checker = FixedSQL(tree)
    found: list[tuple[str, ast.expr, ast.FunctionDef | None, FixedSQL]] = []
    for node in ast.walk(tree):
        where = checker.parents.get(node)
        if isinstance(node, ast.JoinedStr):
            text = "".join(
                v.value
                for v in node.values
                if isinstance(v, ast.Constant) and isinstance(v.value, str)
            )
            if SQL.search(text):
                found.append((f"{path.name}:{node.lineno}", node, where, checker))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("execute", "_fetch", "_send", "raw", "extra")
            and node.args
        ):
            found.append(
                (f"{path.name}:{node.lineno} {node.func.attr}()", node.args[0], where, checker)
            )
    return found


#: the dialects that execute only their statements modules' statements, and those modules:
#: checked by ``tests/unit/test_sql_as_data.py``
STATEMENTS = PACKAGE / "store" / "dialects" / "statements"
CONVERTED = [
    PACKAGE / "store" / "dialects" / f"{name}.py"
    for name in ("sql", "sqlite", "postgresql", "mysql", "orm")
]
#: the cursor class the PostgreSQL dialect's statements run through: it executes what the
#: dialect gives it, which the checks above hold to the statements modules
PASS_THROUGH = [PACKAGE / "store" / "dialects" / "prepared.py"]
MODULES = sorted(
    p
    for p in PACKAGE.rglob("*.py")
    if "migrations" not in p.parts
    and p not in CONVERTED + PASS_THROUGH
    and STATEMENTS not in p.parents
)


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(PACKAGE)) for p in MODULES])
def test_sql__package_executes_only_fixed_sql_text(path: Path) -> None:
    runtime = [
        f"{where}: {ast.unparse(node)[:120]}"
        for where, node, function, checker in sql_sources(path)
        if not checker.fixed(node, function)
    ]
    assert runtime == []


@pytest.mark.parametrize(
    "source",
    [
        "def f(self, key):\n    return self._fetch(f\"SELECT 1 FROM t WHERE key = '{key}'\", [])",
        'def f(self, key):\n    sql = "DELETE FROM t WHERE k = " + key\n    self._fetch(sql, [])',
        'def f(self, n):\n    self._fetch(f"SELECT {self.alias} FROM t", [])',
        "def g(self, x):\n    return x\n"
        'def f(self, key):\n    self._fetch(f"SELECT {self.g(key)}", [])',
        'def f(self, key):\n    w = "" if key is None else key\n'
        '    self._fetch(f"SELECT 1 FROM t WHERE {w}", [])',
    ],
    ids=[
        "fstring-arg",
        "concatenated-arg",
        "runtime-attribute",
        "through-a-method",
        "conditional-arg",
    ],
)
def test_sql__checker_catches_interpolated_runtime_values(source: str) -> None:
    tree = ast.parse(source)
    checker = FixedSQL(tree)
    calls = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and ast.unparse(n.func) == "self._fetch"
    ]
    assert calls
    assert not all(checker.fixed(c.args[0], checker.parents.get(c)) for c in calls)


# -- the message never supplies the token ---------------------------------------------------
@pytest.mark.django_db(transaction=True, databases=DATABASE_ALIASES)
@pytest.mark.workers
@pytest.mark.timeout(180)
def test_message__forged_token_in_headers_and_kwargs_is_ignored(
    alias: str, start_worker: Any
) -> None:
    start_worker("a", extra_args=["--include", "testproject.demo.chaos_tasks"])
    forged = {"fencing_token": 999, "lease_key": "forged", "_fenced_state": "forged"}
    task_id = send(
        "chaos.echo", queue=start_worker.queue, args=("n1",), kwargs=forged, headers=forged
    )
    row = wait_for(
        lambda: TaskResult.objects.using(alias).filter(task_id=task_id, status="SUCCESS").first(),
        60,
        "the echo task",
    )
    seen = json.loads(row.result)
    assert (seen["token"], seen["key"], seen["lease_token"]) == (1, "echo:n1", 1)
    assert seen["extra"] == forged  # the kwargs reached the body as plain data, nothing more
    assert json.loads(row.meta)["fencing_token"] == 1
    assert list(Lease.objects.using(alias).values_list("key", "token")) == [("echo:n1", 1)]
