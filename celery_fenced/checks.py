"""Django system checks: misconfiguration is named at start, not on the first task.

``manage.py check`` runs them, and so does every worker at start (:mod:`celery_fenced.hooks`
stops it on an error and logs the warnings). Each message names the setting or the task
and what would be valid.

| id | what |
|---|---|
| E001 | a ``fenced_*`` setting, or a fenced task's options, invalid |
| E002 | ``USE_TZ = False`` |
| E003 | an unknown ``fenced_*`` / ``CELERY_FENCED_*`` setting (a typo is otherwise ignored) |
| E004 | ``django_celery_results`` missing from ``INSTALLED_APPS`` |
| E005 | a task module fails to load with a celery-fenced error (a lease-key template) |
| E006 | the lease database is MariaDB or MySQL and its session time zone is not UTC |
| E007 | MariaDB or MySQL compares result or group ids by a collation that folds them |
| W001 | results and leases in different databases |
| W002 | fenced tasks, but the result backend does not fence results |
| W003 | a fenced task with ``acks_late=False`` |
| W004 | a lease ttl longer than the broker's visibility timeout |
| W005 | a task's hard time limit longer than the broker's visibility timeout |
| W006 | a renew interval above half the ttl |
| W007 | the task modules fail to load for another reason: the fenced tasks go unchecked |
"""

from __future__ import annotations

import difflib
from typing import Any

from django.conf import settings
from django.core import checks

from celery_fenced import collations, conf, startup
from celery_fenced.exceptions import FencedConfigurationError

REQUIRED_APPS = ("django_celery_results", "celery_fenced")
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


def check_unknown_settings(**kwargs: Any) -> list[checks.CheckMessage]:
    """A mistyped setting name (``CELERY_FENCED_TASK``) would be ignored: name it."""
    known = set(conf.DEFAULTS)
    written: dict[str, str] = {}  # the name as written -> the fenced_* name it means
    for name in dir(settings):
        if name.startswith("CELERY_FENCED_"):
            written[name] = name[len("CELERY_") :].lower()
    try:
        names = list(_app().conf.keys())
    except Exception:  # a broken app configuration is Celery's to report
        names = []
    for name in names:
        if not isinstance(name, str):
            continue
        if name.upper().startswith("CELERY_FENCED_"):
            written[name] = name[len("CELERY_") :].lower()
        elif name.lower().startswith("fenced_"):
            written[name] = name.lower()
    errors: list[checks.CheckMessage] = []
    for name, meant in sorted(written.items()):
        if meant in known:
            continue
        django_style = name.upper().startswith("CELERY_")
        close = difflib.get_close_matches(meant, sorted(known), n=1, cutoff=0.6)
        spelled = [f"CELERY_{c.upper()}" if django_style else c for c in close]
        guess = f" Did you mean {spelled[0]}?" if spelled else ""
        valid = ", ".join(f"CELERY_{k.upper()}" if django_style else k for k in sorted(known))
        effect = (
            "the tasks it names run unfenced"
            if close == ["fenced_tasks"]
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
    try:
        tasks = startup.fenced_tasks(app)
    except FencedConfigurationError as exc:
        return [checks.Error(str(exc), id="celery_fenced.E001")]
    if not tasks:
        return []
    messages: list[checks.CheckMessage] = []
    messages += _result_backend_messages(app, tasks)
    for info in tasks:
        messages += _task_messages(app, info)
    return messages


def _result_backend_messages(
    app: Any, tasks: list[startup.FencedTaskInfo]
) -> list[checks.CheckMessage]:
    backend = startup.result_backend_name(app)
    if not backend or startup.results_fenced(app):
        return []
    names = ", ".join(info.name for info in tasks[:5]) + (", …" if len(tasks) > 5 else "")
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
