"""The connection a worker thread keeps for grants and successes (``store.owned``).

Executions run through Celery's own tracer, as a pool process runs them; the sessions
are PostgreSQL's own (``pg_stat_activity``, ``pg_terminate_backend``).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
from celery import states
from django.db import connections, transaction
from django.test.utils import CaptureQueriesContext

from celery_fenced import store
from celery_fenced.models import Lease
from tests.conftest import DATABASE_ALIASES, DELIVERED, side_connection
from tests.integration.test_seams import Broker, deliver, status

pytestmark = [
    pytest.mark.django_db(transaction=True, databases=DATABASE_ALIASES),
    pytest.mark.timeout(120),
]


@pytest.fixture
def pg(lease_db: str) -> str:
    if lease_db != "postgres":
        pytest.skip("the kept connection is PostgreSQL's (SQLite: Django's, per task)")
    return lease_db


def backend_pid(connection: Any) -> int:
    connection.ensure_connection()
    return int(connection.connection.info.backend_pid)


def session_ended(alias: str, pid: int) -> bool:
    with side_connection(alias) as admin:
        found = admin.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", [pid])
        return found.fetchone() is None


def eventually(condition: Callable[[], bool], within: float = 30.0) -> bool:
    """Whether ``condition()`` holds, waiting up to ``within`` seconds for it: a closed
    session leaves ``pg_stat_activity`` when its server process has exited."""
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def publish(broker: Broker, value: str) -> str:
    """Publish one ``seams.step``; return its task id."""
    return str(broker.app.signature("seams.step", (value,)).apply_async().id)


def deliver_id(broker: Broker, task_id: str) -> None:
    """Deliver the message of ``task_id`` through Celery's tracer."""
    (message,) = [m for m in broker.sent("seams.step") if m[0]["id"] == task_id]
    deliver(broker.app, message)


def run_one(broker: Broker, value: str) -> str:
    """Publish and deliver one ``seams.step``; return its task id."""
    task_id = publish(broker, value)
    deliver_id(broker, task_id)
    return task_id


def kept_session_ended(broker: Broker, pg: str) -> tuple[Any, int]:
    """One execution opens this thread's kept session; the server then ends it (a
    restart, a failover between tasks). The kept connection and its session's pid."""
    run_one(broker, "a")
    kept = store.kept_connection(pg, DELIVERED)
    assert kept is not None
    pid = backend_pid(kept)
    with side_connection(pg) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", [pid])
    assert eventually(lambda: session_ended(pg, pid))
    return kept, pid


def test_grant_and_success__one_kept_session_across_tasks_none_on_djangos(
    broker: Broker, pg: str
) -> None:
    """Two executions: each is two statements (grant; proof, release and result row) on
    the same kept session, and Django's connection is not opened for them."""
    kept = store.kept_connection(pg, DELIVERED)
    assert kept is not None
    pid = backend_pid(kept)
    first, second = publish(broker, "a"), publish(broker, "b")  # the outbox: Django's
    connections[pg].close()
    with CaptureQueriesContext(kept) as on_kept:
        deliver_id(broker, first)
        deliver_id(broker, second)
    assert connections[pg].connection is None  # never opened
    assert backend_pid(kept) == pid
    assert len(on_kept.captured_queries) == 4, [q["sql"] for q in on_kept.captured_queries]
    assert status(pg, first) == (states.SUCCESS, '"a@1"')
    assert status(pg, second) == (states.SUCCESS, '"b@1"')


def test_session_ended_while_idle__replaced_before_the_next_grant(broker: Broker, pg: str) -> None:
    """A restart or failover between tasks ends the kept session: the next execution
    sees it (its socket has something to read), opens a new one and runs at once, with
    no database-error retry of the job."""
    kept, pid = kept_session_ended(broker, pg)
    task_id = run_one(broker, "b")
    assert status(pg, task_id) == (states.SUCCESS, '"b@1"')
    assert len(broker.sent("seams.step")) == 2  # nothing sent again
    assert backend_pid(kept) != pid


