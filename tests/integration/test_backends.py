"""FencedDatabaseBackend: plain tasks exactly as DatabaseBackend; fenced writes by R1-R3."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import pytest
from billiard.exceptions import WorkerLostError
from celery import states
from celery.app.task import Context
from celery.result import GroupResult as CeleryGroup
from django.db import connections, transaction
from django.db.models import F
from django.test.utils import CaptureQueriesContext
from django_celery_results.backends.database import DatabaseBackend
from django_celery_results.models import ChordCounter, TaskResult

from celery_fenced import acquire, store
from celery_fenced.backends import FencedDatabaseBackend
from celery_fenced.models import Lease, LeaseEvent
from celery_fenced.request_state import RequestState, carry
from celery_fenced.requests import EndedProcess
from celery_fenced.store import Delivery
from testproject.celery import app
from tests import routers
from tests.conftest import DELIVERED, WITH_MARIADB, run_in_threads

pytestmark = pytest.mark.django_db(transaction=True, databases=WITH_MARIADB)


@pytest.fixture
def alias(alias_with_mariadb: str) -> str:
    """SQLite, PostgreSQL and MariaDB."""
    return alias_with_mariadb


@pytest.fixture
def routed(alias: str, settings: Any) -> Iterator[str]:
    """Every model (results and leases) on ``alias``."""
    routers.TARGET = alias
    settings.DATABASE_ROUTERS = ["tests.routers.AllToTarget"]
    yield alias
    routers.TARGET = "default"


def request_for(task_id: str, lease: Any = None) -> Context:
    request = Context(
        id=task_id,
        task="testproject.demo.tasks.probe",
        args=[1],
        kwargs={"a": 2},
        hostname="w@h",
        argsrepr="[1]",
        kwargsrepr="{'a': 2}",
        called_directly=False,  # delivered to a worker, as the tracer's request
    )
    if lease is not None:
        carry(request, RequestState(lease=lease))
    return request


def row(alias: str, task_id: str) -> dict[str, Any]:
    found = TaskResult.objects.using(alias).values().get(task_id=task_id)
    return {
        k: v
        for k, v in found.items()
        if k not in ("id", "task_id", "date_created", "date_done", "date_started")
    }


def assert_same_row_but_token(alias: str, lease: Any) -> None:
    """Task "fenced"'s row is task "plain"'s, but for the token and key in its meta."""
    written, expected = row(alias, "fenced"), row(alias, "plain")
    meta = json.loads(written.pop("meta"))
    assert (meta.pop("fencing_token"), meta.pop("lease_key")) == (lease.token, lease.key)
    assert meta == json.loads(expected.pop("meta"))
    assert written == expected


@pytest.mark.core
@pytest.mark.parametrize(
    ("state", "value"),
    [
        (states.SUCCESS, {"answer": 42}),
        (states.FAILURE, ValueError("boom")),
        (states.STARTED, {"pid": 1}),
        (states.RETRY, KeyError("again")),
    ],
)
def test_plain_task__stored_exactly_as_database_backend(
    routed: str, state: str, value: Any
) -> None:
    app.conf.result_extended = True
    DatabaseBackend(app=app).store_result("plain", value, state, request=request_for("plain"))
    FencedDatabaseBackend(app=app).store_result(
        "fenced", value, state, request=request_for("fenced")
    )
    assert row(routed, "fenced") == row(routed, "plain")


@pytest.mark.parametrize("how", ["app.conf", "django settings"])
def test_fenced_result__follows_result_extended_as_it_changes(
    routed: str, how: str, settings: Any
) -> None:
    """The fenced backend keeps ``result_extended`` with the package's settings: each
    success is stored as DatabaseBackend stores it, before and after the setting
    changes, whichever way it changes."""
    plain, fenced = DatabaseBackend(app=app), FencedDatabaseBackend(app=app)
    extended = []
    try:
        for on in (False, True, False):
            if how == "app.conf":
                app.conf.result_extended = on
            else:
                app.conf.pop("result_extended", None)
                settings.CELERY_RESULT_EXTENDED = on
            lease = acquire("job", ttl=30, task_id="fenced", using=routed)
            plain.store_result("plain", {"on": on}, states.SUCCESS, request=request_for("plain"))
            fenced.mark_as_done("fenced", {"on": on}, request=request_for("fenced", lease))
            assert_same_row_but_token(routed, lease)
            extended.append(row(routed, "fenced")["task_name"] is not None)
    finally:
        app.conf.pop("result_extended", None)  # the project's setting again
    assert extended == [False, True, False]


@pytest.mark.core
@pytest.mark.parametrize(
    ("state", "value"),
    [
        (states.SUCCESS, {"answer": 42}),
        (states.FAILURE, ValueError("boom")),
        (states.RETRY, KeyError("again")),
        ("PROGRESS", {"done": 3}),
    ],
)
@pytest.mark.parametrize("existing", [False, True], ids=["new row", "over a row"])
def test_fenced_result__row_as_database_backend_writes_it(
    routed: str, state: str, value: Any, existing: bool
) -> None:
    """One upsert writes what DatabaseBackend's get_or_create (+ save) would, token aside."""
    app.conf.result_extended = True
    plain, fenced = DatabaseBackend(app=app), FencedDatabaseBackend(app=app)
    lease = acquire("job", ttl=30, task_id="fenced", using=routed)
    if existing:
        plain.store_result("plain", {"pid": 1}, states.STARTED, request=request_for("plain"))
        fenced.store_result("fenced", {"pid": 1}, states.STARTED, request=request_for("fenced"))
    created = {
        t: TaskResult.objects.using(routed).filter(task_id=t).values_list("date_created").first()
        for t in ("plain", "fenced")
    }
    plain.store_result("plain", value, state, request=request_for("plain"))
    fenced.store_result("fenced", value, state, request=request_for("fenced", lease))
    assert_same_row_but_token(routed, lease)
    stored = TaskResult.objects.using(routed).get(task_id="fenced")
    if existing:  # the first write's creation time and start time are kept
        assert (stored.date_created,) == created["fenced"]
        assert stored.date_started is not None
    assert stored.date_done >= stored.date_created


