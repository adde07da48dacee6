"""The bad-input catalogue: every way a user can hand celery-fenced something wrong.

Each case calls the real API and expects a clear error naming the cause, and that nothing
was written, lost or corrupted. Where the package does not give one yet, the case is written
as it should behave and marked ``xfail(strict=True)`` with the fix in its reason.

====================================  =========================================================
case                                  where
====================================  =========================================================
each ``fenced_*`` setting: type,      ``SETTINGS`` below (``conf.load``); more values in
range                                 tests/unit/test_conf.py
task options at definition            ``DEFINITIONS`` below; more in tests/unit/test_keys.py
(``lease_ttl``, ``lease_on_busy``,
``lease_renew_interval``,
``lease_key`` of a wrong type or
naming a missing argument)
``fenced_tasks`` key naming a         ``test_configured_key__missing_argument_stops_start``
missing argument
an unknown task pattern               ``test_unknown_task_pattern__warned_at_worker_start``
                                      (a real worker's log)
a key callable that raises, returns   ``EXECUTIONS`` below (a task run as the worker runs it)
a non-string, or works; an over-long
key; unserialisable arguments with
the default key; a template the call
cannot fill
store calls: key, ttl, owner,         ``STORE_CALLS`` below; more in
token, field                          tests/integration/test_store.py
migrations not applied                ``test_migrations_not_applied__error_names_migrate``
the database unreachable at acquire   ``test_database_unreachable__acquire_names_the_server``
a forged token in the message         ``test_forged_token_in_the_request__ignored`` (as the
                                      worker calls the task); with a real worker in
                                      tests/acceptance/test_security.py and
                                      tests/acceptance/test_task_workers.py
an oversized / unserialisable result  ``test_result__oversized_stored_intact``,
                                      ``test_result__unserialisable_names_the_type``
====================================  =========================================================
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from celery import Celery, states
from celery.app.task import Context
from django.db import OperationalError, connections, transaction
from django_celery_results.models import TaskResult
from kombu.exceptions import EncodeError

from celery_fenced import (
    FencedError,
    FencedTask,
    LeaseLost,
    acquire,
    conf,
    fenced_update,
    force_release,
)
from celery_fenced.exceptions import FencedConfigurationError
from celery_fenced.models import Lease, LeaseEvent
from celery_fenced.request_state import RequestState, carry
from devtools.workers import Worker
from testproject.demo.models import Report
from tests.conftest import DATABASE_ALIASES

db = pytest.mark.django_db(transaction=True, databases=DATABASE_ALIASES)


def fresh_app(**values: Any) -> Celery:
    app = Celery("bad-input", set_as_current=False)
    app.conf.update(values)
    return app


# -- settings: each one with a wrong type and a wrong range --------------------------------
SETTINGS = [
    ("fenced_default_ttl", "30", ["fenced_default_ttl", "number of seconds", "'30'"]),
    ("fenced_default_ttl", -5, ["fenced_default_ttl", "greater than 0", "-5"]),
    ("fenced_default_ttl", math.nan, ["fenced_default_ttl", "greater than 0"]),
    ("fenced_renew_interval", "10", ["fenced_renew_interval", "number of seconds", "'10'"]),
    ("fenced_renew_interval", 60, ["fenced_renew_interval", "shorter than the lease ttl"]),
    ("fenced_on_busy", 1, ["fenced_on_busy", "'retry', 'skip', 'fail'", "got 1"]),
    ("fenced_on_busy", "later", ["fenced_on_busy", "'retry', 'skip', 'fail'", "later"]),
    ("fenced_tasks", "chaos.*", ["fenced_tasks", "must be a dict", "str"]),
    ("fenced_tasks", {"chaos.*": {"ttl": -1}}, ["fenced_tasks['chaos.*'] ttl", "greater than 0"]),
    ("fenced_tasks", {"chaos.*": {"tll": 5}}, ["fenced_tasks['chaos.*']", "unknown option(s)"]),
    ("fenced_tasks", {"chaos.*": {"key": ["k"]}}, ["fenced_tasks['chaos.*'] key", "template"]),
    ("fenced_tasks", {"chaos.*": {"on_busy": "never"}}, ["fenced_tasks['chaos.*'] on_busy"]),
    ("fenced_database", 5, ["fenced_database", "database alias in DATABASES", "5"]),
    (
        "fenced_database",
        "replica",
        ["fenced_database", "DATABASES (default, default_replica, ", "'replica'"],
    ),
    # the reclaimer's settings, when the package has them
    ("fenced_reclaim", "yes", ["fenced_reclaim", "True, False or None", "'yes'"]),
    ("fenced_reclaim_max", 0, ["fenced_reclaim_max", "integer of 1 or more", "0"]),
    ("fenced_reclaim_max", "3", ["fenced_reclaim_max", "integer of 1 or more", "'3'"]),
    ("fenced_reclaim_grace", -1, ["fenced_reclaim_grace", "0 or more", "-1"]),
    ("fenced_reclaim_resend_after", 0, ["fenced_reclaim_resend_after", "greater than 0"]),
]


@pytest.mark.parametrize(
    ("name", "value", "fragments"),
    [
        pytest.param(n, v, f, id=f"{n}={v!r}")
        for n, v, f in SETTINGS
        if n in conf.DEFAULTS  # the reclaimer's settings exist only with the reclaimer
    ],
)
def test_setting__wrong_type_or_range_names_the_setting(
    name: str, value: object, fragments: list[str]
) -> None:
    with pytest.raises(FencedConfigurationError) as error:
        conf.load(fresh_app(**{name: value}))
    for fragment in fragments:
        assert fragment in str(error.value)


# -- task options, checked when the task is defined ----------------------------------------
def define(options: dict[str, Any], app: Celery | None = None) -> Any:
    app = app or fresh_app()

    def rebuild(report_id: int, part: str = "all") -> dict[str, Any]:
        from celery_fenced import current_lease

        lease = current_lease()
        return {"key": lease.key if lease else None, "token": lease.token if lease else None}

    app.task(name="bad.rebuild", base=FencedTask, shared=False, **options)(rebuild)
    return app.tasks["bad.rebuild"]


DEFINITIONS = [
    ({"lease_ttl": 0}, ["'bad.rebuild'", "lease_ttl", "greater than 0"]),
    ({"lease_ttl": "30"}, ["'bad.rebuild'", "lease_ttl", "'30'"]),
    ({"lease_on_busy": "later"}, ["'bad.rebuild'", "lease_on_busy", "'retry', 'skip', 'fail'"]),
    (
        {"lease_ttl": 6, "lease_renew_interval": 6},
        ["'bad.rebuild'", "lease_renew_interval", "shorter than the lease ttl (6s)"],
    ),
    ({"lease_key": 42}, ["'bad.rebuild'", "lease_key must be a str.format template"]),
    (
        {"lease_key": "report:{report}"},
        ["'bad.rebuild'", "names report", "not an argument", "report_id, part"],
    ),
    ({"lease_key": "report:{0}"}, ["must name arguments", "not use positional fields"]),
    # a misspelt or unprefixed option would be kept by Celery and read by nobody
    (
        {"lease_tll": 30},
        ["'bad.rebuild'", "unknown option lease_tll", "did you mean lease_ttl?", "lease_on_busy"],
    ),
    ({"on_busy": "skip"}, ["'bad.rebuild'", "option on_busy is not read", "(lease_on_busy)"]),
]


@pytest.mark.parametrize(
    ("options", "fragments"), DEFINITIONS, ids=[next(iter(o.items()))[0] for o, _ in DEFINITIONS]
)
def test_definition__bad_option_names_the_task_and_option(
    options: dict[str, Any], fragments: list[str]
) -> None:
    with pytest.raises(FencedConfigurationError) as error:
        define(options)
    for fragment in fragments:
        assert fragment in str(error.value)


def test_configured_key__missing_argument_stops_start() -> None:
    from celery_fenced.hooks import fence_configured_tasks

    def plain(report_id: int) -> int:
        return report_id

    app = fresh_app(fenced_tasks={"bad.plain": {"key": "job:{job}"}})
    app.task(name="bad.plain", shared=False)(plain)
    with pytest.raises(FencedConfigurationError) as error:
        fence_configured_tasks(app)
    assert "'bad.plain'" in str(error.value)
    assert "names job, which is not an argument of the task" in str(error.value)


@db  # the worker stops without the lease tables
@pytest.mark.workers
@pytest.mark.timeout(120)
def test_unknown_task_pattern__warned_at_worker_start(tmp_path: Path) -> None:
    env = {"FENCED_TASKS_JSON": json.dumps({"reports.nosuch_*": {"ttl": 5}})}
    worker = Worker("unknown", database="default", queue="q-unknown", log_dir=tmp_path, env=env)
    try:
        worker.wait_ready()
        output = worker.output()
        warning = "fenced_tasks['reports.nosuch_*'] matches no registered task"
        # the check's, once (the project's LOGGING echoes it on the console handler):
        # not once per pool process
        logged = [line for line in output.splitlines() if warning in line and "WARNING/" in line]
        assert len(logged) == 1, output
        assert logged[0].endswith("(celery_fenced.W009)")
    finally:
        worker.stop()


# -- executions: the task run as the worker runs it ----------------------------------------
def boom(args: Any, kwargs: Any) -> str:
    raise RuntimeError("boom")


def not_a_string(args: Any, kwargs: Any) -> Any:
    return 42


def report_key(args: Any, kwargs: Any) -> str:
    return f"report:{args[0] if args else kwargs['report_id']}"


class Unserialisable:
    pass


EXECUTIONS = [
    pytest.param(
        {"lease_key": boom},
        (1,),
        "the lease_key callable raised RuntimeError('boom')",
        id="key-callable-raises",
    ),
    pytest.param(
        {"lease_key": not_a_string},
        (1,),
        "the lease_key callable must return a str, got int",
        id="key-callable-returns-int",
    ),
    pytest.param(
        {"lease_key": report_key},
        (7,),
        None,  # no error: the callable's key is used
        id="key-callable-valid",
    ),
    pytest.param(
        {"lease_key": "report:{part}"},
        (1, "p" * 300),
        "the lease key must be at most 255 characters, got 307",
        id="key-over-long",
    ),
    pytest.param(
        {},
        (Unserialisable(),),
        "not JSON-serialisable (Object of type Unserialisable is not JSON serializable); "
        "give the task a lease_key",
        id="default-key-unserialisable-arguments",
    ),
    pytest.param(
        {"lease_key": "report:{report_id.missing}"},
        (1,),
        "could not be filled from the call's arguments",
        id="key-template-unfillable",
    ),
]


def rows(alias: str) -> tuple[list[Any], list[Any], list[Any]]:
    """Everything celery-fenced and the result backend hold, to compare before and after."""
    return (
        list(Lease.objects.using(alias).order_by("pk").values()),
        list(LeaseEvent.objects.using(alias).order_by("pk").values()),
        list(TaskResult.objects.using(alias).order_by("pk").values()),
    )


def run_as_worker(task: Any, args: tuple[Any, ...], **request: Any) -> Any:
    """Run ``task`` as the worker's tracer does: push the request, call, ``after_return``."""
    task_id = "bad-input-task"
    task.push_request(
        id=task_id, args=args, kwargs={}, hostname="w@h", called_directly=False, **request
    )
    try:
        try:
            result = task(*args)
        except Exception as exc:
            task.after_return(states.FAILURE, exc, task_id, args, {}, None)
            raise
        task.after_return(states.SUCCESS, result, task_id, args, {}, None)
        return result
    finally:
        task.pop_request()


