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


def check_result_database(**kwargs: Any) -> list[checks.CheckMessage]:
    """The fenced result backend proves, writes and releases in one transaction (R3) only
    when its results and the leases are in the same database."""
    from celery import current_app
    from django.db import router

    backend = str(current_app.conf.result_backend or "")
    if backend != "fenced-db" and not backend.endswith(":FencedDatabaseBackend"):
        return []
    try:
        from django_celery_results.models import TaskResult
    except (ImportError, RuntimeError):  # not installed: the backend fails on its own
        return []
    from celery_fenced import store

    try:
        leases = store.database_alias()
    except FencedConfigurationError:
        return []  # reported by check_settings
    results = router.db_for_write(TaskResult)
    if results == leases:
        return []
    return [
        checks.Warning(
            f"FencedDatabaseBackend writes results to database {results!r} but the leases "
            f"are in {leases!r}: the token proof and the result write cannot share one "
            "transaction, so a result may be stored after its lease was taken over.",
            hint="Route django_celery_results.TaskResult to the lease database, or set "
            f"CELERY_FENCED_DATABASE = {results!r}.",
            id="celery_fenced.W001",
        )
    ]


def register() -> None:
    checks.register(check_settings, "celery_fenced")
    checks.register(check_result_database, "celery_fenced")
