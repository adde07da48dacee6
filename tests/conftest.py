"""Shared fixtures: every database test runs on SQLite *and* PostgreSQL.

The tests are in three layers: ``unit`` (no server, broker or process: runs anywhere, on
SQLite at most; ``pytest tests/unit`` needs no ``FENCED_*`` variable),
``integration`` (the real databases, SQLite and PostgreSQL, through Celery's tracer and the
real backend; no worker process) and ``acceptance`` (real ``celery worker`` processes on
Redis and RabbitMQ, the browser, the wheel, the demo, the chaos runner).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from django.conf import settings
from django.db import connections

from devtools.workers import BROKER_URLS

#: pytester: the tests of the testing helpers' plugin run pytest in a subprocess
pytest_plugins = ["pytester"]

DATABASE_ALIASES = ["default", "postgres"]
#: MariaDB (the MySQL family): a module opts in with ``databases=WITH_MARIADB`` and an
#: ``alias`` fixture returning ``alias_with_mariadb`` (its tests then run on all three)
MARIADB = "mariadb"
#: (the alias is declared only when configured: a run without it — the version matrix's
#: core — deselects its cases, and any other run fails on them, never silently skips)
WITH_MARIADB = [*DATABASE_ALIASES, *([MARIADB] if os.environ.get("FENCED_MARIADB_PORT") else [])]
#: what a worker's tracer sets on the request of a delivered message (not called
#: directly, not eager): where ``store.kept_connection`` keeps a connection
DELIVERED = SimpleNamespace(called_directly=False, is_eager=False)


def require_servers() -> None:
    """The integration and acceptance layers run on PostgreSQL too, never silently not."""
    if "postgres" not in settings.DATABASES:
        raise pytest.UsageError(
            "PostgreSQL is not configured (FENCED_PG_PORT is unset): run the suite with "
            "`bash tests/run.sh`, which starts a throwaway server. There is no silent "
            "fallback to SQLite. (`pytest tests/unit` needs no server.)"
        )


@pytest.fixture(scope="session")
def django_db_setup(django_db_setup: Any) -> Iterator[None]:
    """pytest-django's test databases; before they are dropped, no session of a thread of
    ours is left on them: the renewer's (idle, it closes its connection) and the kept
    connections of grants (``store.owned``).

    Once they are made, the content types and permissions are no longer made again
    after the flush that ends each transactional test (Django's ``post_migrate``, on
    every database a test names: most of what such a test costs). A test that needs a
    permission makes it (``login``); a content type is made when asked for."""
    from django.contrib.auth.management import create_permissions
    from django.contrib.contenttypes.management import create_contenttypes
    from django.db.models.signals import post_migrate

    post_migrate.disconnect(
        create_permissions, dispatch_uid="django.contrib.auth.management.create_permissions"
    )
    post_migrate.disconnect(create_contenttypes)
    yield
    import time

    from celery_fenced import store
    from celery_fenced.renewal import renewer

    store.close_kept_connections()
    keeper = renewer()
    for lease in keeper.held():
        keeper.unregister(lease)
    with keeper._cond:
        keeper._cond.notify_all()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _other_sessions():
        time.sleep(0.05)


def _other_sessions() -> int:
    """Sessions on the PostgreSQL test database but this thread's and the counting one."""
    if "postgres" not in settings.DATABASES:
        return 0
    import psycopg

    mine = connections["postgres"]
    own = mine.connection.info.backend_pid if mine.connection is not None else 0
    try:
        with side_connection("postgres") as admin:
            found = admin.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND pid <> pg_backend_pid() AND pid <> %s",
                [own],
            ).fetchone()
            return int(found[0])
    except psycopg.OperationalError:
        return 0  # its test database was not set up (no test of this run used it)


@pytest.fixture(autouse=True)
def _no_stale_content_types() -> None:
    """A flush took the content types with it (and they are not made again: see
    ``django_db_setup``): none is served from the cache of an earlier test."""
    from django.contrib.contenttypes.models import ContentType

    ContentType.objects.clear_cache()


@pytest.fixture(autouse=True)
def _kept_connections_closed() -> Iterator[None]:
    """After each test, close the connections it kept for grants (``store.owned``).

    A worker closes them at shutdown; left open, they would hold the test database.
    """
    yield
    from celery_fenced import store

    store.close_kept_connections()


@pytest.fixture(params=DATABASE_ALIASES, ids=["sqlite", "postgres"])
def alias(request: pytest.FixtureRequest) -> str:
    """A database alias; the test runs once per database."""
    return str(request.param)