def settling_connection(alias: str) -> Any:
    """The connection a success settles on: this thread's kept one (PostgreSQL, outside
    a transaction; ``celery_fenced.store.owned``), else Django's."""
    return store.kept_connection(alias, DELIVERED) or connections[alias]


@pytest.mark.parametrize("existing", [False, True], ids=["new row", "over a row"])
@pytest.mark.parametrize("outer", [False, True], ids=["autocommit", "in a transaction"])
def test_fenced_success__proven_released_and_stored_in_one_statement(
    routed: str, existing: bool, outer: bool
) -> None:
    """A success that drives nothing: on PostgreSQL the releasing statement writes the row.

    The row is what ``DatabaseBackend.mark_as_done`` writes (token aside), the grant is
    released and its job marked completed; inside a transaction the caller opened, or on
    SQLite, the proof and the row are two statements of one transaction instead.
    """
    app.conf.result_extended = True
    plain, fenced = DatabaseBackend(app=app), FencedDatabaseBackend(app=app)
    delivery = Delivery("fenced", "d" * 32, 0)
    lease = store.grant("job", ttl=30, task_id="fenced", using=routed, delivery=delivery)
    if existing:
        plain.store_result("plain", {"pid": 1}, states.STARTED, request=request_for("plain"))
        fenced.store_result("fenced", {"pid": 1}, states.STARTED, request=request_for("fenced"))
    plain.mark_as_done("plain", {"answer": 42}, request=request_for("plain"))
    with contextlib.ExitStack() as stack:
        if outer:
            stack.enter_context(transaction.atomic(using=routed))
        with CaptureQueriesContext(settling_connection(routed)) as queries:
            fenced.mark_as_done("fenced", {"answer": 42}, request=request_for("fenced", lease))
    assert_same_row_but_token(routed, lease)
    stored = TaskResult.objects.using(routed).get(task_id="fenced")
    assert (stored.date_started is not None) == existing
    held = Lease.objects.using(routed).get(key="job")
    assert (held.released_at is not None, held.release_state) == (True, states.SUCCESS)
    assert held.completed_digest == delivery.digest
    assert lease.released
    statements = [
        q["sql"]
        for q in queries.captured_queries
        if not q["sql"].startswith(("SAVEPOINT", "RELEASE SAVEPOINT", "BEGIN", "COMMIT"))
    ]
    both = [
        sql
        for sql in statements
        if "UPDATE celery_fenced_lease" in sql and "django_celery_results_taskresult" in sql
    ]
    if connections[routed].vendor == "postgresql" and not outer:
        assert statements == both, statements
        assert len(both) == 1
    else:
        assert not both
        assert len(statements) >= 2


