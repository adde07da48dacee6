"""SQL as data: each dialect's statements are literal constants with named parameters,
and the converted dialects execute only those.

Server-free: the modules are read as source (the AST) and imported.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "celery_fenced"
DIALECTS = PACKAGE / "store" / "dialects"
STATEMENTS = sorted(p for p in (DIALECTS / "statements").glob("*.py") if p.stem != "__init__")
#: the dialect modules that execute only statements of their statements module
CONVERTED = [DIALECTS / f"{name}.py" for name in ("sql", "sqlite", "postgresql", "mysql", "orm")]
EXECUTING = ("execute", "_fetch", "_send", "raw", "extra", "_unless_conflicting")
PLACEHOLDER = re.compile(r"%(\(\w+\)s|%)")


def literal(node: ast.expr, names: set[str]) -> bool:
    """Whether ``node`` is a string literal, a constant defined before, or their sum."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    if isinstance(node, ast.Name):
        return node.id in names
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return literal(node.left, names) and literal(node.right, names)
    return False


def constant(node: ast.expr) -> bool:
    """Whether ``node`` is a constant or a tuple of them (a variant's key)."""
    if isinstance(node, ast.Tuple):
        return all(constant(element) for element in node.elts)
    return isinstance(node, ast.Constant)


def not_literal(source: str) -> list[str]:
    """What, in a statements module's source, is not a literal constant."""
    names: set[str] = set()
    found = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.ImportFrom) and (
            node.module in ("__future__", "typing")
            or (node.module or "").startswith("celery_fenced.store.dialects.statements.")
        ):
            names |= {alias.asname or alias.name for alias in node.names}
        elif isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            continue  # the LiteralString import
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        elif (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and node.value is not None
            and ast.unparse(node.annotation) == "LiteralString"
            and literal(node.value, names)
        ):
            names.add(node.target.id)
        elif (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(node.value, ast.Dict)
            and re.fullmatch(r"Mapping\[.*, LiteralString\]", ast.unparse(node.annotation))
            and all(key is not None and constant(key) for key in node.value.keys)
            and all(literal(value, names) for value in node.value.values)
        ):
            names.add(node.target.id)  # a statement's variants, by a key of constants
        else:
            found.append(f"{node.lineno}: {ast.unparse(node)[:80]}")
    return found


def statement_sources(path: Path) -> list[str]:
    """The SQL argument of every executing call in a dialect module that is not a
    statement of a statements module (``sql.NAME``, ``self.statements.NAME``, a variant
    ``sql.NAME[key]``, or a choice of them), nor an executing method's own statement
    parameter passed on (its callers are checked)."""
    found = []
    for function in ast.walk(ast.parse(path.read_text())):
        if not isinstance(function, ast.FunctionDef):
            continue
        for node in ast.walk(function):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in EXECUTING
                and node.args
                and not named_statement(node.args[0])
                and not passed_on(function, node.args[0])
            ):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node.args[0])[:80]}")
    return found


def passed_on(function: ast.FunctionDef, node: ast.expr) -> bool:
    """Whether ``node`` is an executing method's statement parameter (after ``self``)."""
    parameters = function.args.args[1:2]
    return (
        function.name in EXECUTING
        and isinstance(node, ast.Name)
        and [p.arg for p in parameters] == [node.id]
    )


def named_statement(node: ast.expr) -> bool:
    if isinstance(node, ast.IfExp):
        return named_statement(node.body) and named_statement(node.orelse)
    if isinstance(node, ast.Subscript):  # a variant, by its key
        node = node.value
    if isinstance(node, ast.Call) and ast.unparse(node.func) == "repeated":
        # the exception: a statement's one row repeated (see ``statements/mysql.py``)
        return len(node.args) == 4 and all(named_statement(arg) for arg in node.args[:3])
    text = ast.unparse(node)
    return re.fullmatch(r"(sql|self\.statements)\.[A-Z][A-Z0-9_]*", text) is not None


@pytest.mark.parametrize("path", STATEMENTS, ids=[p.name for p in STATEMENTS])
def test_statements__module_holds_only_literal_constants(path: Path) -> None:
    assert not_literal(path.read_text()) == []


