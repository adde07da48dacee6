"""Atomic task bodies (``"atomic": True``), through Celery's own tracer.

A task fenced by configuration alone (``fenced_tasks``), whose body makes plain writes (a
``QuerySet.update()`` and a ``save()``) and publishes a plain child task: its writes,
its child and its result commit together with the proof of its token, or not at all.
Messages are captured and delivered as in ``test_seams``; a stale execution is one whose
grant expired while its body was held at a gate and was taken over by another delivery.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery, signals, states
from django.db import InterfaceError, OperationalError, connections, router, transaction
from django.db.models import F, Value
from django.db.models.functions import Concat

from celery_fenced import atomic, current_lease, fenced_update, hooks
from celery_fenced.models import Lease, LeaseEvent, PendingJob
from testproject.demo.models import Report
from tests.conftest import WITH_MARIADB, side_connection
from tests.integration.test_seams import (
    GATES,
    RUNS,
    Broker,
    Execution,
    deliver,
    expire,
    granted,
    status,
    wait_for,
)

pytestmark = [
    pytest.mark.django_db(transaction=True, databases=WITH_MARIADB),
    pytest.mark.timeout(120),
]

FENCED_TASKS = {
    "atomic.charge": {"ttl": 30, "key": "charge:{name}", "atomic": True},
    "atomic.hold": {"ttl": 2, "key": "charge:{name}", "atomic": True},
    "atomic.proven": {"ttl": 2, "key": "charge:{name}", "atomic": True},
    "atomic.cut": {"ttl": 30, "key": "charge:{name}", "atomic": True},
    "atomic.cut_last": {"ttl": 30, "key": "charge:{name}", "atomic": True},
}
#: what a body does once its gate opens, by thread name: "raise", "retry"
ACTIONS: dict[str, str] = {}


def make_app(fenced_tasks: dict[str, Any] = FENCED_TASKS) -> Celery:
    app = Celery("atomic", set_as_current=False, broker="memory://")
    app.conf.update(
        result_backend="celery_fenced.backends:FencedDatabaseBackend",
        result_extended=True,
        task_default_queue="atomic",
        fenced_tasks=fenced_tasks,
        fenced_duplicate_window=3600,
    )

    def write(name: str, thread: str) -> None:
        Report.objects.filter(name=name).update(body=Concat(F("body"), Value(f"{thread};")))
        report = Report.objects.get(name=name)
        report.built_by = thread
        report.save()

    @app.task(name="atomic.charge", bind=True, shared=False)
    def charge(self: Any, name: str) -> str:
        thread = threading.current_thread().name
        RUNS.append(("atomic.charge", name, thread))
        gate = GATES.get(thread)
        if gate is not None:
            assert gate.wait(60)
        write(name, thread)
        app.send_task("atomic.notify", args=[name, thread])
        action = ACTIONS.get(thread)
        if action == "raise":
            raise ValueError(f"charge failed in {thread}")
        if action == "retry":
            raise self.retry(countdown=60, max_retries=3)
        return f"charged by {thread}"

    @app.task(name="atomic.hold", shared=False)
    def hold(name: str) -> str:
        """Writes, then waits at its gate inside its transaction (its row locks held)."""
        thread = threading.current_thread().name
        write(name, thread)
        RUNS.append(("atomic.hold", name, thread))  # written: its row locks held
        gate = GATES.get(thread)
        if gate is not None:
            assert gate.wait(60)
        Report.objects.filter(name=name).update(built_by=f"{thread} woke")
        return f"held by {thread}"

    @app.task(name="atomic.proven", shared=False)
    def proven(name: str, how: str) -> str:
        """Proves its token in its body (``fenced_update`` or ``guard()``), then works on
        in its transaction (a read every 0.2 s: never idle in it for its ttl) until its
        gate opens."""
        thread = threading.current_thread().name
        lease = current_lease()
        assert lease is not None
        if how == "fenced_update":
            fenced_update(Report.objects.filter(name=name), token=lease.token, built_by=thread)
        else:
            with lease.guard():
                Report.objects.filter(name=name).update(built_by=thread)
        RUNS.append(("atomic.proven", name, thread))
        gate = GATES.get(thread)
        deadline = time.monotonic() + 60
        while gate is not None and not gate.wait(0.2):
            assert time.monotonic() < deadline
            Report.objects.filter(name=name).exists()
        return f"proven by {thread}"

    @app.task(
        name="atomic.cut",
        bind=True,
        shared=False,
        autoretry_for=(OperationalError, InterfaceError),
        retry_kwargs={"countdown": 60, "max_retries": 3},
    )
    def cut(self: Any, name: str) -> str:
        """Writes, then its database session is ended under it (an outage, a restart);
        Celery's ``autoretry_for`` asks for a retry from inside the body."""
        thread = threading.current_thread().name
        write(name, thread)
        end_session(router.db_for_write(Report))
        write(name, thread)  # the session is gone: OperationalError
        return f"cut by {thread}"

    @app.task(name="atomic.cut_last", bind=True, shared=False)
    def cut_last(self: Any, name: str) -> str:
        """Writes and publishes its child, then its session is ended as it returns (the
        database restarts before the settle): no statement of the body meets it."""
        thread = threading.current_thread().name
        RUNS.append(("atomic.cut_last", name, thread))
        write(name, thread)
        app.send_task("atomic.notify", args=[name, thread])
        if len(runs("atomic.cut_last")) == 1:
            end_session(router.db_for_write(Report))
        return f"cut last by {thread}"

    @app.task(name="atomic.notify", shared=False)
    def notify(name: str, by: str) -> None:
        RUNS.append(("atomic.notify", (name, by), threading.current_thread().name))

    return app


