"""The supported versions are stated once: the classifiers and the README say what the
version matrix (noxfile.py) tests."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 has no tomllib
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[2]


def matrix() -> list[tuple[str, str]]:
    """noxfile.py's MATRIX, read without importing nox."""
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "MATRIX":
            return [tuple(pair) for pair in ast.literal_eval(node.value)]
    raise AssertionError("noxfile.py has no MATRIX")


def classifiers(prefix: str) -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {c.removeprefix(prefix) for c in project["classifiers"] if c.startswith(prefix)}


def test_classifiers__name_exactly_the_tested_pythons_and_djangos() -> None:
    pairs = matrix()
    assert classifiers("Programming Language :: Python :: 3.") == {
        p.removeprefix("3.") for p, _ in pairs
    }
    assert classifiers("Framework :: Django :: ") == {d for _, d in pairs}


@pytest.mark.parametrize("page", ["README.md", "docs/index.md"])
def test_docs__table_of_supported_versions_is_the_matrix(page: str) -> None:
    text = (ROOT / page).read_text()
    section = text.split("## Supported versions", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (3\.\d+) \| ([\d., ]+) \|$", section, re.M)
    stated = {
        (python, django.strip()) for python, djangos in rows for django in djangos.split(",")
    }
    assert stated == set(matrix())


def test_requires_python__is_the_oldest_tested() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == f">={min(matrix(), key=lambda p: int(p[0][2:]))[0]}"


@pytest.mark.parametrize("page", ["README.md", "docs/index.md"])
def test_docs__oldest_tested_versions_are_the_dependencies_floors(page: str) -> None:
    """Session ``oldest`` installs each dependency's floor: the docs name those."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    floors = dict(re.findall(r"^([a-z-]+)>=([\d.]+)", "\n".join(project["dependencies"]), re.M))
    section = (ROOT / page).read_text().split("## Supported versions", 1)[1].split("\n## ", 1)[0]
    oldest = section.split("Session `oldest`", 1)[1].split("Databases:", 1)[0]
    for name, label in [
        ("django", "Django"),
        ("celery", "Celery"),
        ("kombu", "kombu"),
        ("django-celery-results", "django-celery-results"),
    ]:
        assert re.search(rf"\b{label} {re.escape(floors[name])}(\.0)*\b", oldest), name
