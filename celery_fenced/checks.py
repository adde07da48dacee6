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
| E007 | MariaDB or MySQL compares result or group ids by a collation that folds them |
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
"""

from __future__ import annotations

import contextlib
import difflib
import re
from typing import Any

from django.conf import settings
from django.core import checks

from celery_fenced import collations, conf, startup
from celery_fenced.exceptions import FencedConfigurationError

REQUIRED_APPS = ("django_celery_results", "celery_fenced")
#: The shortest lease ttl (seconds) the checks accept. A lease is renewed every ttl / 3
#: and is lost when a renewal is 2/3 of the ttl late; below 1 s that is under 667 ms,
#: within reach of an ordinary GC pause, slow query or TCP retransmission (200 ms at
#: least on Linux), and the renewals alone are three database writes a second per task.
MIN_LEASE_TTL = 1.0
ON_BUSY_MEANS = {
    "retry": "is retried until the lease is free, so the job waits",
    "skip": "is dropped (on_busy='skip'): the job is lost",
    "fail": "fails with LeaseBusy (on_busy='fail'): the job ends as a failure",
}


#: The app :func:`run` checks (a worker's); otherwise the current app.
_checking: list[Any] = []


def _app() -> Any:
    if _checking:
        return _checking[-1]
    from celery.app import app_or_default

    return app_or_default()


def check_settings(**kwargs: Any) -> list[checks.CheckMessage]:
    errors: list[checks.CheckMessage] = []
    try:
        loaded = conf.load()
    except FencedConfigurationError as exc:
        errors.append(checks.Error(str(exc), id="celery_fenced.E001"))
    else:
        errors += short_ttl_messages(
            "fenced_default_ttl", loaded.default_ttl, "fenced_default_ttl"
        )
        for pattern, options in loaded.tasks.items():
            ttl = options.get("ttl")
            if ttl is not None:
                where = f"fenced_tasks[{pattern!r}] ttl"
                errors += short_ttl_messages(where, float(ttl), "fenced_tasks")
    if not settings.USE_TZ:
        errors.append(
            checks.Error(
                "celery-fenced needs USE_TZ = True: lease times are written in UTC by the "
                "database's clock.",
                id="celery_fenced.E002",
            )
        )
    return errors


def short_ttl_messages(where: str, ttl: float, obj: str) -> list[checks.CheckMessage]:
    """E008 when ``ttl`` is below :data:`MIN_LEASE_TTL`."""
    if ttl >= MIN_LEASE_TTL:
        return []
    return [
        checks.Error(
            f"{where} is {ttl:g}s, below {MIN_LEASE_TTL:g}s: too short to renew. The lease "
            f"is renewed every ttl / 3 ({ttl / 3 * 1000:.0f} ms, a database write each "
            f"time) and lost as soon as one renewal is {ttl * 2 / 3 * 1000:.0f} ms late: a "
            "garbage-collection pause, a slow query or a retransmitted packet, and the "
            "running task is fenced out.",
            hint=f"Give a ttl of {MIN_LEASE_TTL:g}s or more: the lease is renewed while the "
            "task runs, so a longer ttl only delays the takeover after a worker is lost. "
            "(If you mean it, say in tests: SILENCED_SYSTEM_CHECKS = "
            '["celery_fenced.E008"].)',
            obj=obj,
            id="celery_fenced.E008",
        )
    ]


def check_unknown_settings(**kwargs: Any) -> list[checks.CheckMessage]:
    """A setting that looks like one of ours but is not (``CELERY_FENCED_TASK``,
    ``CELERY_FENCE_TASKS``, ``CELERY_FENCED_TTL``) would be ignored: name it."""
    written: list[object] = [name for name in dir(settings) if name.isupper()]
    with contextlib.suppress(Exception):  # a broken app configuration is Celery's to report
        written += list(_app().conf.keys())
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


def check_installed_apps(**kwargs: Any) -> list[checks.CheckMessage]:
    from django.apps import apps

    missing = [name for name in REQUIRED_APPS if not apps.is_installed(name)]
    if not missing:
        return []
    return [checks.Error(installed_apps_message(missing), id="celery_fenced.E004")]


def require_apps() -> None:
    """Raise, naming both apps, when one of them is not installed (once apps are ready)."""
    from django.apps import apps

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


def check_result_database(**kwargs: Any) -> list[checks.CheckMessage]:
    """The fenced result backend proves, writes and releases in one transaction (R3) only
    when its results and the leases are in the same database."""
    from django.apps import apps
    from django.db import router

    if not apps.is_installed("django_celery_results"):
        return []  # E004
    if not startup.results_fenced(_app()):
        return []
    from django_celery_results.models import TaskResult

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


def check_database_clock(databases: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """The lease database's clock is UTC, as Django's datetimes are (the MySQL family).

    Its SQL reads ``CURRENT_TIMESTAMP``, which MariaDB and MySQL give in the session's
    time zone, while Django writes and reads naive UTC. A database check: it runs when
    the lease database is among ``databases`` (a worker's start, ``migrate``, ``check
    --database``).
    """
    from django.apps import apps
    from django.db import DatabaseError, connections

    if not databases or not apps.is_installed("django_celery_results"):
        return []  # not asked to read a database; or E004
    from celery_fenced import store

    try:
        alias = store.database_alias()
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


def check_tasks(**kwargs: Any) -> list[checks.CheckMessage]:
    """The project's fenced tasks against the result backend, the broker and each other."""
    from django.apps import apps

    if not apps.is_installed("django_celery_results"):
        return []  # E004: the fenced result backend cannot even be imported
    app = _app()
    try:
        conf.load(app)
    except FencedConfigurationError:
        return []  # E001
    try:
        startup.load_project_tasks(app)
    except FencedConfigurationError as exc:
        return [
            checks.Error(
                f"a task module failed to load: {exc}",
                hint="Fix the task's lease options; the worker would not start.",
                id="celery_fenced.E005",
            )
        ]
    except Exception as exc:  # not ours to judge; the project's own import error
        return [
            checks.Warning(
                f"the project's task modules could not be loaded "
                f"({type(exc).__name__}: {exc}), so its fenced tasks were not checked.",
                hint="The worker imports the same modules at start and would fail the same.",
                id="celery_fenced.W007",
            )
        ]
    messages: list[checks.CheckMessage] = _unmatched_messages(app)
    try:
        tasks = startup.fenced_tasks(app)
    except FencedConfigurationError as exc:
        return [*messages, checks.Error(str(exc), id="celery_fenced.E001")]
    if not tasks:
        return messages
    messages += _result_backend_messages(app, tasks)
    for info in tasks:
        messages += _task_messages(app, info)
    return messages


