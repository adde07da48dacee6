"""Whether the two apps celery-fenced needs are in ``INSTALLED_APPS``, and what to add.

Free of the models: the package's lazy names and ``celery fenced`` ask it before (or
without) Django's app registry being ready.
"""

from __future__ import annotations

from typing import Any

from django.apps import apps
from django.conf import settings
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


def ignored_settings_message(app: Any = None) -> str | None:
    """The error when ``fenced_*`` settings are given (in Django's settings or on ``app``)
    but ``celery_fenced`` is not installed: the tasks they name would run unfenced."""
    if not (settings.configured and apps.apps_ready) or apps.is_installed("celery_fenced"):
        return None
    names = {n for n in dir(settings) if n.startswith("CELERY_FENCED_")}
    conf = getattr(app, "conf", None)
    if conf is not None:
        names |= {n for n in conf if str(n).lower().startswith("fenced_")}
    if not names:
        return None
    missing = [a for a in REQUIRED_APPS if not apps.is_installed(a)]
    return (
        f"celery-fenced: {installed_apps_message(missing)} ({', '.join(sorted(names))} "
        "would be ignored: the tasks they name would run unfenced)"
    )
