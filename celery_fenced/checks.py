"""Django system checks: misconfiguration is named at start, not on the first task.

``manage.py check`` runs them, and so does every worker at start (:mod:`celery_fenced.lifecycle`
stops it on an error and logs the warnings). Each message names the setting or the task
and what would be valid.

| id | what |
|---|---|
| E001 | a ``fenced_*`` setting or a fenced task's options invalid (a misspelt one: the closest) |
| E002 | ``USE_TZ = False`` |
| E003 | a setting that looks like ours but is not (``CELERY_FENCE_TASKS``): it would be ignored |
| E004 | ``django_celery_results`` missing from ``INSTALLED_APPS`` |
| E005 | a task module fails to load with a celery-fenced error (a lease-key template) |
| E006 | the lease database is MariaDB or MySQL and its session time zone is not UTC |
| E007 | MariaDB or MySQL compares result or group ids, or beat names, by a folding collation |
| E008 | a lease ttl below :data:`MIN_LEASE_TTL` (setting, ``fenced_tasks`` entry, task) |
| W001 | results and leases in different databases |
| W002 | fenced tasks, but the result backend does not fence results |
| W003 | a fenced task with ``acks_late=False`` |
| W004 | a lease ttl longer than the broker's visibility timeout |
| W005 | a task's hard time limit longer than the broker's visibility timeout |
| W006 | a renew interval above half the ttl |
| W007 | the task modules fail to load for another reason: the fenced tasks go unchecked |
| W008 | fenced tasks, but no result backend at all |
| W009 | a ``fenced_tasks`` key that matches no registered task |
| W010 | a task's own ``acks_late=False``, overridden because ``fenced_tasks`` selects it |
| W011 | atomic tasks whose results are written to another database than the leases |
| W012 | atomic tasks on SQLite (one writer: a long body blocks every grant and renewal) |
| W013 | atomic tasks on MySQL (no server-side bound on a paused body's transaction) |
"""

from __future__ import annotations

import contextlib
import difflib
import re
from typing import Any

from django.apps import apps
from django.conf import settings
from django.core import checks
from django.db import DatabaseError, connections, router

from celery_fenced import collations, conf, installed, startup, task_checks
from celery_fenced.exceptions import FencedConfigurationError


def check_settings(**kwargs: Any) -> list[checks.CheckMessage]:
    errors: list[checks.CheckMessage] = []
    try:
        loaded = conf.load()
    except FencedConfigurationError as exc:
        errors.append(checks.Error(str(exc), id="celery_fenced.E001"))
    else:
        errors += task_checks.short_ttl_messages(
            "fenced_default_ttl", loaded.default_ttl, "fenced_default_ttl"
        )
        for pattern, options in loaded.tasks.items():
            ttl = options.get("ttl")
            if ttl is not None:
                where = f"fenced_tasks[{pattern!r}] ttl"
                errors += task_checks.short_ttl_messages(where, float(ttl), "fenced_tasks")
    if not settings.USE_TZ:
        errors.append(
            checks.Error(
                "celery-fenced needs USE_TZ = True: lease times are written in UTC by the "
                "database's clock.",
                id="celery_fenced.E002",
            )
        )
    return errors


def check_unknown_settings(**kwargs: Any) -> list[checks.CheckMessage]:
    """A setting that looks like one of ours but is not (``CELERY_FENCED_TASK``,
    ``CELERY_FENCE_TASKS``, ``CELERY_FENCED_TTL``) would be ignored: name it."""
    written: list[object] = [name for name in dir(settings) if name.isupper()]
    with contextlib.suppress(Exception):  # a broken app configuration is Celery's to report
        written += list(startup.checked_app().conf.keys())
    errors: list[checks.CheckMessage] = []
    for name in sorted({name for name in written if isinstance(name, str)}):
        django_style = name.isupper()
        if _is_ours(name, django_style) or not _looks_ours(name, django_style):
            continue
        meant = _meant(name)
        spelled = _spelled(meant, django_style) if meant else ""
        guess = f" Did you mean {spelled}?" if spelled else ""
        valid = ", ".join(_spelled(k, django_style) for k in sorted(conf.DEFAULTS))
        effect = (
            "the tasks it names run unfenced"
            if meant == "fenced_tasks"
            else "the default applies instead"
        )
        errors.append(
            checks.Error(
                f"{name} is not a celery-fenced setting, so it is ignored: {effect}.{guess}",
                hint=f"celery-fenced's settings: {valid}.",
                obj=name,
                id="celery_fenced.E003",
            )
        )
    return errors


#: how a name that means one of ours may start (after ``CELERY_``): fence, fenced, fencing
_STEM = re.compile(r"^fenc(?:ed|ing|e)?_?", re.IGNORECASE)
#: how close (difflib's ratio) a name must be to one of ours to be taken for a typo of it
_CLOSE = 0.85


def _spelled(name: str, django_style: bool) -> str:
    return f"CELERY_{name.upper()}" if django_style else name


def _is_ours(name: str, django_style: bool) -> bool:
    return any(name == _spelled(known, django_style) for known in conf.DEFAULTS)