def test_fenced_result__written_with_token_and_released_in_one_transaction(routed: str) -> None:
    lease = acquire("job", ttl=30, task_id="t1", using=routed)
    backend = FencedDatabaseBackend(app=app)
    backend.store_result("t1", {"ok": True}, states.SUCCESS, request=request_for("t1", lease))
    stored = TaskResult.objects.using(routed).get(task_id="t1")
    assert stored.status == states.SUCCESS
    assert json.loads(stored.meta)["fencing_token"] == lease.token
    row = Lease.objects.using(routed).get(key="job")
    assert (row.released_at is not None, row.release_state) == (True, "SUCCESS")
    assert not LeaseEvent.objects.using(routed).exists()  # routine: on the row only
    assert lease.released


TASK_IDS_THAT_DIFFER_ONLY_IN = pytest.mark.parametrize(
    ("one", "other"), [("Job-1", "job-1"), ("t", "t "), ("é", "e")], ids=["case", "pad", "accent"]
)


@TASK_IDS_THAT_DIFFER_ONLY_IN
def test_fenced_results__task_ids_compare_byte_for_byte(routed: str, one: str, other: str) -> None:
    """Two jobs whose task ids differ in case, trailing spaces or accents have two result
    rows and each reads back its own, whatever the database's default collation (MariaDB's
    ``utf8mb4_general_ci`` made them one row: the second's upsert wrote over the first's)."""
    backend = FencedDatabaseBackend(app=app)
    for task_id in (one, other):
        lease = acquire(f"key:{task_id}", ttl=30, task_id=task_id, using=routed)
        assert lease.token == 1
        backend.mark_as_done(task_id, {"id": task_id}, request=request_for(task_id, lease))
    rows = dict(TaskResult.objects.using(routed).values_list("task_id", "result"))
    assert {task_id: json.loads(value) for task_id, value in rows.items()} == {
        one: {"id": one},
        other: {"id": other},
    }
    for task_id in (one, other):
        assert backend.get_task_meta(task_id)["result"] == {"id": task_id}
        assert app.AsyncResult(task_id, backend=backend).get(timeout=10) == {"id": task_id}


@TASK_IDS_THAT_DIFFER_ONLY_IN
def test_groups__group_ids_compare_byte_for_byte(routed: str, one: str, other: str) -> None:
    """Group ids name group results and chord counters as task ids name result rows: two
    groups whose ids differ in case, trailing spaces or accents are two groups."""
    backend = FencedDatabaseBackend(app=app)
    for group_id in (one, other):
        members = [app.AsyncResult(f"{group_id}:member", backend=backend)]
        backend.save_group(group_id, CeleryGroup(group_id, members, app=app))
        ChordCounter.objects.using(routed).create(group_id=group_id, sub_tasks="[]", count=1)
    for group_id in (one, other):
        restored = backend.restore_group(group_id)
        assert [member.id for member in restored] == [f"{group_id}:member"]
        assert ChordCounter.objects.using(routed).get(group_id=group_id).group_id == group_id


def test_stale_result__redelivery_of_same_task_writes_nothing(routed: str) -> None:
    stale = acquire("job", ttl=30, task_id="t1", using=routed)
    Lease.objects.using(routed).filter(key="job").update(expires_at=F("acquired_at"))
    fresh = acquire("job", ttl=30, task_id="t1", using=routed)
    backend = FencedDatabaseBackend(app=app)
    backend.store_result("t1", {"by": "fresh"}, states.SUCCESS, request=request_for("t1", fresh))
    backend.store_result("t1", {"by": "stale"}, states.SUCCESS, request=request_for("t1", stale))
    stored = TaskResult.objects.using(routed).get(task_id="t1")
    assert json.loads(stored.result) == {"by": "fresh"}
    assert stale.lost
    rejected = LeaseEvent.objects.using(routed).get(kind="stale_write_rejected")
    assert (rejected.token, rejected.detail["current_token"]) == (stale.token, fresh.token)


