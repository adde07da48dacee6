"""A fresh Django project laid out as Celery's Django guide says, for first-run tests.

``proj/celery.py`` creates the app with ``config_from_object("django.conf:settings",
namespace="CELERY")`` and ``autodiscover_tasks()``; ``proj/__init__.py`` imports it; one
app, ``shop``, has a ``tasks.py``. Settings and tasks are given per test; the database is
SQLite and the broker kombu's filesystem transport (no server) unless a test says other.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

CELERY_PY = """\
import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "proj.settings")
app = Celery("proj")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
"""

INIT_PY = """\
from .celery import app as celery_app

__all__ = ["celery_app"]
"""

MANAGE_PY = """\
import os
import sys

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "proj.settings")
from django.core.management import execute_from_command_line

execute_from_command_line(sys.argv)
"""

SETTINGS_PY = """\
from pathlib import Path

BASE = Path(__file__).resolve().parent.parent
SECRET_KEY = "fresh"
INSTALLED_APPS = ["django_celery_results", "celery_fenced", "shop"]
DATABASES = {{"default": {{"ENGINE": "django.db.backends.sqlite3", "NAME": BASE / "db.sqlite3"}}}}
USE_TZ = True
CELERY_BROKER_URL = "filesystem://"
CELERY_BROKER_TRANSPORT_OPTIONS = {{
    "data_folder_in": str(BASE / "broker"),
    "data_folder_out": str(BASE / "broker"),
    "processed_folder": str(BASE / "broker-processed"),
    "control_folder": str(BASE / "broker-control"),
    "store_processed": False,
}}
CELERY_RESULT_BACKEND = "fenced-db"
{extra}
"""

TASKS_PY = """\
from celery import shared_task

from celery_fenced import FencedTask


@shared_task(bind=True, base=FencedTask, lease_key="order:{order_id}", lease_ttl=30)
def ship(self, order_id):
    return order_id


@shared_task
def plain(x):
    return x
"""


def make(root: Path, *, settings: str = "", tasks: str = TASKS_PY) -> Path:
    """Write the project into ``root``; ``settings`` is appended to ``proj/settings.py``."""
    (root / "proj").mkdir(parents=True)
    (root / "shop").mkdir()
    for folder in ("broker", "broker-processed", "broker-control"):
        (root / folder).mkdir()
    (root / "proj" / "__init__.py").write_text(INIT_PY)
    (root / "proj" / "celery.py").write_text(CELERY_PY)
    (root / "proj" / "settings.py").write_text(SETTINGS_PY.format(extra=textwrap.dedent(settings)))
    (root / "shop" / "__init__.py").write_text("")
    (root / "shop" / "tasks.py").write_text(textwrap.dedent(tasks))
    (root / "manage.py").write_text(MANAGE_PY)
    return root


def env() -> dict[str, str]:
    """The environment of the project's processes: nothing of the suite's settings."""
    return {
        name: value
        for name, value in os.environ.items()
        if name not in ("DJANGO_SETTINGS_MODULE", "PYTHONPATH") and not name.startswith("FENCED_")
    }


def run(
    root: Path, *args: str, timeout: float = 60, python: str = sys.executable
) -> subprocess.CompletedProcess[str]:
    """``python <args>`` in the project, standard error merged into the output."""
    return subprocess.run(
        [python, *args],
        cwd=root,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )


def worker(root: Path, log: Path, python: str = sys.executable) -> subprocess.Popen[bytes]:
    """``celery -A proj worker`` in the project (solo pool), its output in ``log``."""
    with open(log, "wb") as out:
        return subprocess.Popen(
            [
                python,
                "-m",
                "celery",
                "-A",
                "proj",
                "worker",
                "--pool",
                "solo",
                "--loglevel",
                "INFO",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
            ],
            cwd=root,
            env=env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def stop(process: subprocess.Popen[bytes]) -> None:
    """Stop a worker started by :func:`worker` (warm shutdown, then kill)."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)
