"""The store's statements prepared on Django's own PostgreSQL connections, attacked.

``fenced_prepare`` runs the store's statements on Django's connection through a cursor
that prepares them on the server (``store.dialects.prepared``). These tests run them
where a session's prepared statements could go wrong: in transactions and savepoints of
the caller's that roll back, after the server ended the session, across schema changes,
under the tools that watch Django's queries, across a fork, and on a connection pool.
Every test runs through the public API on the real server.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from celery import states
from django.db import DatabaseError, NotSupportedError, connections, transaction
from django.test.utils import CaptureQueriesContext

from celery_fenced import acquire
from celery_fenced.models import Lease, PendingJob
from tests.conftest import DATABASE_ALIASES, RolledBack, rolled_back, side_connection
from tests.integration.test_kept_connection import (
    backend_pid,
    deliver_id,
    eventually,
    publish,
    session_ended,
)
from tests.integration.test_seams import Broker, status

pytestmark = [
    pytest.mark.django_db(transaction=True, databases=DATABASE_ALIASES),
    pytest.mark.timeout(120),
]


@pytest.fixture
def pg(prepared_pg: str) -> str:
    """The PostgreSQL alias, ``fenced_prepare`` on, on a new session."""
    return prepared_pg


def prepared(alias: str) -> list[str]:
    """The statements prepared in the session of Django's connection of ``alias``."""
    with connections[alias].cursor() as cursor:
        cursor.execute("SELECT statement FROM pg_prepared_statements")
        return [str(row[0]) for row in cursor.fetchall()]


def leases_statements(alias: str) -> list[str]:
    """The store's statements prepared on Django's session of ``alias``."""
    return [s for s in prepared(alias) if "celery_fenced_lease" in s]


def cycle(alias: str, key: str) -> tuple[int, int]:
    """A lease and a permit taken and released through the public API: their tokens."""
    lease = acquire(key, ttl=30, using=alias)
    lease.renew()
    assert lease.release()
    permit = acquire(f"{key}-permits", ttl=30, using=alias, limit=2)
    permit.renew()
    assert permit.release()
    return lease.token, permit.token


def end_session(alias: str, pid: int) -> None:
    """End the server session ``pid`` (``pg_terminate_backend``) and wait until it has."""
    with side_connection(alias) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", [pid])
    assert eventually(lambda: session_ended(alias, pid))


# 1. Transactions


def test_rolled_back_transaction__statements_prepared_in_it_run_again_after(
    broker: Broker, pg: str
) -> None:
    """Statements first run (and prepared) in a transaction of the caller's that rolls
    back run again in the next one and outside any: a grant, a renewal, a release, a
    permit and a publish's outbox row."""

    def everything() -> None:
        cycle(pg, "tx")
        publish(broker, "rolled back")

    rolled_back(pg, everything)  # first runs: prepared, then rolled back
    rolled_back(pg, everything)  # again, in a transaction
    assert not Lease.objects.using(pg).filter(key="tx").exists()
    assert PendingJob.objects.using(pg).count() == 0
    assert broker.sent("seams.step") == []
    assert cycle(pg, "tx")[0] >= 1  # outside a transaction
    with transaction.atomic(using=pg):
        cycle(pg, "tx")
        task_id = publish(broker, "committed")
    assert leases_statements(pg)
    deliver_id(broker, task_id)
    assert status(pg, task_id) == (states.SUCCESS, '"committed@1"')
    outside = publish(broker, "outside")
    deliver_id(broker, outside)
    assert status(pg, outside) == (states.SUCCESS, '"outside@1"')


