"""The system checks of the project's fenced tasks: against the result backend, the
broker and each other (the ids are listed in :mod:`celery_fenced.checks`)."""

from __future__ import annotations

from typing import Any

from django.apps import apps
from django.core import checks
from django.db import DatabaseError, connections, router

from celery_fenced import conf, startup
from celery_fenced.exceptions import FencedConfigurationError

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


def check_tasks(**kwargs: Any) -> list[checks.CheckMessage]:
    """The project's fenced tasks against the result backend, the broker and each other."""
    if not apps.is_installed("django_celery_results"):
        return []  # E004: the fenced result backend cannot even be imported
    app = startup.checked_app()
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
    messages += _atomic_messages(app, tasks, kwargs.get("databases"))
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


def _atomic_messages(
    app: Any, tasks: list[startup.FencedTaskInfo], databases: Any
) -> list[checks.CheckMessage]:
    """W011-W013: what keeps the atomic tasks' bodies from committing with their result,
    or from being bounded, on this project's databases (see :mod:`celery_fenced.atomic`)."""
    atomic = [info.name for info in tasks if info.options.atomic]
    if not atomic:
        return []
    names = ", ".join(atomic[:5]) + (", …" if len(atomic) > 5 else "")
    try:
        leases = startup.lease_database()
    except FencedConfigurationError:
        return []  # E001
    messages: list[checks.CheckMessage] = []
    results = router.db_for_write(apps.get_model("django_celery_results", "TaskResult"))
    if startup.results_fenced(app) and results != leases:
        messages.append(
            checks.Warning(
                f"{len(atomic)} atomic task(s) ({names}) run their bodies in a transaction "
                f"on the lease database {leases!r}, but their results are written to "
                f"{results!r}: the result cannot commit with the body. It commits apart, "
                "before the body's transaction, and stands even if that commit then fails.",
                hint="Route django_celery_results.TaskResult to the lease database (see "
                "celery_fenced.W001).",
                id="celery_fenced.W011",
            )
        )
    vendor = lease_vendor(leases, databases)
    if vendor == "sqlite":
        messages.append(
            checks.Warning(
                f"{len(atomic)} atomic task(s) ({names}) on SQLite, which has one writer: "
                "from its first write an atomic body holds the database's write lock until "
                "it ends, so every other write waits for it (other grants, renewals, "
                "results), and a paused body blocks them all; nothing bounds it.",
                hint="Keep atomic bodies short (well under their ttl), or use PostgreSQL "
                "or MariaDB for anything but development.",
                id="celery_fenced.W012",
            )
        )
    elif vendor == "mysql":
        messages.append(
            checks.Warning(
                f"{len(atomic)} atomic task(s) ({names}) on MySQL, which has no server-side "
                "bound on a transaction left idle: a paused atomic body (SIGSTOP, a long "
                "pause) keeps the row locks of what it wrote until it wakes or its "
                "connection dies, and the current holder's writes of those rows wait.",
                hint="Use PostgreSQL or MariaDB for atomic tasks (their bodies are bounded "
                "to about the ttl), or fence the writes with fenced_update() or guard().",
                id="celery_fenced.W013",
            )
        )
    return messages


def lease_vendor(alias: str, databases: Any) -> str | None:
    """The lease database's kind: ``sqlite``, ``postgresql``, ``mariadb``, ``mysql``; None
    for a MariaDB or MySQL server the checks were not given to read (``databases``)."""
    connection = connections[alias]
    if connection.vendor != "mysql":
        return str(connection.vendor)
    if not databases or alias not in databases:
        return None  # which of the family it is takes a query
    try:
        return "mariadb" if getattr(connection, "mysql_is_mariadb", False) else "mysql"
    except DatabaseError:
        return None  # not reachable now: the first lease operation says so


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