def _unmatched_messages(app: Any) -> list[checks.CheckMessage]:
    return [
        checks.Warning(
            f"fenced_tasks[{pattern!r}] matches no registered task, so it fences nothing. "
            "(The checks see the tasks of the modules the worker imports at start: the "
            "apps' tasks.py found by app.autodiscover_tasks(), and the imports and include "
            "settings.)",
            hint="Correct the task name or pattern (case counts; patterns never select "
            "celery.* or celery_fenced.* tasks), or make sure the module defining the task "
            "is imported at start.",
            obj=f"fenced_tasks[{pattern!r}]",
            id="celery_fenced.W009",
        )
        for pattern in startup.unmatched_patterns(app)
    ]


def _result_backend_messages(
    app: Any, tasks: list[startup.FencedTaskInfo]
) -> list[checks.CheckMessage]:
    backend = startup.result_backend_name(app)
    names = ", ".join(info.name for info in tasks[:5]) + (", …" if len(tasks) > 5 else "")
    if not backend:
        return [
            checks.Warning(
                f"{len(tasks)} fenced task(s) ({names}), but no result_backend is set: "
                "their results are not stored at all, and AsyncResult.get() raises "
                'NotImplementedError ("No result backend is configured").',
                hint='Set CELERY_RESULT_BACKEND = "fenced-db" (results stored under the '
                "token check); if nothing ever reads a result, silence celery_fenced.W008.",
                id="celery_fenced.W008",
            )
        ]
    if startup.results_fenced(app):
        return []
    return [
        checks.Warning(
            f"{len(tasks)} fenced task(s) ({names}) store their results with result_backend "
            f"{backend!r}, which does not check fencing tokens: a paused worker's late "
            "result can overwrite the result of the newer execution. The leases still "
            "work; the results are not fenced.",
            hint='Set CELERY_RESULT_BACKEND = "fenced-db" '
            '("celery_fenced.backends:FencedDatabaseBackend").',
            id="celery_fenced.W002",
        )
    ]