@pytest.mark.core
@pytest.mark.parametrize("state", [states.SUCCESS, states.STARTED, states.RETRY])
def test_stale_result__other_task_ends_as_failure_with_stale_token(
    routed: str, state: str
) -> None:
    stale = acquire("report:1", ttl=30, task_id="old", using=routed)
    Lease.objects.using(routed).filter(key="report:1").update(expires_at=F("acquired_at"))
    acquire("report:1", ttl=30, task_id="new", using=routed)
    backend = FencedDatabaseBackend(app=app)
    backend.store_result("old", {"v": 1}, state, request=request_for("old", stale))
    stored = TaskResult.objects.using(routed).filter(task_id="old").first()
    if state in states.READY_STATES:
        assert stored is not None
        assert stored.status == states.FAILURE
        assert json.loads(stored.result)["exc_type"] == "StaleToken"
    else:
        assert stored is None  # a stale STARTED/RETRY is simply not stored


@pytest.mark.core
def test_untokened_write__never_overwrites_a_fenced_final_result(routed: str) -> None:
    lease = acquire("job", ttl=30, task_id="t1", using=routed)
    backend = FencedDatabaseBackend(app=app)
    backend.store_result("t1", {"ok": 1}, states.SUCCESS, request=request_for("t1", lease))
    # the worker's main process writes WorkerLostError with a request built from the
    # message: no lease, and a forged token header is just an attribute
    forged = request_for("t1")
    forged.fencing_token = 10**6
    backend.store_result("t1", WorkerLostError("lost"), states.FAILURE, request=forged)
    assert TaskResult.objects.using(routed).get(task_id="t1").status == states.SUCCESS


def test_statements__fenced_result_write_against_plain(routed: str) -> None:
    app.conf.result_extended = True
    connection = connections[routed]
    with CaptureQueriesContext(connection) as plain:
        DatabaseBackend(app=app).store_result(
            "p", {"v": 1}, states.SUCCESS, request=request_for("p")
        )
    lease = acquire("job", ttl=30, task_id="f", using=routed)
    with CaptureQueriesContext(connection) as fenced:
        FencedDatabaseBackend(app=app).store_result(
            "f", {"v": 1}, states.SUCCESS, request=request_for("f", lease)
        )
    control = ("BEGIN", "COMMIT", "SAVEPOINT", "RELEASE SAVEPOINT", "ROLLBACK")

    def data(q: CaptureQueriesContext) -> int:
        return sum(not x["sql"].strip().upper().startswith(control) for x in q.captured_queries)

    # the proof and the release are one conditional UPDATE (with its event on PostgreSQL;
    # the event follows it on SQLite), and it comes first: the lease row is locked before
    # the result row; the row itself is one upsert where the plain write sends a SELECT
    # and an INSERT, and no savepoint is opened inside the fenced transaction
    extra = data(fenced) - data(plain)
    print(f"{routed}: plain {data(plain)} statements, fenced {data(fenced)}")
    # MariaDB: the lease row's lock (with the clock), its release, the result lock (with
    # no row yet: made and deleted again, so that it locks); the result row in one ON
    # DUPLICATE KEY UPDATE
    assert extra <= {"postgres": 0, "default": 1}.get(routed, 3)
    assert not [x for x in fenced.captured_queries if "SAVEPOINT" in x["sql"].upper()]
    first = next(
        x["sql"]
        for x in fenced.captured_queries
        if not x["sql"].strip().upper().startswith(control)
    )
    if connection.vendor == "mysql":  # the lease row's lock comes first
        assert "FROM celery_fenced_lease WHERE `key` = 'job' FOR UPDATE" in first
    else:
        assert "UPDATE celery_fenced_lease SET released_at" in first
    assert Lease.objects.using(routed).get(key="job").released_at is not None


def main_process_request(task_id: str, pid: int | None) -> Context:
    """The context the worker's main process reports with (see celery_fenced.requests)."""
    request = request_for(task_id)
    carry(request, RequestState(process=EndedProcess(f"w@h:{pid}:" if pid else None)))
    return request


def report(state: str, task_id: str, request: Context) -> None:
    backend = FencedDatabaseBackend(app=app)
    if state == states.REVOKED:
        backend.mark_as_revoked(task_id, "terminated", request=request)
    else:
        backend.mark_as_failure(task_id, WorkerLostError("lost"), request=request)