def end_session(alias: str) -> None:
    """The database server ends this thread's session on ``alias`` (as a restart would),
    from a connection of its own; returns once the session is gone."""
    mysql = connections[alias].vendor == "mysql"
    with connections[alias].cursor() as cursor:
        cursor.execute("SELECT CONNECTION_ID()" if mysql else "SELECT pg_backend_pid()")
        (session,) = cursor.fetchone()
    admin = side_connection(alias)
    try:
        cursor = admin.cursor()
        if mysql:
            cursor.execute("KILL %s", [session])
            gone = "SELECT count(*) FROM information_schema.PROCESSLIST WHERE ID = %s"
        else:
            cursor.execute("SELECT pg_terminate_backend(%s)", [session])
            gone = "SELECT count(*) FROM pg_stat_activity WHERE pid = %s"

        def ended() -> bool:
            cursor.execute(gone, [session])
            return cursor.fetchone()[0] == 0

        wait_for(ended, f"the server ending session {session}")
    finally:
        admin.close()


@pytest.fixture
def alias(alias_with_mariadb: str) -> str:
    """SQLite, PostgreSQL and MariaDB."""
    return alias_with_mariadb


@pytest.fixture
def broker(lease_db: str) -> Iterator[Broker]:
    app = make_app()
    hooks.fence_in_every_process()  # what celery_fenced's AppConfig.ready() does
    recorded = Broker(app)
    signals.before_task_publish.connect(recorded.record, weak=False)
    GATES.clear()
    RUNS.clear()
    ACTIONS.clear()
    Report.objects.using(lease_db).create(name="inv-1")
    yield recorded
    signals.before_task_publish.disconnect(recorded.record)
    for gate in GATES.values():
        gate.set()


def report(alias: str) -> tuple[str, str]:
    row = Report.objects.using(alias).get(name="inv-1")
    return row.body, row.built_by


def runs(name: str) -> list[Any]:
    return [value for task, value, _ in RUNS if task == name]


def test_atomic_body__writes_child_and_result_commit_together(
    broker: Broker, lease_db: str
) -> None:
    result = broker.app.send_task("atomic.charge", args=["inv-1"])
    deliver(broker.app, broker.one("atomic.charge"))
    assert status(lease_db, result.id) == (states.SUCCESS, '"charged by MainThread"')
    assert report(lease_db) == ("MainThread;", "MainThread")
    deliver(broker.app, broker.one("atomic.notify"))
    assert runs("atomic.notify") == [("inv-1", "MainThread")]
    assert Lease.objects.using(lease_db).get(key="charge:inv-1").released_at is not None
    assert not connections[lease_db].in_atomic_block