def _task_messages(app: Any, info: startup.FencedTaskInfo) -> list[checks.CheckMessage]:
    messages: list[checks.CheckMessage] = []
    ttl = info.options.ttl
    own_ttl = None if info.configured else getattr(info.task, "lease_ttl", None)
    if own_ttl is not None:
        messages += short_ttl_messages(f"task {info.name!r}: lease_ttl", own_ttl, info.name)
    if info.configured and info.declared_acks_early:
        messages.append(
            checks.Warning(
                f"task {info.name!r} sets acks_late=False, but fenced_tasks selects it and "
                "a fenced task runs with acks_late=True: its message is acknowledged after "
                "the body, so a job whose worker is lost is delivered again (the fencing "
                "token makes that safe for what the job writes under it).",
                hint="Remove acks_late=False from the task; or, to keep early "
                "acknowledgement, leave it out of fenced_tasks (base=FencedTask with "
                "acks_late=False is allowed, see celery_fenced.W003).",
                obj=info.name,
                id="celery_fenced.W010",
            )
        )
    if not info.acks_late:
        after = (
            "only the reclaimer sends it again, once the lease has expired"
            if info.options.reclaim
            else "nothing sends it again: the job is gone"
        )
        messages.append(
            checks.Warning(
                f"task {info.name!r} is fenced but has acks_late=False: its message is "
                "acknowledged before the body runs, so if the worker is lost mid-task the "
                f"broker does not redeliver it; {after}.",
                hint="Remove acks_late=False (FencedTask defaults to acks_late=True), or "
                "accept that a lost worker's job is not retried by the broker.",
                obj=info.name,
                id="celery_fenced.W003",
            )
        )
    redelivery = startup.visibility_timeout(app)
    if redelivery is not None:
        transport, timeout = redelivery
        busy = ON_BUSY_MEANS[info.options.on_busy]
        hint = (
            'Set CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": ...} above '
            "the task's ttl and its hard time limit."
        )
        if ttl > timeout:
            messages.append(
                checks.Warning(
                    f"task {info.name!r}: lease ttl {ttl:g}s is longer than the broker's "
                    f"visibility_timeout ({timeout:g}s). {transport} redelivers an "
                    f"unacknowledged message after {timeout:g}s, while the lease of a lost "
                    f"worker is still held for up to {ttl:g}s: the copy finds the key busy "
                    f"and {busy}.",
                    hint=hint + " Or lower the ttl.",
                    obj=info.name,
                    id="celery_fenced.W004",
                )
            )
        limit = info.time_limit
        if limit is not None and limit > timeout:
            messages.append(
                checks.Warning(
                    f"task {info.name!r}: hard time limit {limit:g}s is longer than the "
                    f"broker's visibility_timeout ({timeout:g}s): a run that takes longer "
                    f"than {timeout:g}s is redelivered by {transport} while it still holds "
                    f"its lease (renewed), and the copy {busy}.",
                    hint=hint,
                    obj=info.name,
                    id="celery_fenced.W005",
                )
            )
    interval = info.options.renew_interval
    if interval > ttl / 2:
        messages.append(
            checks.Warning(
                f"task {info.name!r}: renew interval {interval:g}s is more than half its "
                f"lease ttl ({ttl:g}s): a single late renewal (a GC pause, a slow "
                "database) loses the lease and the running task is fenced out.",
                hint="Leave the renew interval unset (ttl / 3) or set it at most ttl / 2.",
                obj=info.name,
                id="celery_fenced.W006",
            )
        )
    return messages


def register() -> None:
    for check in (
        check_installed_apps,
        check_settings,
        check_unknown_settings,
        check_result_database,
        check_database_clock,
        collations.check_result_ids,
        check_tasks,
    ):
        checks.register(check, "celery_fenced")


def _lease_database() -> list[str]:
    """The lease database, for the checks that read it (none if it is misconfigured)."""
    from celery_fenced import store

    try:
        return [store.database_alias()]
    except FencedConfigurationError:
        return []


def run(app: Any = None) -> tuple[list[checks.CheckMessage], list[checks.CheckMessage]]:
    """Run celery-fenced's checks of ``app`` (default: the current app) now.

    Returns ``(errors, warnings)``; messages silenced by ``SILENCED_SYSTEM_CHECKS`` are left
    out, as ``manage.py check`` leaves them out.
    """
    if app is not None:
        _checking.append(app)
    try:
        found = checks.run_checks(tags=["celery_fenced"], databases=_lease_database())
    finally:
        if app is not None:
            _checking.pop()
    errors = [m for m in found if m.is_serious()]
    warnings = [m for m in found if not m.is_serious()]
    return errors, warnings