@pytest.mark.parametrize("state", [states.REVOKED, states.FAILURE])
def test_main_process_report__ends_the_grant_of_the_process_that_ended_only(
    routed: str, state: str
) -> None:
    mine = acquire("job:mine", ttl=30, task_id="t1", owner="w@h:100:1", using=routed)
    other = acquire("job:other", ttl=30, task_id="t2", owner="w@h:100:2", using=routed)
    report(state, "t1", main_process_request("t1", 100))
    assert Lease.objects.using(routed).get(key="job:mine").released_at is not None
    assert Lease.objects.using(routed).get(key="job:other").released_at is None
    event = LeaseEvent.objects.using(routed).get(kind="force_released")
    assert (event.token, event.task_id) == (mine.token, "t1")
    assert TaskResult.objects.using(routed).get(task_id="t1").status == state
    other.renew()


@pytest.mark.parametrize("pid", [200, None], ids=["stale-process", "never-started"])
@pytest.mark.parametrize("state", [states.REVOKED, states.FAILURE])
def test_main_process_report__changes_nothing_while_another_execution_holds_the_job(
    routed: str, state: str, pid: int | None
) -> None:
    """A's time limit / lost child / a late copy's expiry, while B runs the job (issue
    14, case 1): B's grant stands, nothing is stored, and B's SUCCESS is stored later."""
    current = acquire("job", ttl=30, task_id="t1", owner="w@h:100:1", using=routed)
    report(state, "t1", main_process_request("t1", pid))
    assert Lease.objects.using(routed).get(key="job").released_at is None
    assert not LeaseEvent.objects.using(routed).filter(kind="force_released").exists()
    assert not TaskResult.objects.using(routed).filter(task_id="t1").exists()
    current.renew()
    backend = FencedDatabaseBackend(app=app)
    backend.mark_as_done("t1", {"v": 1}, request=request_for("t1", current))
    assert TaskResult.objects.using(routed).get(task_id="t1").status == states.SUCCESS


@pytest.mark.parametrize("state", [states.REVOKED, states.FAILURE])
def test_main_process_report__without_any_grant_is_stored_as_celery_would(
    routed: str, state: str
) -> None:
    report(state, "t1", main_process_request("t1", None))
    assert TaskResult.objects.using(routed).get(task_id="t1").status == state


def test_untokened_write__check_and_write_are_one_step_against_a_fenced_write(
    routed: str,
) -> None:
    """A duplicate delivery's STARTED write checks while a fenced SUCCESS commits (issue
    14, case 10): it waits for the fenced transaction, then sees the final row and writes
    nothing."""
    import threading

    from django.db import transaction

    from tests.conftest import wait_until_blocked

    backend = FencedDatabaseBackend(app=app)
    backend.store_result("t1", {"pid": 1}, states.STARTED, request=request_for("t1"))
    lease = acquire("job", ttl=30, task_id="t1", using=routed)

    def started() -> None:
        try:
            backend.store_result("t1", {"pid": 2}, states.STARTED, request=request_for("t1"))
        finally:
            connections[routed].close()

    with transaction.atomic(using=routed):
        backend.mark_as_done("t1", {"v": 1}, request=request_for("t1", lease))
        duplicate = threading.Thread(target=started)
        duplicate.start()
        wait_until_blocked(routed, duplicate)
    duplicate.join(timeout=30)
    row = TaskResult.objects.using(routed).get(task_id="t1")
    assert (row.status, json.loads(row.result)) == (states.SUCCESS, {"v": 1})


def test_main_process_report__never_started_copy_with_an_expired_grant_is_recorded(
    routed: str,
) -> None:
    """A late copy expires (``expires``) while the job's only grant has run out (its holder
    died): ``REVOKED`` is the job's outcome, not nothing (found by the chaos runner)."""
    held = acquire("job", ttl=30, task_id="t1", owner="w@h:100:1", using=routed)
    Lease.objects.using(routed).filter(key="job").update(expires_at=F("acquired_at"))
    report(states.REVOKED, "t1", main_process_request("t1", None))
    assert TaskResult.objects.using(routed).get(task_id="t1").status == states.REVOKED
    assert Lease.objects.using(routed).get(key="job").released_at is None  # ends nothing
    assert held.token == 1


def test_stale_result__never_written_over_a_final_outcome(routed: str) -> None:
    """A holder fenced out by a force release finds the job already REVOKED: its refused
    SUCCESS leaves the REVOKED, rather than storing FAILURE(StaleToken) over it."""
    from celery_fenced import force_release

    held = acquire("job", ttl=30, task_id="t1", owner="w@h:100:1", using=routed)
    force_release("job", by="admin", using=routed)
    report(states.REVOKED, "t1", main_process_request("t1", None))
    FencedDatabaseBackend(app=app).mark_as_done("t1", {"v": 1}, request=request_for("t1", held))
    assert TaskResult.objects.using(routed).get(task_id="t1").status == states.REVOKED