def test_atomic_body_made_stale__its_writes_and_child_are_gone(
    broker: Broker, lease_db: str
) -> None:
    """A is held in its body; its grant expires and B takes over, writes and ends; A then
    writes the same row, publishes its child and returns: A's proof is refused, so its
    writes, its child and its outcome roll back; B's stand and B's child runs once."""
    result = broker.app.send_task("atomic.charge", args=["inv-1"])
    message = broker.one("atomic.charge")
    a = Execution(broker.app, message, "A")
    expire(lease_db, granted(lease_db, result.id, 1))
    b = Execution(broker.app, message, "B")
    granted(lease_db, result.id, 2)
    b.finish()
    assert report(lease_db) == ("B;", "B")
    a.finish()
    assert report(lease_db) == ("B;", "B")  # A's update and save rolled back
    assert status(lease_db, result.id) == (states.SUCCESS, '"charged by B"')
    (child,) = broker.sent("atomic.notify")  # A's child never sent
    deliver(broker.app, child)
    assert runs("atomic.notify") == [("inv-1", "B")]
    assert PendingJob.objects.using(lease_db).count() == 0  # A's outbox row rolled back
    rejected = LeaseEvent.objects.using(lease_db).filter(
        kind=LeaseEvent.Kind.STALE_WRITE_REJECTED, token=1
    )
    assert rejected.count() == 1  # recorded outside the rolled-back transaction


def test_atomic_body_force_released__nothing_commits(broker: Broker, lease_db: str) -> None:
    from celery_fenced import force_release

    result = broker.app.send_task("atomic.charge", args=["inv-1"])
    a = Execution(broker.app, broker.one("atomic.charge"), "A")
    granted(lease_db, result.id, 1)
    force_release("charge:inv-1")
    a.finish()
    assert report(lease_db) == ("", "")
    assert broker.sent("atomic.notify") == []
    assert status(lease_db, result.id)[0] == states.FAILURE  # StaleToken, for its caller


def test_atomic_body_raises__its_writes_roll_back_and_the_failure_is_recorded(
    broker: Broker, lease_db: str
) -> None:
    result = broker.app.send_task("atomic.charge", args=["inv-1"])
    ACTIONS["MainThread"] = "raise"
    deliver(broker.app, broker.one("atomic.charge"))
    assert report(lease_db) == ("", "")
    assert broker.sent("atomic.notify") == []
    assert status(lease_db, result.id)[0] == states.FAILURE
    assert Lease.objects.using(lease_db).get(key="charge:inv-1").released_at is not None
    assert not connections[lease_db].in_atomic_block


def test_atomic_body_retries__the_retry_is_sent_and_its_writes_roll_back(
    broker: Broker, lease_db: str
) -> None:
    result = broker.app.send_task("atomic.charge", args=["inv-1"])
    ACTIONS["MainThread"] = "retry"
    deliver(broker.app, broker.one("atomic.charge"))
    assert report(lease_db) == ("", "")
    assert broker.sent("atomic.notify") == []
    (_, again) = broker.sent("atomic.charge")
    assert again[0]["id"] == result.id
    assert again[0]["retries"] == 1
    assert status(lease_db, result.id)[0] == states.RETRY