def test_session_lost_outside_djangos_wrapper__replaced_before_the_next_grant(
    broker: Broker, pg: str
) -> None:
    """The kept session ended and psycopg saw it outside Django's cursor (an exception
    that interrupted the statement, a time limit's, is no database error, so Django
    does not mark the connection): psycopg's connection is broken and its socket gone.
    The next execution must open a new session, not fail on the broken one — every
    fenced task of the process failed with psycopg's "the connection is lost"."""
    import psycopg

    kept, pid = kept_session_ended(broker, pg)
    with pytest.raises(psycopg.OperationalError):
        kept.connection.execute("SELECT 1")  # psycopg's own: Django never hears of it
    assert kept.connection.broken
    assert not kept.errors_occurred
    task_id = run_one(broker, "b")
    assert status(pg, task_id) == (states.SUCCESS, '"b@1"')
    assert len(broker.sent("seams.step")) == 2  # nothing sent again
    assert backend_pid(kept) != pid


def test_not_kept__off_eager_in_a_transaction_or_sqlite(
    broker: Broker, lease_db: str, settings: Any
) -> None:
    """Django's connection is used where a kept one would be wrong: the setting off, an
    eager or a direct call (the caller's web thread), a transaction of the caller's,
    SQLite."""
    if lease_db != "postgres":
        assert store.kept_connection(lease_db, DELIVERED) is None
        return
    assert store.kept_connection(lease_db, DELIVERED) is not None
    eager = SimpleNamespace(called_directly=False, is_eager=True)
    assert store.kept_connection(lease_db, eager) is None
    direct = SimpleNamespace(called_directly=True, is_eager=False)
    assert store.kept_connection(lease_db, direct) is None
    assert store.kept_connection(lease_db, None) is None
    with transaction.atomic(using=lease_db):
        assert store.kept_connection(lease_db, DELIVERED) is None
    settings.CELERY_FENCED_KEEP_CONNECTION = False
    assert store.kept_connection(lease_db, DELIVERED) is None
    with CaptureQueriesContext(connections[lease_db]) as on_django:
        task_id = run_one(broker, "a")
    assert status(lease_db, task_id) == (states.SUCCESS, '"a@1"')
    assert any("celery_fenced_lease" in q["sql"] for q in on_django.captured_queries)


def test_close_all__closes_every_thread_and_ended_threads_are_closed_on_the_next(
    pg: str,
) -> None:
    """``close_kept_connections`` (worker shutdown) closes every thread's session; a
    thread that ended without it has its session closed when another thread opens one."""
    opened: list[Any] = []

    def open_one() -> None:
        kept = store.kept_connection(pg, DELIVERED)
        backend_pid(kept)
        opened.append(kept)

    for _ in range(2):
        thread = threading.Thread(target=open_one)
        thread.start()
        thread.join()
    first, second = opened
    assert first.connection is None  # its thread ended: closed when the second opened
    assert second.connection is not None
    mine = store.kept_connection(pg, DELIVERED)
    backend_pid(mine)
    store.close_kept_connections()
    assert (second.connection, mine.connection) == (None, None)


def test_forked_child__opens_its_own_session_and_leaves_the_parents(pg: str) -> None:
    """A child forked from a process with a kept session never uses or closes it
    (sharing a socket would mix two processes' statements; closing it ends the
    parent's session)."""
    kept = store.kept_connection(pg, DELIVERED)
    parent_pid = backend_pid(kept)
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child
        code = 1
        try:
            own = store.kept_connection(pg, DELIVERED)
            code = 0 if own is not kept and backend_pid(own) != parent_pid else 2
            store.close_kept_connections()
        finally:
            os.write(write, bytes([code]))
            os._exit(code)
    os.close(write)
    assert os.read(read, 1) == bytes([0])
    os.waitpid(child, 0)
    assert store.kept_connection(pg, DELIVERED) is kept
    assert backend_pid(kept) == parent_pid
    assert not session_ended(pg, parent_pid)
    with kept.cursor() as cursor:
        cursor.execute("SELECT 1")
        assert cursor.fetchone() == (1,)


def test_what_the_kept_session_writes__is_committed_at_once(broker: Broker, pg: str) -> None:
    """What the kept session writes is committed at once (no transaction left open on
    it): another session sees the released grant and its completion."""
    task_id = run_one(broker, "a")
    with side_connection(pg) as other:
        row = other.execute(
            "SELECT released_at IS NOT NULL, release_state FROM celery_fenced_lease "
            "WHERE task_id = %s",
            [task_id],
        ).fetchone()
    assert row == (True, states.SUCCESS)
    assert Lease.objects.using(pg).get(task_id=task_id).completed_digest


def sessions(alias: str) -> int:
    """The sessions open on ``alias``'s database, but the one counting."""
    with side_connection(alias) as admin:
        found = admin.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        ).fetchone()
        return int(found[0])