@pytest.fixture
def pool_process() -> Iterator[Any]:
    """A real child process of this one, standing in for the worker's pool process."""
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield child
    child.kill()
    child.wait()


def reports_waiting(pid: int) -> bool:
    import threading

    return any(t.name == f"celery-fenced-after-exit-{pid}" for t in threading.enumerate())


@pytest.mark.parametrize("state", [states.REVOKED, states.FAILURE])
def test_main_process_report__of_a_process_still_running__waits_until_it_exited(
    routed: str, state: str, pool_process: Any
) -> None:
    """The main process reports a hard time limit before it kills the pool process (and a
    terminate right after signalling it): while that process runs, its grant stands and
    nothing is recorded; once it has exited, the grant ends and the outcome is stored."""
    from devtools.workers import wait_for

    pid = pool_process.pid
    acquire("job", ttl=30, task_id="t1", owner=f"w@h:{pid}:1", using=routed)
    report(state, "t1", main_process_request("t1", pid))
    assert reports_waiting(pid)
    assert Lease.objects.using(routed).get(key="job").released_at is None
    assert not TaskResult.objects.using(routed).filter(task_id="t1").exists()
    pool_process.kill()  # a zombie until reaped: exited all the same
    row = wait_for(
        lambda: TaskResult.objects.using(routed).filter(task_id="t1").first(), 30, "the report"
    )
    assert row.status == state
    assert Lease.objects.using(routed).get(key="job").released_at is not None
    event = LeaseEvent.objects.using(routed).get(kind="force_released")
    assert event.detail["by"] == f"worker:{state.lower()}"


def test_main_process_report__of_a_running_process_whose_execution_ended__records_nothing(
    routed: str, pool_process: Any
) -> None:
    """The process outlived the report and finished the execution itself (its SUCCESS
    stored under its grant): the waiting report stops when the grant ends, and the
    FAILURE never overwrites the execution's own result."""
    from devtools.workers import wait_for

    pid = pool_process.pid
    lease = acquire("job", ttl=30, task_id="t1", owner=f"w@h:{pid}:1", using=routed)
    report(states.FAILURE, "t1", main_process_request("t1", pid))
    FencedDatabaseBackend(app=app).mark_as_done("t1", {"v": 1}, request=request_for("t1", lease))
    wait_for(lambda: not reports_waiting(pid), 30, "the waiting report to end")
    assert pool_process.poll() is None  # it still runs: the grant's end was enough
    assert TaskResult.objects.using(routed).get(task_id="t1").status == states.SUCCESS
    assert not LeaseEvent.objects.using(routed).filter(kind="force_released").exists()


def test_main_process_report__recorded_through_a_dropped_connection(routed: str) -> None:
    """The worker's main process keeps its connections for good: one cut by a database
    restart is replaced, and the report recorded (found by the chaos runner)."""
    if routed != "postgres":
        pytest.skip("terminates a PostgreSQL backend")
    from tests.conftest import terminate_connection

    acquire("job", ttl=30, task_id="t1", owner="w@h:100:1", using=routed)
    terminate_connection(routed)
    report(states.FAILURE, "t1", main_process_request("t1", 100))
    assert TaskResult.objects.using(routed).get(task_id="t1").status == states.FAILURE
    assert Lease.objects.using(routed).get(key="job").released_at is not None