def test_atomic_body_left_open__closed_by_the_backends_cleanup(
    broker: Broker, lease_db: str, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """A settle that never ran (a backend that raised before it): the task's end rolls the
    body's transaction back, with a warning; the next task runs outside it."""
    from celery_fenced.backends import FencedDatabaseBackend

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("the backend failed")

    monkeypatch.setattr(FencedDatabaseBackend, "_settle_in_body", broken)
    broker.app.send_task("atomic.charge", args=["inv-1"])
    with (
        caplog.at_level(logging.WARNING, logger="celery_fenced.atomic"),
        pytest.warns(RuntimeWarning, match="the backend failed"),
    ):
        deliver(broker.app, broker.one("atomic.charge"))
    assert any("still open after its task ended" in r.getMessage() for r in caplog.records)
    assert not connections[lease_db].in_atomic_block
    assert report(lease_db) == ("", "")
    assert broker.sent("atomic.notify") == []


def test_atomic_body_writes_another_alias__warned_once(
    broker: Broker, lease_db: str, caplog: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(atomic, "_warned", set())  # once per process: not a former test's
    other = "postgres" if lease_db != "postgres" else "default"
    app = broker.app

    @app.task(name="atomic.elsewhere", bind=True, shared=False)
    def elsewhere(self: Any) -> None:
        Report.objects.using(other).filter(name="none").update(body="x")

    app.conf.fenced_tasks = {**FENCED_TASKS, "atomic.elsewhere": {"atomic": True}}
    hooks.fence_in_every_process()
    with caplog.at_level(logging.WARNING, logger="celery_fenced.atomic"):
        for _ in range(2):
            app.send_task("atomic.elsewhere")
            deliver(app, broker.sent("atomic.elsewhere")[-1])
    warned = [r for r in caplog.records if "wrote to the database" in r.getMessage()]
    assert len(warned) == 1
    assert repr(other) in warned[0].getMessage()


def test_atomic_body_not_settled_by_the_backend__proven_and_committed_in_the_body(
    broker: Broker, lease_db: str
) -> None:
    """Called directly (no tracer, no backend): the token is proven in the body's
    transaction before it commits."""
    task = broker.app.tasks["atomic.charge"]
    assert task("inv-1") == "charged by MainThread"
    assert report(lease_db) == ("MainThread;", "MainThread")
    assert not connections[lease_db].in_atomic_block
    assert transaction.get_autocommit(using=lease_db)


def test_atomic_body_paused_after_writing__does_not_stall_the_current_one(
    broker: Broker, lease_db: str
) -> None:
    """A writes the row, then is held inside its transaction (as if paused), its row lock
    held; its grant expires and B takes over. The server ends A's session once it has been
    idle in its transaction for about its ttl (2 s): B's write of the same row goes
    through and B ends before A wakes; A's writes are gone."""
    if connections[lease_db].vendor == "sqlite":
        pytest.skip("SQLite: one writer; nothing ends a paused holder's transaction")
    result = broker.app.send_task("atomic.hold", args=["inv-1"])
    message = broker.one("atomic.hold")
    a = Execution(broker.app, message, "A")
    lease = granted(lease_db, result.id, 1)
    wait_for(lambda: ("atomic.hold", "inv-1", "A") in RUNS, "A's writes")
    expire(lease_db, lease)
    b = Execution(broker.app, message, "B")
    b.gate.set()
    b.thread.join(15)  # stalled by A for about A's ttl, not until A wakes (60 s)
    assert not b.thread.is_alive()
    assert b.outcome
    assert report(lease_db) == ("B;", "B woke")
    assert a.thread.is_alive()  # A is still held: B did not wait for it to wake
    a.finish()
    assert report(lease_db) == ("B;", "B woke")
    assert status(lease_db, result.id) == (states.SUCCESS, '"held by B"')


def test_atomic_body_whose_session_dies__autoretry_sends_its_retry_after_the_rollback(
    broker: Broker, lease_db: str
) -> None:
    """The database ends the body's session mid-body (a restart, an outage): the body's
    writes are gone, and the retry ``autoretry_for`` asks for is sent once the body's
    transaction is rolled back, outside it — not tried on the dead connection, which
    ended the job as a FAILURE."""
    if connections[lease_db].vendor == "sqlite":
        pytest.skip("SQLite has no session the server could end")
    result = broker.app.send_task("atomic.cut", args=["inv-1"])
    deliver(broker.app, broker.one("atomic.cut"))
    sent = broker.sent("atomic.cut")
    assert [message[0]["id"] for message in sent] == [result.id, result.id]
    assert status(lease_db, result.id)[0] == states.RETRY
    assert report(lease_db) == ("", "")
    assert Lease.objects.using(lease_db).get(key="charge:inv-1").released_at is not None


def test_atomic_body_whose_session_dies_before_the_settle__job_runs_again(
    broker: Broker, lease_db: str
) -> None:
    """The body writes, publishes its child and returns; the database ends its session
    before the settle (a restart): the proof meets the ended session. Nothing of the body
    committed, so the job is sent again under its grant (not ended as a FAILURE); the
    second delivery commits once."""
    if connections[lease_db].vendor == "sqlite":
        pytest.skip("SQLite has no session the server could end")
    result = broker.app.send_task("atomic.cut_last", args=["inv-1"])
    deliver(broker.app, broker.one("atomic.cut_last"))
    sent = broker.sent("atomic.cut_last")
    assert [message[0]["id"] for message in sent] == [result.id, result.id]
    assert status(lease_db, result.id)[0] == states.RETRY
    assert report(lease_db) == ("", "")
    assert broker.sent("atomic.notify") == []
    lease = Lease.objects.using(lease_db).get(key="charge:inv-1")
    assert (lease.released_at is not None, lease.release_state) == (True, states.RETRY)
    deliver(broker.app, sent[1])
    assert status(lease_db, result.id) == (states.SUCCESS, '"cut last by MainThread"')
    assert report(lease_db) == ("MainThread;", "MainThread")
    assert len(broker.sent("atomic.notify")) == 1
    assert len(broker.sent("atomic.cut_last")) == 2


def test_atomic_body_whose_transaction_cannot_begin__job_sent_again_not_failed(
    broker: Broker, lease_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The grant commits; the database ends the session before the body's transaction
    is opened on it (a restart between the two). No body ran: the job is sent again, as
    after a database error before the grant (``autoretry_for`` covers only the body),
    with its grant released as RETRY."""
    if connections[lease_db].vendor == "sqlite":
        pytest.skip("SQLite has no session the server could end")
    real = atomic._bound
    ended: list[str] = []

    def ended_first(alias: str, ttl: float) -> Any:
        if not ended:
            ended.append(alias)
            end_session(alias)
        return real(alias, ttl)

    monkeypatch.setattr(atomic, "_bound", ended_first)
    result = broker.app.send_task("atomic.charge", args=["inv-1"])
    deliver(broker.app, broker.one("atomic.charge"))
    assert ended == [lease_db]
    assert runs("atomic.charge") == []
    sent = broker.sent("atomic.charge")
    assert [message[0]["id"] for message in sent] == [result.id, result.id]
    assert status(lease_db, result.id)[0] == states.RETRY
    lease = Lease.objects.using(lease_db).get(key="charge:inv-1")
    assert (lease.released_at is not None, lease.release_state) == (True, states.RETRY)
    deliver(broker.app, sent[1])
    assert status(lease_db, result.id) == (states.SUCCESS, '"charged by MainThread"')
    assert report(lease_db) == ("MainThread;", "MainThread")


def _idle_transactions(alias: str) -> int:
    """Sessions of the test database idle in an open transaction (not this one)."""
    with connections[alias].cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND state LIKE 'idle in transaction%%' AND pid <> pg_backend_pid()"
        )
        (count,) = cursor.fetchone()
    return int(count)


def test_atomic_body_paused_until_the_server_ended_it__retried_not_failed(
    broker: Broker, lease_db: str
) -> None:
    """A writes and is held inside its transaction; its grant lapses with nobody taking
    over, and the server ends A's session (idle past its ttl). A wakes: its next statement
    meets the ended session. That is a pause, not the job's failure: the job is retried
    with its task id, and nothing of A commits."""
    if connections[lease_db].vendor != "postgresql":
        # MariaDB shows another session's transaction (innodb_trx) only with the PROCESS
        # privilege: the test cannot wait for the end of A's; its bound is tested above
        pytest.skip("waits for the server to end A's session: PostgreSQL's view of it")
    result = broker.app.send_task("atomic.hold", args=["inv-1"])
    a = Execution(broker.app, broker.one("atomic.hold"), "A")
    lease = granted(lease_db, result.id, 1)
    wait_for(lambda: ("atomic.hold", "inv-1", "A") in RUNS, "A's writes")
    expire(lease_db, lease)
    wait_for(lambda: _idle_transactions(lease_db) == 0, "the server ending A's session", 30)
    a.finish()
    sent = broker.sent("atomic.hold")
    assert [message[0]["id"] for message in sent] == [result.id, result.id]
    assert status(lease_db, result.id)[0] != states.FAILURE
    assert report(lease_db) == ("", "")


@pytest.mark.parametrize("how", ["fenced_update", "guard"])
def test_atomic_body_proving_its_token__renewals_go_on_while_it_runs(
    broker: Broker, lease_db: str, how: str
) -> None:
    """A body that proves its token (``fenced_update`` or ``guard()``) holds no lock on
    its lease row for the rest of its transaction: held past its ttl (2 s), its lease is
    renewed meanwhile (the renewer's own connection), never lost, and its writes commit."""
    if connections[lease_db].vendor == "sqlite":
        pytest.skip("SQLite: one writer; a body that wrote holds every renewal (documented)")
    result = broker.app.send_task("atomic.proven", args=["inv-1", how])
    a = Execution(broker.app, broker.one("atomic.proven"), "A")
    first = granted(lease_db, result.id, 1).expires_at
    wait_for(lambda: ("atomic.proven", "inv-1", "A") in RUNS, "A's proof and write")
    wait_for(
        lambda: (
            Lease.objects.using(lease_db).get(key="charge:inv-1").expires_at
            > first + dt.timedelta(seconds=2)
        ),
        "renewals past the first grant's ttl",
        timeout=10,
    )
    a.finish()
    assert status(lease_db, result.id) == (states.SUCCESS, '"proven by A"')
    assert report(lease_db) == ("", "A")
    lost = LeaseEvent.objects.using(lease_db).filter(kind=LeaseEvent.Kind.LOST)
    assert not lost.exists()


@pytest.mark.parametrize("action", ["return", "raise"])
def test_atomic_body__its_bound_is_not_left_on_the_session(
    broker: Broker, lease_db: str, action: str
) -> None:
    """The idle-in-transaction bound is the body's only: PostgreSQL's is local to its
    transaction, MariaDB's session variable is restored once it ends (committed or not)."""
    vendor = connections[lease_db].vendor
    if vendor == "sqlite":
        pytest.skip("SQLite: no bound")
    variable = (
        "SHOW idle_in_transaction_session_timeout"
        if vendor == "postgresql"
        else "SELECT @@SESSION.idle_transaction_timeout"
    )

    def bound() -> Any:
        with connections[lease_db].cursor() as cursor:
            cursor.execute(variable)
            return cursor.fetchone()[0]

    before = bound()
    if action == "raise":
        ACTIONS["MainThread"] = "raise"
    broker.app.send_task("atomic.charge", args=["inv-1"])
    deliver(broker.app, broker.one("atomic.charge"))
    assert report(lease_db) == (("MainThread;", "MainThread") if action == "return" else ("", ""))
    assert bound() == before


def test_atomic_body_whose_commit_fails__nothing_of_it_commits_and_it_runs_again(
    broker: Broker, lease_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The settle's commit fails (the database refuses it, or the connection is lost as it
    commits): the body's writes, its child, its success and the release all roll back;
    the job is then sent again under its grant, its RETRY recorded apart; the second
    delivery commits once."""
    from django.db import OperationalError

    connection = connections[lease_db]
    real = connection.commit
    failed: list[bool] = []

    def commit() -> None:
        if connection.in_atomic_block or failed or not runs("atomic.charge"):
            return real()  # a grant's commit, or one after the failed one
        failed.append(True)
        connection.connection.rollback()  # what a commit the server refused leaves
        raise OperationalError("the commit failed")

    result = broker.app.send_task("atomic.charge", args=["inv-1"])
    monkeypatch.setattr(connection, "commit", commit)
    deliver(broker.app, broker.one("atomic.charge"))
    monkeypatch.setattr(connection, "commit", real)
    assert failed
    assert report(lease_db) == ("", "")
    assert broker.sent("atomic.notify") == []
    pending = PendingJob.objects.using(lease_db)
    assert list(pending.values_list("task_name", flat=True)) == ["atomic.charge"]  # the re-send
    assert status(lease_db, result.id)[0] == states.RETRY  # recorded after, apart
    lease = Lease.objects.using(lease_db).get(key="charge:inv-1")
    assert (lease.released_at is not None, lease.release_state) == (True, states.RETRY)
    assert not connection.in_atomic_block
    (_, again) = broker.sent("atomic.charge")
    deliver(broker.app, again)
    assert status(lease_db, result.id) == (states.SUCCESS, '"charged by MainThread"')
    assert report(lease_db) == ("MainThread;", "MainThread")
    assert len(broker.sent("atomic.notify")) == 1
    assert not pending.filter(task_name="atomic.charge").exists()


def test_atomic_body_whose_commit_answer_is_lost__its_success_stands(
    broker: Broker, lease_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The commit reaches the database, but its answer is lost with the connection: the
    release committed with the body shows it, so the success stands and the job is not
    sent again; the child's outbox row, committed with it, is left to the outbox's sweep
    (the commit hooks that send it at once never ran)."""
    from django.db import OperationalError

    connection = connections[lease_db]
    real = connection.commit
    lost: list[bool] = []

    def commit() -> None:
        if connection.in_atomic_block or lost or not runs("atomic.charge"):
            return real()
        lost.append(True)
        connection.connection.commit()  # it lands; Django never hears of it
        raise OperationalError("the connection was lost as it committed")

    result = broker.app.send_task("atomic.charge", args=["inv-1"])
    monkeypatch.setattr(connection, "commit", commit)
    deliver(broker.app, broker.one("atomic.charge"))
    monkeypatch.setattr(connection, "commit", real)
    assert lost
    assert status(lease_db, result.id) == (states.SUCCESS, '"charged by MainThread"')
    assert report(lease_db) == ("MainThread;", "MainThread")
    assert len(broker.sent("atomic.charge")) == 1  # not sent again
    lease = Lease.objects.using(lease_db).get(key="charge:inv-1")
    assert (lease.released_at is not None, lease.release_state) == (True, states.SUCCESS)
    assert PendingJob.objects.using(lease_db).filter(task_name="atomic.notify").count() == 1
    assert not connection.in_atomic_block