def test_rolled_back_savepoints__statements_prepared_in_them_run_in_the_outer_transaction(
    broker: Broker, pg: str
) -> None:
    """Savepoints that roll back (``ROLLBACK TO SAVEPOINT``), one of them after an error
    that aborted it, around the store's first runs: the outer transaction goes on with
    the same statements, and commits what it did itself."""
    with transaction.atomic(using=pg):
        try:
            with transaction.atomic(using=pg):
                cycle(pg, "sp")  # first runs, in the savepoint
                publish(broker, "in the savepoint")
                raise RolledBack
        except RolledBack:
            pass
        try:
            with transaction.atomic(using=pg):
                acquire("sp", ttl=30, using=pg)
                with connections[pg].cursor() as cursor:
                    cursor.execute("SELECT 1 / 0")  # aborts the savepoint
        except DatabaseError:
            pass
        with transaction.atomic(using=pg), transaction.atomic(using=pg):
            first, _permit = cycle(pg, "sp")
        task_id = publish(broker, "outer")
    assert first == 1  # the rolled back grants left no token behind
    assert Lease.objects.using(pg).get(key="sp").token == 1
    assert [m[0]["id"] for m in broker.sent("seams.step")] == [task_id]
    deliver_id(broker, task_id)
    assert status(pg, task_id) == (states.SUCCESS, '"outer@1"')
    assert cycle(pg, "sp")[0] == 2


def test_session_ended_by_the_server__the_next_call_fails_as_djangos_own_then_runs(
    pg: str, settings: Any
) -> None:
    """``pg_terminate_backend`` on Django's session after the store prepared there: the
    next call fails as Django's own query does (a database error, the connection then
    unusable), and once Django replaces the connection (as at a request's or a task's
    end) every call runs, its statements prepared again on the new session; no
    "prepared statement does not exist"."""
    outcomes: dict[bool, list[str]] = {}
    for prepare in (True, False):
        settings.CELERY_FENCED_PREPARE = prepare
        connection = connections[pg]
        connection.close()
        cycle(pg, f"ended-{prepare}")
        pid = backend_pid(connection)
        end_session(pg, pid)
        seen = []
        with pytest.raises(DatabaseError) as raised:
            acquire(f"ended-{prepare}", ttl=30, using=pg)
        seen.append(type(raised.value).__name__)
        assert "does not exist" not in str(raised.value)
        seen.append(str(connection.is_usable()))
        connection.close_if_unusable_or_obsolete()
        assert cycle(pg, f"ended-{prepare}")[0] == 2
        assert backend_pid(connection) != pid
        if prepare:
            assert leases_statements(pg)
        outcomes[prepare] = seen
    assert outcomes[True] == outcomes[False], outcomes


def test_session_ended_inside_a_transaction__the_next_transaction_runs(pg: str) -> None:
    """The session ended while a transaction of the caller's ran the store's statements:
    the transaction fails; after Django replaces the connection the next one runs."""
    cycle(pg, "ended-tx")
    pid = backend_pid(connections[pg])

    def ended_midway() -> None:
        acquire("ended-tx", ttl=30, using=pg).release()
        end_session(pg, pid)
        acquire("ended-tx", ttl=30, using=pg)

    with pytest.raises(DatabaseError):
        transaction.atomic(using=pg)(ended_midway)()
    connections[pg].close_if_unusable_or_obsolete()
    with transaction.atomic(using=pg):
        assert cycle(pg, "ended-tx")[0] == 2  # the failed transaction's grant rolled back
    assert Lease.objects.using(pg).get(key="ended-tx").token == 2


@pytest.mark.parametrize("where", ["same session", "another session"])
def test_schema_change__prepared_statements_run_after_a_column_added_and_dropped(
    broker: Broker, pg: str, where: str
) -> None:
    """A column added to and dropped from the lease and outbox tables (a migration), in
    Django's session or another one, after the store prepared its statements: they run
    on (no "cached plan must not change result type"), outside and inside a
    transaction."""

    def alter(statement: str) -> None:
        if where == "same session":
            with connections[pg].cursor() as cursor:
                cursor.execute(statement)
        else:
            with side_connection(pg) as admin:
                admin.execute(statement)

    tables = ["celery_fenced_lease", "celery_fenced_pendingjob"]
    cycle(pg, "schema")
    before = publish(broker, "before")
    pid = backend_pid(connections[pg])
    try:
        for table in tables:
            alter(f"ALTER TABLE {table} ADD COLUMN x int")
        assert cycle(pg, "schema")[0] == 2
        added = publish(broker, "added")
        with transaction.atomic(using=pg):
            cycle(pg, "schema")
            publish(broker, "added in a transaction")
    finally:
        for table in tables:
            alter(f"ALTER TABLE {table} DROP COLUMN IF EXISTS x")
    assert cycle(pg, "schema")[0] == 4
    dropped = publish(broker, "dropped")
    assert backend_pid(connections[pg]) == pid  # all on the one session
    for task_id, value in [(before, "before"), (added, "added"), (dropped, "dropped")]:
        deliver_id(broker, task_id)
        assert status(pg, task_id) == (states.SUCCESS, f'"{value}@1"')


