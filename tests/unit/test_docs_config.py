"""The configuration reference (docs/configuration.md) against the code.

Every setting in ``conf.DEFAULTS`` has a row with its default, every task option in
``validators.TASK_OPTION_NAMES`` has a row with its ``FencedTask`` attribute, and every other
settings table in the docs (such as the one in docs/reclaim.md) agrees with the code.
A default cell starts with the value as a Python literal in backticks; a ``None`` default
is followed by what it means (``None``: each task's ttl / 3).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import pytest

from celery_fenced import conf, validators

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
REFERENCE = DOCS / "configuration.md"
LEADING_CODE = re.compile(r"\s*`([^`]+)`")

Row = dict[str, str]


def tables(text: str) -> list[tuple[str, list[Row]]]:
    """Every Markdown table of ``text``: the heading above it, and its rows by column."""
    found: list[tuple[str, list[Row]]] = []
    heading = ""
    header: list[str] | None = None
    for line in [*text.splitlines(), ""]:
        if not line.startswith("|"):
            header = None
            if line.startswith("#"):
                heading = line.lstrip("#").strip()
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if header is None:
            header = [cell.replace("`", "").lower() for cell in cells]
            found.append((heading, []))
        elif not set("".join(cells)) <= set("-: "):  # not the separator line
            assert len(cells) == len(header), f"a cell contains '|' in: {line}"
            found[-1][1].append(dict(zip(header, cells, strict=True)))
    return found


def table(heading: str) -> list[Row]:
    """The table under ``heading`` in the configuration reference."""
    matches = [rows for title, rows in tables(REFERENCE.read_text()) if title == heading]
    assert len(matches) == 1, f"{REFERENCE.name} needs one table under '## {heading}'"
    return matches[0]


def code(cell: str) -> str:
    """The code span a cell starts with."""
    match = LEADING_CODE.match(cell)
    assert match, f"the cell must start with a `code` span: {cell!r}"
    return match.group(1)


def same(documented: object, actual: object) -> bool:
    """Equal values; ``60`` and ``60.0`` are the same, ``None`` and booleans only themselves."""
    if any(value is None or isinstance(value, bool) for value in (documented, actual)):
        return documented is actual
    if isinstance(documented, int | float) and isinstance(actual, int | float):
        return float(documented) == float(actual)
    return documented == actual


def settings_rows() -> list[tuple[str, Row]]:
    """(page, row) of every docs table with a ``setting`` and a ``default`` column."""
    return [
        (page.name, row)
        for page in sorted(DOCS.glob("*.md"))
        for _, rows in tables(page.read_text())
        for row in rows
        if {"setting", "default"} <= set(row)
    ]


def test_docs_config__every_setting_is_documented_once() -> None:
    names = [code(row["setting"]) for row in table("Settings")]
    assert len(names) == len(set(names)), f"documented twice: {names}"
    missing = set(conf.DEFAULTS) - set(names)
    unknown = set(names) - set(conf.DEFAULTS)
    assert not missing, f"settings missing from {REFERENCE.name}: {sorted(missing)}"
    assert not unknown, f"{REFERENCE.name} documents unknown settings: {sorted(unknown)}"


@pytest.mark.parametrize("name", sorted(conf.DEFAULTS))
def test_docs_config__default_matches_the_code(name: str) -> None:
    rows = [row for row in table("Settings") if code(row["setting"]) == name]
    assert rows, f"{name} is not documented in {REFERENCE.name}"
    cell = rows[0]["default"]
    documented = ast.literal_eval(code(cell))
    assert same(documented, conf.DEFAULTS[name]), (
        f"{name}: documented default {documented!r}, code default {conf.DEFAULTS[name]!r}"
    )
    if documented is None:
        meaning = LEADING_CODE.sub("", cell, count=1).strip(" :")
        assert meaning, f"{name}: say what the default None means, e.g. '`None`: ttl / 3'"


def test_docs_config__every_settings_table_agrees_with_the_code() -> None:
    rows = settings_rows()
    assert len(rows) >= len(conf.DEFAULTS)
    for page, row in rows:
        name = code(row["setting"])
        assert name in conf.DEFAULTS, f"{page} documents unknown setting {name}"
        documented = ast.literal_eval(code(row["default"]))
        assert same(documented, conf.DEFAULTS[name]), (
            f"{page}: {name} documented as {documented!r}, code has {conf.DEFAULTS[name]!r}"
        )


def test_docs_config__every_task_option_is_documented() -> None:
    from celery_fenced.execution import FencedTask

    rows = table("Task options")
    names = [code(row["option"]) for row in rows]
    in_code = sorted(validators.TASK_OPTION_NAMES)
    assert sorted(names) == in_code, (
        f"task options documented: {sorted(names)}; in the code: {in_code}"
    )
    for row in rows:
        attribute = code(row["fencedtask attribute"])
        assert attribute == f"lease_{code(row['option'])}"
        assert hasattr(FencedTask, attribute), f"FencedTask has no {attribute}"
        fallback = [s for s in re.findall(r"`([^`]+)`", row["default"]) if s.startswith("fenced")]
        assert set(fallback) <= set(conf.DEFAULTS), f"unknown setting in {row['default']!r}"


#: misspellings the docs show as examples of what check E003 reports
MISSPELT = {"CELERY_FENCED_TTL"}


def test_docs_config__django_names_are_real_settings() -> None:
    pages = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
    django_names = {f"CELERY_{name.upper()}" for name in conf.DEFAULTS}
    for page in pages:
        for name in re.findall(r"\bCELERY_FENCED_[A-Z_]*[A-Z]", page.read_text()):
            assert name in django_names | MISSPELT, f"{page.name} names unknown setting {name}"


@pytest.mark.parametrize("name", sorted(MISSPELT))
def test_docs_config__documented_misspellings_are_reported(settings: Any, name: str) -> None:
    from celery_fenced.checks import check_unknown_settings

    setattr(settings, name, 1)
    assert [e.obj for e in check_unknown_settings()] == [name]


CHECK_ID = re.compile(r"""id="celery_fenced\.([EW]\d{3})\"""")


def test_check_table__every_check_id_documented_once() -> None:
    """The ids the package's checks use, the table under "Checks at start" and the table in
    :mod:`celery_fenced.checks`' docstring: the same ids."""
    from celery_fenced import checks

    package = ROOT / "celery_fenced"
    used = {m for path in package.glob("*.py") for m in CHECK_ID.findall(path.read_text())}
    documented = [
        code(row["id"]).removeprefix("celery_fenced.") for row in table("Checks at start")
    ]
    listed = re.findall(r"^\| ([EW]\d{3}) \|", checks.__doc__ or "", re.MULTILINE)
    assert sorted(documented) == sorted(set(documented)) == sorted(used)
    assert sorted(listed) == sorted(used)