@db
@pytest.mark.parametrize(("options", "args", "message"), EXECUTIONS)
def test_execution__bad_key_fails_the_task_naming_it_and_writes_nothing(
    lease_db: str, options: dict[str, Any], args: tuple[Any, ...], message: str | None
) -> None:
    task = define({"lease_ttl": 30, **options})
    before = rows(lease_db)
    if message is None:
        assert run_as_worker(task, args) == {"key": "report:7", "token": 1}
        return
    with pytest.raises(FencedError) as error:
        run_as_worker(task, args)
    assert str(error.value).startswith("task 'bad.rebuild': ")
    assert message in str(error.value)
    assert rows(lease_db) == before


@db
def test_forged_token_in_the_request__ignored(lease_db: str) -> None:
    """Headers become request attributes in the worker; the execution's own grant wins."""
    task = define({"lease_ttl": 30, "lease_key": "report:{report_id}"})
    forged = {"fencing_token": 999, "lease_key": "forged", "_fenced_state": "forged"}
    assert run_as_worker(task, (5,), **forged) == {"key": "report:5", "token": 1}
    assert list(Lease.objects.using(lease_db).values_list("key", "token")) == [("report:5", 1)]


# -- the store API: each argument wrong ---------------------------------------------------
def held(alias: str) -> Any:
    return acquire("store:held", ttl=30, owner="holder", using=alias)


