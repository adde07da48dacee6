"""The demo runs on what its README command installs: the package and its ``metrics``
extra, never the test dependencies (django-celery-beat among them)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

WITHOUT_BEAT = """
import sys

sys.modules["django_celery_beat"] = None  # as if not installed: importing it fails
import os
os.environ["DJANGO_SETTINGS_MODULE"] = "testproject.settings"
import django
django.setup()
from django.conf import settings
assert "django_celery_beat" not in settings.INSTALLED_APPS
print("ok")
"""


def test_demo_settings__start_without_django_celery_beat() -> None:
    env = {"PATH": "/usr/bin:/bin", "FENCED_DB": "sqlite"}
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_BEAT],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