def test_fenced_success__one_statement_with_server_side_binding(settings: Any) -> None:
    """psycopg's server-side binding (Django's opt-in OPTIONS) sends the row's values as
    typed parameters of ``INSERT … SELECT``: they still land in their columns."""
    routers.TARGET = "postgres"
    settings.DATABASE_ROUTERS = ["tests.routers.AllToTarget"]
    connection = settling_connection("postgres")
    options = connection.settings_dict.setdefault("OPTIONS", {})
    previous = dict(options)  # the kept connection's own (``fenced_prepare``), restored
    connection.close()
    options["server_side_binding"] = True
    try:
        app.conf.result_extended = True
        lease = store.grant(
            "job", ttl=30, task_id="t1", using="postgres", delivery=Delivery("t1", "d" * 32, 0)
        )
        with CaptureQueriesContext(connection) as queries:
            FencedDatabaseBackend(app=app).mark_as_done(
                "t1", {"answer": 42}, request=request_for("t1", lease)
            )
        (statement,) = [q["sql"] for q in queries.captured_queries]
        assert "django_celery_results_taskresult" in statement
        stored = TaskResult.objects.using("postgres").get(task_id="t1")
        assert (stored.status, json.loads(stored.result)) == (states.SUCCESS, {"answer": 42})
        assert stored.date_started is None
        assert stored.date_done is not None
    finally:
        connection.close()
        options.clear()
        options.update(previous)
        routers.TARGET = "default"


@pytest.mark.parametrize("state", [states.REVOKED, states.FAILURE])
def test_untokened_write__no_row_yet__never_overwrites_a_fenced_final_committed_meanwhile(
    routed: str, monkeypatch: pytest.MonkeyPatch, state: str
) -> None:
    """A late copy's REVOKED or a failure before its grant (the job's grant expired, no
    successor) checks while the task has no result row yet; the expired holder's SUCCESS,
    still current, inserts the row and commits meanwhile. The task id's result lock must
    serialize them with no row to lock (MariaDB: a ``SELECT … FOR UPDATE`` of a missing
    row locks nothing under READ COMMITTED): the fenced SUCCESS stands, not the untokened
    FAILURE written over it."""
    if routed == "default":
        pytest.skip("SQLite has one writer: the two never interleave")
    import threading

    held = acquire("job", ttl=30, task_id="t1", owner="w@h:100:1", using=routed)
    Lease.objects.using(routed).filter(key="job").update(expires_at=F("acquired_at"))
    checked, go, written, commit = (threading.Event() for _ in range(4))
    original = FencedDatabaseBackend._untokened_may_write

    def paused(self: Any, *args: Any, **kwargs: Any) -> bool:
        may = original(self, *args, **kwargs)
        if threading.current_thread() is not main:
            checked.set()
            go.wait(timeout=30)
        return may

    main = threading.current_thread()
    monkeypatch.setattr(FencedDatabaseBackend, "_untokened_may_write", paused)
    errors: list[BaseException] = []

    def late_copy() -> None:
        try:
            report(state, "t1", main_process_request("t1", None))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            connections[routed].close()

    def holder() -> None:
        try:
            with transaction.atomic(using=routed):
                FencedDatabaseBackend(app=app).mark_as_done(
                    "t1", {"v": 1}, request=request_for("t1", held)
                )
                written.set()
                commit.wait(timeout=30)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            connections[routed].close()

    revoking = threading.Thread(target=late_copy)
    revoking.start()
    assert checked.wait(timeout=30)
    finishing = threading.Thread(target=holder)
    finishing.start()
    written.wait(timeout=2)  # PostgreSQL: waits for the late copy's result lock
    go.set()
    revoking.join(timeout=2)  # MariaDB: its insert waits for the holder's
    commit.set()
    revoking.join(timeout=30)
    finishing.join(timeout=30)
    assert not errors
    row = TaskResult.objects.using(routed).get(task_id="t1")
    assert (row.status, json.loads(row.result)) == (states.SUCCESS, {"v": 1})


def test_result_lock__no_row__concurrent_takers_wait_in_turn_without_deadlock(
    routed: str,
) -> None:
    """Eight transactions take the result lock of a task id that has no row, at once:
    each waits for the one before (none sees another inside), and none fails (MariaDB:
    the lock is a kept bucket row; no deadlock, error 1213)."""
    if routed == "default":
        pytest.skip("SQLite has one writer: the transactions queue on its write lock")
    import threading
    import time

    barrier = threading.Barrier(8)
    inside: list[int] = []
    overlaps: list[int] = []
    errors: list[BaseException] = []

    def take(i: int) -> None:
        try:
            barrier.wait(30)
            with transaction.atomic(using=routed):
                store.lock_for_result(routed, "t1")
                if inside:
                    overlaps.append(i)
                inside.append(i)
                time.sleep(0.05)
                inside.remove(i)
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections[routed].close()

    run_in_threads(take, 8)
    assert (errors, overlaps) == ([], [])
    assert not TaskResult.objects.using(routed).filter(task_id="t1").exists()
