"""docs/testing.md runs as shown: its app and its tests, in a project of their own, with
pytest and the testing helpers' plugin, on SQLite and PostgreSQL, eager and not."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from django.conf import settings

from tests import freshproject

pytestmark = pytest.mark.timeout(300)

DOC = Path(__file__).resolve().parents[2] / "docs" / "testing.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
#: a block that is a file of the app names it on its first line
FILE = re.compile(r"# (reports/\w+\.py)\n")

SETTINGS = """\
SECRET_KEY = "docs"
INSTALLED_APPS = ["django_celery_results", "celery_fenced", "reports"]
DATABASES = {{"default": {database!r}}}
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
CELERY_BROKER_URL = "memory://"
CELERY_RESULT_BACKEND = "fenced-db"
CELERY_FENCED_TASKS = {{"reports.tasks.send_summary": {{"key": "summary:{{report_id}}"}}}}
{eager}
"""

PYTEST_INI = """\
[pytest]
DJANGO_SETTINGS_MODULE = proj.settings
addopts = -p celery_fenced.testing
"""


def blocks() -> list[str]:
    return BLOCK.findall(DOC.read_text())


def database(alias: str, root: Path) -> dict[str, object]:
    if alias == "default":
        return {"ENGINE": "django.db.backends.sqlite3", "NAME": str(root / "db.sqlite3")}
    server = settings.DATABASES[alias]
    return {
        "ENGINE": server["ENGINE"],
        "NAME": "docs",
        "USER": server["USER"],
        "PASSWORD": server["PASSWORD"],
        "HOST": server["HOST"],
        "PORT": server["PORT"],
        # a test database of its own: this session's stays in use meanwhile
        "TEST": {"NAME": "test_celery_fenced_docs"},
    }


def make_project(root: Path, alias: str, eager: bool) -> int:
    """Write the doc's app, its tests and a project around them; the number of tests."""
    (root / "proj").mkdir()
    (root / "reports").mkdir()
    (root / "proj" / "__init__.py").write_text(freshproject.INIT_PY)
    (root / "proj" / "celery.py").write_text(freshproject.CELERY_PY)
    (root / "reports" / "__init__.py").write_text("")
    (root / "pytest.ini").write_text(PYTEST_INI)
    eager_settings = ""
    tests = 0
    for number, block in enumerate(blocks()):
        named = FILE.match(block)
        if named:
            (root / named.group(1)).write_text(block)
        elif "def test_" in block:
            (root / f"test_doc_{number}.py").write_text(block)
            tests += block.count("\ndef test_")
        elif "CELERY_TASK_ALWAYS_EAGER" in block:
            eager_settings = block
    assert eager_settings, "the doc shows the eager settings"
    (root / "proj" / "settings.py").write_text(
        SETTINGS.format(database=database(alias, root), eager=eager_settings if eager else "")
    )
    return tests


@pytest.mark.parametrize("eager", [False, True], ids=["apply", "eager"])
def test_docs_testing__examples_run_as_shown(alias: str, eager: bool, tmp_path: Path) -> None:
    tests = make_project(tmp_path, alias, eager)
    assert tests >= 6, "the example tests of the doc are found"

    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "error"],
        cwd=tmp_path,
        env=freshproject.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=240,
    )

    assert run.returncode == 0, run.stdout[-6000:]
    assert f"{tests} passed" in run.stdout, run.stdout[-3000:]