def test_direct_call__leaves_no_session_in_the_callers_thread(broker: Broker, pg: str) -> None:
    """A fenced task called as a function (a view, a script, a test) runs in the caller's
    thread: once that thread closes Django's connections, as a request's end does, no
    session of the grant is left open (one would keep a test database from being
    dropped)."""
    task = broker.app.tasks["seams.step"]
    out: list[str] = []

    def web_request() -> None:
        out.append(task("direct"))
        connections.close_all()

    connections.close_all()
    before = sessions(pg)
    thread = threading.Thread(target=web_request)
    thread.start()
    thread.join()
    assert out == ["direct@1"]
    assert eventually(lambda: sessions(pg) == before), (sessions(pg), before)


def test_django_pool__no_kept_connection(pg: str) -> None:
    """Django's connection pool (``OPTIONS["pool"]``) already spares the handshake; a kept
    connection would hold one of its slots for good, starving the task bodies."""
    options = connections[pg].settings_dict.setdefault("OPTIONS", {})
    options["pool"] = {"min_size": 1, "max_size": 2}
    try:
        assert store.kept_connection(pg, DELIVERED) is None
    finally:
        options.pop("pool")
    assert store.kept_connection(pg, DELIVERED) is not None


def test_idle_too_long__replaced_not_trusted(
    broker: Broker, pg: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection idle past ``IDLE_REPLACED_AFTER`` may have been dropped silently by
    a firewall (nothing to read on it): it is replaced before the next grant."""
    from celery_fenced.store import owned

    run_one(broker, "a")
    pid = backend_pid(store.kept_connection(pg, DELIVERED))
    run_one(broker, "b")  # within the idle limit: the same session
    assert backend_pid(store.kept_connection(pg, DELIVERED)) == pid
    monkeypatch.setattr(owned, "IDLE_REPLACED_AFTER", -1.0)  # any idleness is too long
    task_id = run_one(broker, "c")
    assert status(pg, task_id) == (states.SUCCESS, '"c@1"')
    assert eventually(lambda: session_ended(pg, pid))


def prepared_statements(connection: Any) -> list[str]:
    """The statements prepared in ``connection``'s session (PostgreSQL's own view)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement FROM pg_prepared_statements")
        return [str(row[0]) for row in cursor.fetchall()]


@pytest.mark.parametrize("prepare", [True, False])
def test_prepare__the_stores_statements_prepared_on_the_kept_session_unless_off(
    broker: Broker, pg: str, settings: Any, prepare: bool
) -> None:
    """With ``fenced_prepare`` (the default) the grant and the success are prepared on
    the server from their second run on; off, nothing is prepared (PgBouncer in
    transaction mode without prepared-statement support)."""
    store.close_kept_connection(pg)
    settings.CELERY_FENCED_PREPARE = prepare
    for value in "abc":
        task_id = run_one(broker, value)
        assert status(pg, task_id) == (states.SUCCESS, f'"{value}@1"')
    kept = store.kept_connection(pg, DELIVERED)
    assert kept is not None
    prepared = prepared_statements(kept)
    if prepare:
        assert any("celery_fenced_lease" in statement for statement in prepared)
    else:
        assert prepared == []
    store.close_kept_connection(pg)


@pytest.mark.parametrize("prepare", [True, False])
def test_prepare__the_public_apis_statements_prepared_on_djangos_session_unless_off(
    pg: str, settings: Any, prepare: bool
) -> None:
    """``acquire()``, ``release()`` and a permit, called outside a worker, run on Django's
    connection: with ``fenced_prepare`` their statements are prepared on its session at
    their first run, and the application's own queries are not; off, nothing is."""
    from celery_fenced import acquire

    settings.CELERY_FENCED_PREPARE = prepare
    connection = connections[pg]
    connection.close()  # a new session: nothing prepared on it yet
    for _ in range(2):
        acquire("prepared-key", ttl=30, using=pg).release()
        acquire("prepared-permit", ttl=30, using=pg, limit=2).release()
        assert Lease.objects.using(pg).filter(key="prepared-key").count() == 1
    prepared = prepared_statements(connection)
    if prepare:
        assert any("INSERT INTO celery_fenced_lease" in statement for statement in prepared)
        assert not any('"celery_fenced_lease"' in statement for statement in prepared)  # ORM
    else:
        assert prepared == []
    connection.close()