STORE_CALLS: list[Any] = [
    pytest.param(
        lambda a: acquire("k" * 256, ttl=30, using=a),
        ValueError,
        "key must be at most 255 characters",
        id="acquire-key-too-long",
    ),
    pytest.param(
        lambda a: acquire("", ttl=30, using=a),
        ValueError,
        "key must be a non-empty string",
        id="acquire-key-empty",
    ),
    pytest.param(
        lambda a: acquire("k\x00nul", ttl=30, using=a),
        ValueError,
        "key must not contain NUL",
        id="acquire-key-with-nul",
    ),
    pytest.param(
        lambda a: acquire("k", ttl=0, using=a),
        ValueError,
        "ttl must be a number of seconds greater than 0",
        id="acquire-ttl-zero",
    ),
    pytest.param(
        lambda a: acquire("k", ttl="30", using=a),
        ValueError,
        "ttl must be a number of seconds greater than 0, got '30'",
        id="acquire-ttl-string",
    ),
    pytest.param(
        lambda a: acquire("k", ttl=30, owner="o" * 256, using=a),
        ValueError,
        "owner must be at most 255 characters",
        id="acquire-owner-too-long",
    ),
    pytest.param(
        lambda a: fenced_update(Report.objects.using(a).all(), token=0, body="x"),
        ValueError,
        "token must be a fencing token (an int >= 1), got 0",
        id="fenced-update-token-zero",
    ),
    pytest.param(
        lambda a: fenced_update(Report.objects.using(a).all(), token=True, body="x"),
        ValueError,
        "got True",
        id="fenced-update-token-bool",
    ),
    pytest.param(
        lambda a: fenced_update(Report.objects.using(a).all(), token=1, field="nosuch"),
        ValueError,
        "field 'nosuch' is not a field of demo.Report",
        id="fenced-update-unknown-field",
    ),
    pytest.param(
        lambda a: force_release("k" * 300, using=a),
        ValueError,
        "key must be at most 255 characters",
        id="force-release-key-too-long",
    ),
    pytest.param(
        lambda a: (lambda lease: (lease.release(), lease.renew()))(held(a)),
        LeaseLost,
        "lease 'store:held' under token 1 was lost",
        id="renew-after-release",
    ),
]


