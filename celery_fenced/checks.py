"""Django system checks: misconfiguration fails at start, not on the first task."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core import checks

from celery_fenced import conf
from celery_fenced.exceptions import FencedConfigurationError


def check_settings(**kwargs: Any) -> list[checks.CheckMessage]:
    errors: list[checks.CheckMessage] = []
    try:
        conf.load()
    except FencedConfigurationError as exc:
        errors.append(checks.Error(str(exc), id="celery_fenced.E001"))
    if not settings.USE_TZ:
        errors.append(
            checks.Error(
                "celery-fenced needs USE_TZ = True: lease times are written in UTC by the "
                "database's clock.",
                id="celery_fenced.E002",
            )
        )
    return errors


def register() -> None:
    checks.register(check_settings, "celery_fenced")