# 2. The tools that watch Django's queries


def test_execute_wrapper__sees_every_statement_of_the_store_with_its_text(pg: str) -> None:
    """``connection.execute_wrapper()`` receives the store's statements (SQL text and
    parameters), and they run prepared all the same."""
    seen: list[tuple[str, Any]] = []

    def wrapper(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        seen.append((sql, params))
        return execute(sql, params, many, context)

    with connections[pg].execute_wrapper(wrapper):
        cycle(pg, "wrapped")
    assert len(seen) >= 6
    assert all(isinstance(sql, str) and sql.strip() for sql, _ in seen)
    assert any("INSERT INTO celery_fenced_lease" in sql for sql, _ in seen)
    assert leases_statements(pg)


def test_capture_queries__real_sql_text_and_counts(pg: str, settings: Any) -> None:
    """``CaptureQueriesContext`` (``assertNumQueries``) and ``DEBUG``'s
    ``connection.queries`` show the store's statements with their SQL text, the same
    number with and without ``fenced_prepare``."""
    counts = []
    for prepare in (True, False):
        settings.CELERY_FENCED_PREPARE = prepare
        cycle(pg, f"captured-{prepare}")  # the permit rows made: the same path below
        with CaptureQueriesContext(connections[pg]) as captured:
            cycle(pg, f"captured-{prepare}")
        sqls = [query["sql"] for query in captured.captured_queries]
        assert all(isinstance(sql, str) and sql for sql in sqls), sqls
        assert any("celery_fenced_lease" in sql for sql in sqls)
        counts.append(len(sqls))
    assert counts[0] == counts[1]

    settings.CELERY_FENCED_PREPARE = True
    settings.DEBUG = True
    connection = connections[pg]
    connection.queries_log.clear()
    cycle(pg, "debug")
    queries = connection.queries
    assert queries
    assert all(isinstance(query["sql"], str) and query["sql"] for query in queries)
    assert any("celery_fenced_lease" in query["sql"] for query in queries)


def test_patched_cursor_wrapper__an_apm_sees_every_statement_of_the_store(
    pg: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An APM that replaces ``CursorWrapper.execute`` (Sentry, Scout: ``functools.wraps``
    over Django's) sees the store's statements: they leave the session's kept cursor for
    Django's while it is replaced, and go back to it after."""
    import functools

    from django.db.backends.utils import CursorWrapper

    djangos = CursorWrapper.execute
    seen: list[str] = []

    @functools.wraps(djangos)
    def traced(self: Any, sql: str, params: Any = None) -> Any:
        seen.append(sql)
        return djangos(self, sql, params)

    monkeypatch.setattr(CursorWrapper, "execute", traced)
    cycle(pg, "traced")
    assert any("INSERT INTO celery_fenced_lease" in sql for sql in seen)
    assert leases_statements(pg)

    monkeypatch.setattr(CursorWrapper, "execute", djangos)
    seen.clear()
    cycle(pg, "untraced")
    assert seen == []  # the kept cursor again: nothing goes through Django's


def test_kept_cursor__one_per_session_and_left_while_the_connection_is_shared(pg: str) -> None:
    """The store's statements reuse one cursor of the session, a new one after the
    session is replaced; while the connection is shared between threads (Django's
    ``inc_thread_sharing``) they go through Django's cursor, made per statement."""
    from celery_fenced.store.dialects import prepared as preparing

    connection = connections[pg]
    cycle(pg, "kept")
    first = connection.__dict__[preparing._KEPT]
    cycle(pg, "kept")
    assert connection.__dict__[preparing._KEPT] is first

    connection.close()
    cycle(pg, "kept")
    again = connection.__dict__[preparing._KEPT]
    assert again[0] is connection.connection
    assert again[0] is not first[0]

    del connection.__dict__[preparing._KEPT]
    connection.inc_thread_sharing()
    try:
        cycle(pg, "shared-thread")
    finally:
        connection.dec_thread_sharing()
    assert preparing._KEPT not in connection.__dict__
    assert leases_statements(pg)


def test_djangos_own_queries__never_prepared_on_the_shared_session(pg: str) -> None:
    """The store's statements prepared on Django's session leave the application's own
    queries unprepared there, however often they run (the ORM, a raw cursor)."""
    for _ in range(20):
        cycle(pg, "shared")
        list(Lease.objects.using(pg).filter(key="shared"))
        with connections[pg].cursor() as cursor:
            cursor.execute("SELECT count(*) FROM celery_fenced_lease WHERE key = %s", ["shared"])
    statements = prepared(pg)
    assert statements
    assert all("SELECT count(*) FROM celery_fenced_lease" not in s for s in statements)
    assert all('"celery_fenced_lease"' not in s for s in statements)  # the ORM's quoting


# 3. Forks and pools


def test_fork__the_child_closes_the_inherited_session_and_prepares_on_its_own(
    broker: Broker, pg: str
) -> None:
    """A prefork pool child: Celery's Django fixup closes the connections it inherits at
    process init; the child's calls open a session of its own and prepare there, and
    the parent's session (its prepared statements included) is left whole."""
    from celery.fixups.django import DjangoWorkerFixup

    cycle(pg, "fork")
    parent_pid = backend_pid(connections[pg])
    parent_statements = sorted(prepared(pg))
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child's report goes through the pipe
        code = 1
        try:
            os.close(read)
            DjangoWorkerFixup(broker.app).on_worker_process_init()
            token = cycle(pg, "fork")[0]
            own = backend_pid(connections[pg])
            statements = leases_statements(pg)
            ok = token == 2 and own != parent_pid and bool(statements)
            os.write(write, f"{token} {own != parent_pid} {len(statements)}".encode())
            connections[pg].close()
            code = 0 if ok else 2
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read) as report:
        said = report.read()
    _, code = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(code) == 0, said
    assert backend_pid(connections[pg]) == parent_pid
    assert sorted(prepared(pg)) == parent_statements
    assert cycle(pg, "fork")[0] == 3


def test_pool__pooled_connections_reused_with_their_prepared_statements(
    broker: Broker, pg: str
) -> None:
    """``OPTIONS={"pool": ...}`` (psycopg_pool): a connection handed back to the pool and
    taken again keeps its session's prepared statements, also after a transaction of the
    caller's rolled back on it; every call runs."""
    pytest.importorskip("psycopg_pool")
    connection = connections[pg]
    connection.close()
    options = connection.settings_dict["OPTIONS"]
    options["pool"] = {"min_size": 1, "max_size": 1}
    try:
        cycle(pg, "pooled")
        pid = backend_pid(connection)
        statements = sorted(leases_statements(pg))
        assert statements
        for round_ in range(3):
            connection.close()  # back to the pool
            rolled_back(pg, lambda: cycle(pg, "pooled"))
            connection.close()
            assert cycle(pg, "pooled")[0] == 2 + round_
            assert backend_pid(connection) == pid  # the pool's one connection
            task_id = publish(broker, f"pooled {round_}")
            connection.close()
            deliver_id(broker, task_id)
            assert status(pg, task_id) == (states.SUCCESS, f'"pooled {round_}@1"')
        assert leases_statements(pg)
    finally:
        connection.close()
        connection.close_pool()
        del options["pool"]


@pytest.mark.parametrize(
    "option", [{"prepare_threshold": None}, {"server_side_binding": False}], ids=str
)
def test_options_opting_out__nothing_prepared_on_djangos_session(
    broker: Broker, pg: str, option: dict[str, Any]
) -> None:
    """Django's ``OPTIONS`` saying no prepared statements (``prepare_threshold: None``,
    ``server_side_binding: False``: PgBouncer in transaction mode) win over
    ``fenced_prepare`` on Django's connections, as on the kept one."""
    connection = connections[pg]
    options = connection.settings_dict["OPTIONS"]
    saved = dict(options)
    options.update(option)
    connection.close()
    try:
        cycle(pg, "opted-out")
        with transaction.atomic(using=pg):
            cycle(pg, "opted-out")
            publish(broker, "opted out")
        assert prepared(pg) == []
    finally:
        options.clear()
        options.update(saved)
        connection.close()


@pytest.mark.parametrize("pooled", [False, True], ids=["connection", "pool"])
def test_column_type_changed_by_a_migration__the_next_calls_run(
    broker: Broker, pg: str, pooled: bool
) -> None:
    """A migration in another session widens a column the store's statements return
    (``key``'s ``varchar`` length): PostgreSQL refuses a prepared statement whose result
    type changed ("cached plan must not change result type"). Outside a transaction the
    store's calls on a session that prepared them before run on; inside one the
    transaction fails once (its statement cannot be run again in it) and the next one
    runs; a worker's executions (its kept connection) run. A pool's stale connection is
    not handed out again."""
    from celery_fenced.store.dialects import for_alias

    if pooled:
        pytest.importorskip("psycopg_pool")
        options = connections[pg].settings_dict["OPTIONS"]
        options["pool"] = {"min_size": 1, "max_size": 1}
    cycle(pg, "widened")
    warm = publish(broker, "warm")
    deliver_id(broker, warm)  # the kept connection's statements prepared too
    deliver_id(broker, publish(broker, "warm again"))
    length = Lease._meta.get_field("key").max_length

    def widen(by: int) -> None:
        with side_connection(pg) as admin:
            admin.execute(
                f"ALTER TABLE celery_fenced_lease ALTER COLUMN key TYPE varchar({length + by})"
            )

    try:
        widen(1)
        with pytest.raises(NotSupportedError):
            transaction.atomic(using=pg)(lambda: cycle(pg, "widened"))()
        with transaction.atomic(using=pg):  # its rollback made psycopg forget them
            assert cycle(pg, "widened")[0] == 2
        widen(2)
        assert cycle(pg, "widened")[0] == 3
        assert cycle(pg, "widened")[0] == 4
        assert for_alias(pg).now()
        for value in ["after", "after again"]:
            task_id = publish(broker, value)
            deliver_id(broker, task_id)
            assert status(pg, task_id) == (states.SUCCESS, f'"{value}@1"')
    finally:
        connections[pg].close()
        if pooled:
            connections[pg].close_pool()
            del options["pool"]
        widen(0)


def _recording_cursor(seen: list[str]) -> type:
    """A cursor class of Django's PostgreSQL backend that notes each statement it runs."""
    from django.db.backends.postgresql.base import Cursor

    class Recording(Cursor):  # type: ignore[misc]
        def execute(self, query: Any, params: Any = None, **options: Any) -> Any:
            seen.append(str(query))
            return super().execute(query, params, **options)

    return Recording


def test_backend_making_its_own_cursors__the_stores_statements_go_through_them(
    pg: str,
) -> None:
    """A backend that makes its cursors its own way (django-tenants sets the tenant's
    ``search_path`` in ``_cursor()``) sees the store's statements: they run through its
    cursor, unprepared, as the application's do."""
    original = connections[pg]
    through: list[str] = []

    class Tenanted(type(original)):  # type: ignore[misc]
        def _cursor(self, name: Any = None) -> Any:
            through.append("cursor")
            return super()._cursor(name)

    wrapper = Tenanted(original.settings_dict, pg)
    connections[pg] = wrapper
    try:
        before = len(through)
        cycle(pg, "tenanted")
        assert len(through) - before >= 4  # grants, renewals and releases among them
        assert leases_statements(pg) == []
    finally:
        wrapper.close()
        connections[pg] = original


@pytest.mark.parametrize("where", ["OPTIONS", "set by a tracer"])
def test_cursor_factory_of_its_own__the_stores_statements_go_through_it(
    pg: str, where: str
) -> None:
    """A ``cursor_factory`` that is not Django's — given in ``OPTIONS``, or set on the
    connection by a tracer's instrumentation — runs the store's statements, unprepared."""
    seen: list[str] = []
    recording = _recording_cursor(seen)
    connection = connections[pg]
    options = connection.settings_dict["OPTIONS"]
    try:
        if where == "OPTIONS":
            options["cursor_factory"] = recording
        else:
            connection.ensure_connection()
            connection.connection.cursor_factory = recording
        cycle(pg, "traced")
        assert any("INSERT INTO celery_fenced_lease" in sql for sql in seen)
        assert leases_statements(pg) == []
    finally:
        options.pop("cursor_factory", None)
        connection.close()