@db
@pytest.mark.parametrize(("call", "error", "message"), STORE_CALLS)
def test_store__bad_call_names_the_cause_and_changes_nothing(
    alias: str, call: Callable[[str], Any], error: type[Exception], message: str
) -> None:
    report = Report.objects.using(alias).create(name="untouched", body="as it was")
    with pytest.raises(error) as raised:
        call(alias)
    assert message in str(raised.value)
    assert Report.objects.using(alias).get(pk=report.pk).body == "as it was"
    assert not Lease.objects.using(alias).exclude(key="store:held").exists()


# -- the database: tables missing, server unreachable -------------------------------------
@db
def test_migrations_not_applied__error_names_migrate(alias: str) -> None:
    caught = acquire_without_tables(alias)
    assert isinstance(caught, FencedConfigurationError), repr(caught)
    assert "migrate" in str(caught)
    assert Lease.objects.using(alias).count() == 0  # the tables are back, untouched


@pytest.mark.workers
@pytest.mark.timeout(120)
def test_migrations_not_applied__worker_start_stops_naming_migrate(tmp_path: Path) -> None:
    empty = tmp_path / "never-migrated.sqlite3"
    env = {"FENCED_USE_TEST_DATABASES": "0", "FENCED_SQLITE_PATH": str(empty)}
    worker = Worker(
        "unmigrated", database="default", queue="q-unmigrated", log_dir=tmp_path, env=env
    )
    try:
        assert worker.process.wait(timeout=60) != 0
        assert "celery_fenced_lease of celery_fenced does not exist" in worker.output()
        assert "manage.py migrate celery_fenced" in worker.output()
    finally:
        worker.stop()