def _tail(name: str) -> str:
    lowered = name.lower()
    return lowered[len("celery_") :] if lowered.startswith("celery_") else lowered


def _looks_ours(name: str, django_style: bool) -> bool:
    """Whether ``name`` was meant as one of our settings: one that starts with a form of
    "fence" (after ``CELERY_``) or is a near miss of one of ours. A Django setting without
    ``CELERY_`` (which Celery does not read) counts only when it is one of ours but for
    the prefix: others are the project's own."""
    tail = _tail(name)
    if django_style and not name.startswith("CELERY_"):
        return _exactly_meant(name) is not None
    if _STEM.match(tail):
        return True
    return bool(difflib.get_close_matches(tail, list(conf.DEFAULTS), n=1, cutoff=_CLOSE))


def _exactly_meant(name: str) -> str | None:
    """Our setting that ``name`` names but for its spelling of "fenced" and a missing
    ``default_`` (``CELERY_FENCE_TASKS``, ``CELERY_FENCED_TTL``), or None."""
    tail = _tail(name)
    if not _STEM.match(tail):
        return None
    candidate = "fenced_" + _STEM.sub("", tail, count=1)
    if candidate in conf.DEFAULTS:
        return candidate
    # a task option's name as a setting: CELERY_FENCED_TTL for fenced_default_ttl
    return next((k for k in conf.DEFAULTS if k.replace("_default_", "_") == candidate), None)


def _meant(name: str) -> str | None:
    """The ``fenced_*`` setting ``name`` most likely means, or None."""
    exact = _exactly_meant(name)
    if exact is not None:
        return exact
    candidate = "fenced_" + _STEM.sub("", _tail(name), count=1)
    close = difflib.get_close_matches(candidate, sorted(conf.DEFAULTS), n=1, cutoff=0.6)
    return close[0] if close else None


def check_result_database(**kwargs: Any) -> list[checks.CheckMessage]:
    """The fenced result backend proves, writes and releases in one transaction (R3) only
    when its results and the leases are in the same database."""
    if not apps.is_installed("django_celery_results"):
        return []  # E004
    if not startup.results_fenced(startup.checked_app()):
        return []
    try:
        leases = startup.lease_database()
    except FencedConfigurationError:
        return []  # reported by check_settings
    results = router.db_for_write(apps.get_model("django_celery_results", "TaskResult"))
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


def check_database_clock(databases: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """The lease database's clock is UTC, as Django's datetimes are (the MySQL family).

    Its SQL reads ``CURRENT_TIMESTAMP``, which MariaDB and MySQL give in the session's
    time zone, while Django writes and reads naive UTC. A database check: it runs when
    the lease database is among ``databases`` (a worker's start, ``migrate``, ``check
    --database``).
    """
    if not databases or not apps.is_installed("django_celery_results"):
        return []  # not asked to read a database; or E004

    try:
        alias = startup.lease_database()
    except FencedConfigurationError:
        return []  # reported by check_settings
    if alias not in databases or connections[alias].vendor != "mysql":
        return []
    try:
        with connections[alias].cursor() as cursor:
            cursor.execute(
                "SELECT TIMESTAMPDIFF(MINUTE, UTC_TIMESTAMP(6), CURRENT_TIMESTAMP(6)), "
                "@@session.time_zone"
            )
            offset, zone = cursor.fetchone()
    except DatabaseError:
        return []  # not reachable now: the first lease operation says so
    if not offset:
        return []
    return [
        checks.Error(
            f"The lease database {alias!r} gives its clock in time zone {zone!r}, "
            f"{offset:+d} minutes from UTC; Django stores datetimes in UTC there, so "
            "leases would expire that much early or late.",
            hint=f"Set DATABASES[{alias!r}]['OPTIONS']['init_command'] = "
            "\"SET time_zone = '+00:00'\" (or the server's default_time_zone to UTC).",
            id="celery_fenced.E006",
        )
    ]


def register() -> None:
    for check in (
        installed.check_installed_apps,
        check_settings,
        check_unknown_settings,
        check_result_database,
        check_database_clock,
        collations.check_result_ids,
        task_checks.check_tasks,
    ):
        checks.register(check, "celery_fenced")


def _lease_database() -> list[str]:
    """The lease database, for the checks that read it (none if it is misconfigured)."""
    try:
        return [startup.lease_database()]
    except FencedConfigurationError:
        return []


def run(app: Any = None) -> tuple[list[checks.CheckMessage], list[checks.CheckMessage]]:
    """Run celery-fenced's checks of ``app`` (default: the current app) now.

    Returns ``(errors, warnings)``; messages silenced by ``SILENCED_SYSTEM_CHECKS`` are left
    out, as ``manage.py check`` leaves them out.
    """
    with startup.checking(app):
        found = checks.run_checks(tags=["celery_fenced"], databases=_lease_database())
    errors = [m for m in found if m.is_serious()]
    warnings = [m for m in found if not m.is_serious()]
    return errors, warnings
