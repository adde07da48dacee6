"""Whether the two apps celery-fenced needs are in ``INSTALLED_APPS``, and what to add.

Free of the models: the package's lazy names and ``celery fenced`` ask it before (or
without) Django's app registry being ready.
"""

from __future__ import annotations

from typing import Any

from django.apps import apps
from django.core import checks

from celery_fenced.exceptions import FencedConfigurationError

REQUIRED_APPS = ("django_celery_results", "celery_fenced")


def check_installed_apps(**kwargs: Any) -> list[checks.CheckMessage]:
    missing = [name for name in REQUIRED_APPS if not apps.is_installed(name)]
    if not missing:
        return []
    return [checks.Error(installed_apps_message(missing), id="celery_fenced.E004")]


def require_apps() -> None:
    """Raise, naming both apps, when one of them is not installed (once apps are ready)."""
    if not apps.apps_ready:
        return  # importing the models raises Django's AppRegistryNotReady, which is clear
    missing = [name for name in REQUIRED_APPS if not apps.is_installed(name)]
    if missing:
        raise FencedConfigurationError(installed_apps_message(missing))


def installed_apps_message(missing: list[str]) -> str:
    return (
        f"celery-fenced needs both {REQUIRED_APPS[0]!r} and {REQUIRED_APPS[1]!r} in "
        f"INSTALLED_APPS; missing: {', '.join(map(repr, missing))}. Add: "
        f"INSTALLED_APPS += [{', '.join(map(repr, missing))}]"
    )