class _Rollback(Exception):
    pass


def acquire_without_tables(alias: str) -> Exception | None:
    """``acquire`` with celery_fenced's tables dropped, in a transaction then rolled back."""
    caught = None
    try:
        with transaction.atomic(using=alias):  # DDL is transactional on both databases
            with connections[alias].cursor() as cursor:
                cursor.execute(f"DROP TABLE {LeaseEvent._meta.db_table}")
                cursor.execute(f"DROP TABLE {Lease._meta.db_table}")
            try:
                acquire("k", ttl=30, using=alias)
            except Exception as exc:
                caught = exc
            raise _Rollback
    except _Rollback:
        pass
    return caught


@db
def test_database_unreachable__acquire_names_the_server() -> None:
    connection = connections["postgres"]
    port = connection.settings_dict["PORT"]
    connection.close()
    connection.settings_dict["PORT"] = "1"  # nothing listens there
    try:
        with pytest.raises(OperationalError) as error:
            acquire("k", ttl=30, using="postgres")
    finally:
        connection.close()
        connection.settings_dict["PORT"] = port
    assert 'connection to server at "127.0.0.1", port 1 failed' in str(error.value)
    # nothing half-done: the next acquire is the key's first grant
    assert acquire("k", ttl=30, using="postgres").token == 1


# -- results --------------------------------------------------------------------------------
def backend_and_request(alias: str, task_id: str) -> tuple[Any, Context]:
    from celery_fenced.backends import FencedDatabaseBackend
    from testproject.celery import app

    lease = acquire(f"result:{task_id}", ttl=30, task_id=task_id, using=alias)
    request = Context(id=task_id, task="bad.rebuild", args=[], kwargs={}, hostname="w@h")
    carry(request, RequestState(lease=lease))
    return FencedDatabaseBackend(app=app), request


@db
def test_result__oversized_stored_intact(lease_db: str) -> None:
    backend, request = backend_and_request(lease_db, "big")
    big = "x" * (8 * 1024 * 1024)
    backend.store_result("big", big, states.SUCCESS, request=request)
    row = TaskResult.objects.using(lease_db).get(task_id="big")
    assert (row.status, json.loads(row.result) == big) == ("SUCCESS", True)
    assert json.loads(row.meta)["fencing_token"] == 1
    assert Lease.objects.using(lease_db).get(key="result:big").released_at is not None


@db
def test_result__unserialisable_names_the_type(lease_db: str) -> None:
    backend, request = backend_and_request(lease_db, "odd")
    with pytest.raises(EncodeError, match="Object of type Unserialisable is not JSON"):
        backend.store_result("odd", Unserialisable(), states.SUCCESS, request=request)
    assert not TaskResult.objects.using(lease_db).filter(task_id="odd").exists()
    lease = Lease.objects.using(lease_db).get(key="result:odd")
    assert lease.released_at is None  # still held: the worker stores the EncodeError next
    backend.mark_as_failure("odd", EncodeError("unserialisable"), request=request)
    assert TaskResult.objects.using(lease_db).get(task_id="odd").status == "FAILURE"
    assert Lease.objects.using(lease_db).get(key="result:odd").released_at is not None