@pytest.fixture(params=[*DATABASE_ALIASES, MARIADB], ids=["sqlite", "postgres", "mariadb"])
def alias_with_mariadb(request: pytest.FixtureRequest) -> str:
    """A database alias, MariaDB included; the test runs once per database."""
    if request.param == MARIADB and MARIADB not in settings.DATABASES:
        raise pytest.UsageError(
            "MariaDB is not configured (FENCED_MARIADB_PORT is unset): run the suite with "
            "`bash tests/run.sh`, which starts a throwaway server."
        )
    return str(request.param)


@pytest.fixture
def lease_db(alias: str, settings: Any) -> Iterator[str]:
    """Leases and results on ``alias`` (``fenced_database`` and a router for the rest)."""
    from . import routers

    routers.TARGET = alias
    settings.DATABASE_ROUTERS = ["tests.routers.AllToTarget"]
    settings.CELERY_FENCED_DATABASE = alias
    yield alias
    routers.TARGET = "default"


@pytest.fixture
def child_env() -> dict[str, str]:
    """Environment for processes the tests start: the test databases, this checkout."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return {
        **os.environ,
        "FENCED_USE_TEST_DATABASES": "1",
        "DJANGO_SETTINGS_MODULE": "testproject.settings",
        "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }


@pytest.fixture(params=list(BROKER_URLS))
def broker(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The broker of the test's workers and of ``devtools.workers.send``; the test runs
    once per broker (RabbitMQ's cases with PostgreSQL only: ``pytest_collection_modifyitems``)."""
    name = str(request.param)
    variable = BROKER_URLS[name]
    if not os.environ.get(variable):
        raise pytest.UsageError(
            f"{name} is not configured ({variable} is unset): run the suite "
            "with `bash tests/run.sh`, which starts a throwaway server."
        )
    monkeypatch.setenv("FENCED_TEST_BROKER", name)
    return name


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run a real-worker test on RabbitMQ with PostgreSQL only (what the broker does does
    not depend on the database; every database runs on Redis), and a test marked
    ``broker("redis")`` — about that broker's own mechanism — on that broker only."""
    kept, dropped = [], []
    for item in items:
        params = getattr(item, "callspec", None)
        given = params.params if params is not None else {}
        broker = given.get("broker")
        only = item.get_closest_marker("broker")
        database = given.get("alias", given.get("alias_with_mariadb"))
        if broker is not None and (
            (only is not None and broker not in only.args)
            or (broker == "rabbitmq" and database not in (None, "postgres"))
        ):
            dropped.append(item)
        else:
            kept.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


@pytest.fixture
def start_worker(
    alias: str, broker: str, tmp_path: Any, request: pytest.FixtureRequest
) -> Iterator[Callable[..., Any]]:
    """Start real `celery worker` processes on ``alias``'s database and ``broker``; stopped
    afterwards."""
    from devtools.workers import Worker

    queue = f"q-{request.node.name}"
    empty_broker(broker, queue)
    started: list[Worker] = []

    def start(name: str, **kwargs: Any) -> Worker:
        worker = Worker(name, database=alias, queue=queue, log_dir=tmp_path, **kwargs)
        started.append(worker)
        worker.wait_ready()
        return worker

    start.queue = queue  # type: ignore[attr-defined]
    start.broker = broker  # type: ignore[attr-defined]
    yield start
    for worker in started:
        worker.stop()
    if request.node.rep_call.failed if hasattr(request.node, "rep_call") else False:
        for worker in started:
            print(f"--- log of {worker.name}\n{worker.output()[-4000:]}")


@pytest.fixture
def redelivery_after(broker: str) -> Iterator[Callable[[float], dict[str, str]]]:
    """``redelivery_after(seconds)``: the broker redelivers a message that a worker
    started after this holds unacknowledged for ``seconds``. Redis: its visibility timeout
    (returns the workers' environment); RabbitMQ: the node's ``consumer_timeout`` (it
    closes the holder's channel), for the channels opened during this test."""
    from devtools import services

    changed = []

    def after(seconds: float) -> dict[str, str]:
        if broker == "redis":
            return {"FENCED_VISIBILITY_TIMEOUT": str(seconds)}
        services.set_consumer_timeout(os.environ["FENCED_RABBITMQ_DIR"], int(seconds * 1000))
        changed.append(seconds)
        return {}

    yield after
    if changed:
        services.set_consumer_timeout(
            os.environ["FENCED_RABBITMQ_DIR"], services.RABBITMQ_CONSUMER_TIMEOUT_MS
        )


def empty_broker(broker: str, queue: str) -> None:
    """Nothing left from an earlier run: Redis emptied; RabbitMQ's queue ``queue`` deleted."""
    from devtools.workers import broker_url

    if broker == "redis":
        import redis

        redis.Redis.from_url(broker_url(broker)).flushdb()
        return
    from kombu import Connection

    with Connection(broker_url(broker)) as connection:
        connection.default_channel.queue_delete(queue)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