@pytest.mark.parametrize("path", STATEMENTS, ids=[p.name for p in STATEMENTS])
def test_statements__parameters_are_named(path: Path) -> None:
    module = importlib.import_module(f"celery_fenced.store.dialects.statements.{path.stem}")
    statements = {
        name if key is None else f"{name}[{key!r}]": sql
        for name, value in vars(module).items()
        if name.isupper()
        for key, sql in (value.items() if isinstance(value, dict) else [(None, value)])
        if isinstance(sql, str)
    }
    assert statements
    # positional only in the one row of a statement taking a variable number of them
    positional = {
        name: sql for name, sql in statements.items() if "%s" in sql and not name.endswith("_ROW")
    }
    assert positional == {}
    rows = {name for name, sql in statements.items() if "{rows}" in sql}
    assert {name.split("[")[0] for name in rows} <= {"LOCKED_ROWS", "RENEW", "RENEWED"}
    assert all("%(" not in statements[name] for name in rows)
    # every ``%`` is a named parameter or an escaped ``%%``
    stray = {
        name: sql
        for name, sql in statements.items()
        if "%" in PLACEHOLDER.sub("", sql if not name.endswith("_ROW") else sql.replace("%s", ""))
    }
    assert stray == {}


def test_statements__name_the_models_tables() -> None:
    from celery_fenced.store.dialects import tables as records

    text = " ".join(path.read_text() for path in STATEMENTS)
    tables = set(re.findall(r"\b(?:celery_fenced_\w+|django_celery_results_\w+)\b", text))
    result = records.task_result_model()._meta.db_table
    models = {records.LEASE, records.EVENT, records.COMPLETION, records.PENDING, result}
    models.add("celery_fenced_permit_token")  # permits' sequence (migrations 0007, 0015)
    models.add("celery_fenced_lease_key_uniq")  # the keys' unique index (MariaDB's hint)
    models.add("celery_fenced_result_lock")  # the family's result locks (migration 0017)
    assert tables <= models
    assert {records.LEASE, records.EVENT} <= tables


@pytest.mark.parametrize("path", CONVERTED, ids=[p.name for p in CONVERTED])
def test_dialect__executes_only_named_statements(path: Path) -> None:
    assert statement_sources(path) == []


@pytest.mark.parametrize(
    "source",
    [
        'X: LiteralString = f"SELECT {key}"',
        'X: LiteralString = "SELECT " + str(key)',
        'X: LiteralString = "SELECT %s" % key',
        'X: LiteralString = " ".join(["SELECT"])',
        "X = make()",
        'X: Mapping[bool, LiteralString] = {True: f"SELECT {key}"}',
        'X: Mapping[str, LiteralString] = {key: "SELECT 1"}',
    ],
    ids=["fstring", "call", "format", "join", "unannotated-call", "variant", "variant-key"],
)
def test_checker__catches_a_runtime_value_in_a_statements_module(source: str) -> None:
    assert not_literal(source)


@pytest.mark.parametrize("path", CONVERTED, ids=[p.name for p in CONVERTED])
def test_checker__catches_sql_spliced_into_a_converted_dialect(path: Path, tmp_path: Path) -> None:
    source = path.read_text()
    named = re.compile(r"(\.(?:_fetch|execute)\()(?:sql|self\.statements)\.[A-Z_]+")
    splice = "f\"SELECT token FROM t WHERE key = '{key}'\""
    spliced = named.sub(lambda m: m.group(1) + splice, source, count=1)
    assert spliced != source
    (tmp_path / path.name).write_text(spliced)
    assert statement_sources(tmp_path / path.name)


def test_statements__event_kinds_and_reclaim_states_are_the_models() -> None:
    from celery_fenced.models import LeaseEvent, ReclaimState

    text = " ".join(path.read_text() for path in STATEMENTS)
    written = set(re.findall(r"(?:SELECT (?:g\.)?id, |THEN |ELSE )'(\w+)'", text))
    compared = set(re.findall(r"reclaim_state (?:=|<>) '(\w+)'", text))
    assert {"acquired", "reclaimed", "busy", "abandoned"} <= written
    kinds = {str(k.value) for k in LeaseEvent.Kind} | {str(s.value) for s in ReclaimState}
    assert written | compared <= kinds
