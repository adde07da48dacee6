"""The version matrix: the suite's fast core on every supported Python x Django.

``nox`` runs session ``core`` for each pair below (the newest Celery, kombu and
django-celery-results), plus ``oldest``: the lowest version of every dependency that
pyproject.toml allows (uv's ``--resolution lowest-direct``: Django 4.2.0, Celery 5.3.0 …)
on the oldest Python. The core is the tests marked
``core``: the store, the result backend, task calls and one real-worker test, on SQLite
and PostgreSQL, with the servers of ``tests/run.sh`` (their ``FENCED_*`` variables). The
whole suite runs once, on the main combination, in ``tests/run.sh`` itself.

The interpreters are pyenv's (``$PYENV_ROOT/versions/3.X.*``) or on ``PATH``.
"""

from __future__ import annotations

import glob
import os
import shutil
from pathlib import Path

import nox

nox.options.default_venv_backend = "uv"
nox.options.sessions = ["core", "oldest"]
nox.options.error_on_missing_interpreters = True

#: (Python, Django) pairs, as Django supports them: 4.2 up to Python 3.12; 5.2 from
#: 3.10; 6.0 and 6.1 from 3.12. Django's newest 6.x is 6.1.
MATRIX = [
    ("3.10", "4.2"),
    ("3.10", "5.2"),
    ("3.11", "4.2"),
    ("3.11", "5.2"),
    ("3.12", "4.2"),
    ("3.12", "5.2"),
    ("3.12", "6.0"),
    ("3.12", "6.1"),
    ("3.13", "5.2"),
    ("3.13", "6.0"),
    ("3.13", "6.1"),
]

CORE_TESTS = [
    "tests/integration/test_store.py",
    "tests/integration/test_backends.py",
    "tests/integration/test_task_calls.py",
    "tests/acceptance/test_task_workers.py",
]
TEST_TOOLS = ["pytest>=8", "pytest-django>=4.8", "pytest-timeout>=2.3", "time-machine>=2.13"]
#: what each session prints it ran on (the table of the README's "Supported versions")
SHOWN = ["django", "celery", "kombu", "django-celery-results", "psycopg", "redis", "click"]
SHOW_VERSIONS = f"""
import sys
from importlib.metadata import version
found = [f"{{name}} {{version(name)}}" for name in {SHOWN}]
print("versions: Python", ", ".join([sys.version.split()[0], *found]))
"""


def _pyenv_interpreters() -> None:
    """Put pyenv's interpreters on ``PATH`` (``python3.10`` …) for nox to find."""
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    found = [str(Path(b)) for b in sorted(glob.glob(f"{root}/3.*/bin"))]
    os.environ["PATH"] = os.pathsep.join([*found, os.environ.get("PATH", "")])
    missing = sorted({python for python, _ in MATRIX if not shutil.which(f"python{python}")})
    if missing:
        raise SystemExit(
            f"the version matrix needs Python {', '.join(missing)}: install them (e.g. "
            "`pyenv install 3.X`) or put python3.X on PATH"
        )


_pyenv_interpreters()


def _run_core(session: nox.Session) -> None:
    session.run("python", "-c", SHOW_VERSIONS)
    if "FENCED_PG_PORT" not in os.environ:
        session.error(
            "PostgreSQL and Redis are not configured (FENCED_PG_PORT is unset): run "
            "`bash tests/run.sh`, or start them with `python -m devtools.services start DIR` "
            "and export what it prints"
        )
    name = session.name.replace("(", "-").replace(")", "").replace("=", "").replace(",", "-")
    name = "".join(c if c.isalnum() else "_" for c in name)
    session.run(
        "python",
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-m",
        "core",
        "-k",
        "not mariadb and not rabbitmq",  # the core runs on Redis
        *CORE_TESTS,
        *session.posargs,
        env={
            # a test database of this session's own (sessions may share the servers)
            "FENCED_PG_TEST_NAME": f"test_{name}"[:60],
            "FENCED_SQLITE_PATH": str(Path(session.create_tmp()) / "core.sqlite3"),
            "FENCED_MARIADB_PORT": "",  # the core runs on SQLite and PostgreSQL
        },
    )


@nox.session
@nox.parametrize(("python", "django"), MATRIX, ids=[f"{p}-django{d}" for p, d in MATRIX])
def core(session: nox.Session, django: str) -> None:
    """The fast core on one Python x Django."""
    session.install("-e", ".[postgres,redis]", f"django=={django}.*", *TEST_TOOLS)
    _run_core(session)


@nox.session(python=MATRIX[0][0])
def oldest(session: nox.Session) -> None:
    """The fast core on the lowest version of each dependency pyproject.toml allows."""
    if session.venv_backend != "uv":
        session.error("session oldest needs uv (--resolution lowest-direct)")
    session.install("--resolution", "lowest-direct", "-e", ".[postgres,redis]")
    session.install(*TEST_TOOLS)  # the newest test tools; the package's floors stay
    _run_core(session)