def wait_until_blocked(alias: str, thread: Any) -> None:
    """Wait until ``thread``'s statement waits for a lock in ``alias``'s database.

    PostgreSQL (``pg_stat_activity``) and MariaDB (``information_schema.INNODB_TRX``)
    tell; SQLite does not, so there the thread is only known to be alive (waiting, or not
    there yet: the test then proves less, never fails).
    """
    import time

    deadline = time.monotonic() + 30
    vendor = connections[alias].vendor
    if vendor not in WAITING:
        thread.join(timeout=0.5)
        assert thread.is_alive()
        return
    watcher = side_connection(alias)
    try:
        while time.monotonic() < deadline:
            cursor = watcher.cursor()
            cursor.execute(WAITING[vendor])
            row = cursor.fetchone()
            if row and row[0]:
                return
            assert thread.is_alive()
            # InnoDB refreshes INNODB_TRX only when it was not read for 0.1 s
            time.sleep(0.02 if vendor == "postgresql" else 0.15)
    finally:
        watcher.close()
    raise AssertionError("the thread's statement never waited for a lock")


#: how many of the test database's sessions wait for a lock, by vendor
WAITING = {
    "postgresql": "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
    "AND datname = current_database()",
    "mysql": "SELECT count(*) FROM information_schema.INNODB_TRX t "
    "JOIN information_schema.PROCESSLIST p ON p.ID = t.trx_mysql_thread_id "
    "WHERE t.trx_state = 'LOCK WAIT' AND p.DB = DATABASE()",
}


def run_in_threads(target: Callable[[int], None], count: int, timeout: float = 60) -> None:
    """``target(i)`` for ``i`` in ``range(count)``, each in a thread of its own started
    before any is waited for; then each is waited for up to ``timeout`` seconds."""
    threads = [threading.Thread(target=target, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)


class RolledBack(Exception):
    """Raised to roll a test's transaction back."""


def rolled_back(alias: str, action: Callable[[], Any]) -> None:
    """Run ``action`` in a transaction on ``alias`` that then rolls back."""
    from django.db import transaction

    try:
        with transaction.atomic(using=alias):
            action()
            raise RolledBack
    except RolledBack:
        pass


def side_connection(alias: str) -> Any:
    """A connection of its own to ``alias``'s PostgreSQL or MariaDB database (autocommit)."""
    settings = connections[alias].settings_dict
    if connections[alias].vendor == "mysql":
        import MySQLdb

        connection = MySQLdb.connect(
            host=settings["HOST"],
            port=int(settings["PORT"]),
            user=settings["USER"],
            password=settings["PASSWORD"],
            database=settings["NAME"],
        )
        connection.autocommit(True)
        return connection
    import psycopg

    return psycopg.connect(
        host=settings["HOST"],
        port=settings["PORT"],
        user=settings["USER"],
        password=settings["PASSWORD"],
        dbname=settings["NAME"],
        autocommit=True,
    )


def terminate_connection(alias: str) -> None:
    """End this thread's PostgreSQL sessions of ``alias`` from the server's side.

    Django's, and the connection the thread keeps for grants and successes
    (``celery_fenced.store.owned``), opened here if it was not yet.
    """
    from celery_fenced import store

    sessions = [connections[alias]]
    kept = store.kept_connection(alias, DELIVERED)
    if kept is not None:
        sessions.append(kept)
    for connection in sessions:
        connection.ensure_connection()
        with side_connection(alias) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(%s)", [connection.connection.info.backend_pid]
            )


def end_session(alias: str) -> None:
    """The database server ends this thread's session on ``alias`` (as a restart would),
    from a connection of its own; returns once the session is gone."""
    import time

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
        deadline = time.monotonic() + 30
        while True:  # the server ends the session a moment after it is asked to
            cursor.execute(gone, [session])
            if cursor.fetchone()[0] == 0:
                return
            assert time.monotonic() < deadline, f"session {session} was never ended"
            time.sleep(0.01)
    finally:
        admin.close()


def refuse_one_reconnect(monkeypatch: Any, alias: str, refused: list[bool]) -> None:
    """The next new connection to ``alias`` is refused once, as a restarting database
    refuses it ("the database system is shutting down"); ``refused`` records it."""
    connection = connections[alias]
    real_connect = connection.get_new_connection

    def shutting_down(params: Any) -> Any:
        if not refused:
            refused.append(True)
            raise connection.Database.OperationalError(
                "connection failed: FATAL:  the database system is shutting down"
            )
        return real_connect(params)

    monkeypatch.setattr(connection, "get_new_connection", shutting_down)
