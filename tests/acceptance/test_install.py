"""The wheel, installed into a clean venv with only the documented runtime extras, runs a
fenced task through a real worker on Redis and on the filesystem broker.

Nothing of the test dependency groups is installed there: a runtime dependency that only
a test tool brings (kombu's Redis transport needs ``packaging``) fails here. pip reaches the
package index; its cache makes a repeated install fast.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from devtools.workers import wait_for
from tests import freshproject

ROOT = Path(__file__).resolve().parents[2]
EXTRAS = "postgres,redis"  # what the README's install line and the docs name

pytestmark = [pytest.mark.install, pytest.mark.workers, pytest.mark.timeout(300)]

SEND = """\
import django, sys
django.setup()
from shop.tasks import ship
result = ship.delay(42)
print("RESULT", result.get(timeout=60, interval=0.1))
"""


def _pip(python: Path, *args: str) -> None:
    run = subprocess.run(
        [str(python), "-m", "pip", "--disable-pip-version-check", "-q", *args],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.fixture(scope="module")
def clean_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv with the built wheel and its runtime extras, nothing else."""
    base = tmp_path_factory.mktemp("install")
    wheels = base / "wheels"
    _pip(Path(sys.executable), "wheel", "--no-deps", "-w", str(wheels), str(ROOT))
    (wheel,) = wheels.glob("celery_fenced-*.whl")
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    _pip(python, "install", f"{wheel}[{EXTRAS}]")
    installed = subprocess.run(
        [str(python), "-m", "pip", "list", "--format=freeze"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.lower()
    for test_only in ("pytest", "playwright", "time-machine"):
        assert f"{test_only}==" not in installed
    return python


@pytest.mark.parametrize("broker", ["redis", "filesystem"])
def test_install__wheel_with_runtime_extras_runs_a_fenced_task(
    clean_python: Path, tmp_path: Path, broker: str
) -> None:
    settings = ""
    if broker == "redis":
        url = os.environ["FENCED_REDIS_URL"]
        settings = f'CELERY_BROKER_URL = "{url}"\nCELERY_BROKER_TRANSPORT_OPTIONS = {{}}'
    root = freshproject.make(tmp_path / "project", settings=settings)
    python = str(clean_python)
    migrate = freshproject.run(root, "manage.py", "migrate", "-v0", python=python)
    assert migrate.returncode == 0, migrate.stdout
    log = tmp_path / "worker.log"
    worker = freshproject.worker(root, log, python=python)
    try:
        wait_for(
            lambda: " ready." in log.read_text() or worker.poll() is not None,
            60,
            "the worker to start",
        )
        assert worker.poll() is None, log.read_text()
        sent = subprocess.run(
            [python, "-c", SEND],
            cwd=root,
            env={**freshproject.env(), "DJANGO_SETTINGS_MODULE": "proj.settings"},
            capture_output=True,
            text=True,
            timeout=90,
        )
        assert sent.returncode == 0, sent.stdout + sent.stderr + log.read_text()[-3000:]
        assert "RESULT 42" in sent.stdout
        output = log.read_text()
        assert "celery-fenced: 1 fenced task: shop.tasks.ship" in output
        assert "results fenced (fenced-db)" in output
    finally:
        freshproject.stop(worker)
