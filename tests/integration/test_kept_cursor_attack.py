"""The store's kept psycopg cursor (``prepared.fetch``), attacked on the real server: its
errors are Django's, and whatever watches Django's cursors still sees its statements."""

from __future__ import annotations

import functools
from typing import Any

import pytest
from django.db import DatabaseError, connections, transaction
from django.db.backends.utils import CursorWrapper
from django.test.utils import CaptureQueriesContext

from celery_fenced import acquire, store
from tests.conftest import DATABASE_ALIASES, DELIVERED, side_connection
from tests.integration.test_kept_connection import deliver_id, publish
from tests.integration.test_seams import Broker

pytestmark = [
    pytest.mark.django_db(transaction=True, databases=DATABASE_ALIASES),
    pytest.mark.timeout(120),
]


def _passthrough(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
    return execute(sql, params, many, context)


def _lock_timeout_outcome(alias: str, key: str) -> tuple[str, bool, bool, int]:
    """A grant that times out on a row lock inside the caller's atomic(): what Django
    says, the flags it leaves, and that the next grant after the rollback runs."""
    connection = connections[alias]
    acquire(key, ttl=30, using=alias).release()
    with side_connection(alias) as admin, admin.transaction():
        admin.execute("SELECT 1 FROM celery_fenced_lease WHERE key = %s FOR UPDATE", [key])
        connection.errors_occurred = False
        with pytest.raises(DatabaseError) as raised:
            _grant_in_atomic(alias, key)
        errors = connection.errors_occurred
        needs = connection.needs_rollback
    token = acquire(key, ttl=30, using=alias).token
    return type(raised.value).__name__, errors, needs, token


def _grant_in_atomic(alias: str, key: str) -> None:
    """A grant of ``key`` in a transaction that waits at most 100 ms for a row lock."""
    with transaction.atomic(using=alias):
        with connections[alias].cursor() as cursor:
            cursor.execute("SET LOCAL lock_timeout = '100ms'")
        acquire(key, ttl=30, using=alias)


def test_error_inside_atomic__same_as_through_djangos_cursor(prepared_pg: str) -> None:
    """A statement that fails in the caller's ``atomic()`` on the kept cursor raises what
    Django's cursor raises and leaves the same flags; the next grant runs after it."""
    kept = _lock_timeout_outcome(prepared_pg, "atomic-kept")
    assert "_celery_fenced_cursor" in connections[prepared_pg].__dict__
    with connections[prepared_pg].execute_wrapper(_passthrough):  # forces Django's cursor
        django = _lock_timeout_outcome(prepared_pg, "atomic-django")
    assert kept == django, (kept, django)


def _seen_by_patched_execute(alias: str, patch: Any) -> int:
    seen: list[str] = []
    original = CursorWrapper.execute
    CursorWrapper.execute = patch(original, seen)
    try:
        acquire("apm", ttl=30, using=alias).release()
    finally:
        CursorWrapper.execute = original
    return len(seen)


class _Proxy:
    """A function wrapper as wrapt makes them (Scout, Elastic and other APMs patch with
    it): not a function, and it hands on the wrapped function's attributes, its
    ``__code__`` included."""

    def __init__(self, wrapped: Any, seen: list[str]) -> None:
        self.__wrapped__, self._seen = wrapped, seen

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__wrapped__, name)

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        return functools.partial(self.__call__, instance) if instance is not None else self

    def __call__(self, instance: Any, sql: str, params: Any = None) -> Any:
        self._seen.append(sql)
        return self.__wrapped__(instance, sql, params)


def _wrapt_patch(original: Any, seen: list[str]) -> Any:
    return _Proxy(original, seen)


def test_apm_patching_cursorwrapper_execute__sees_the_stores_statements(prepared_pg: str) -> None:
    """An APM's ``CursorWrapper.execute`` as a wrapt-like proxy (not a function, its
    ``__code__`` Django's) sees the store's statements even after the kept cursor was
    made (a function in its place: ``test_prepared_attack``)."""
    acquire("apm", ttl=30, using=prepared_pg).release()  # the kept cursor made
    assert _seen_by_patched_execute(prepared_pg, _wrapt_patch) >= 2


def test_observers_on_djangos_connection__see_the_stores_statements(
    prepared_pg: str, settings: Any
) -> None:
    """``CaptureQueriesContext``, an ``execute_wrapper`` and ``DEBUG`` see them all."""
    connection = connections[prepared_pg]
    acquire("obs", ttl=30, using=prepared_pg).release()
    with CaptureQueriesContext(connection) as captured:
        acquire("obs", ttl=30, using=prepared_pg).release()
    assert len(captured.captured_queries) >= 2
    seen: list[str] = []
    with connection.execute_wrapper(lambda ex, sql, p, m, c: seen.append(sql) or ex(sql, p, m, c)):
        acquire("obs", ttl=30, using=prepared_pg).release()
    assert len(seen) >= 2
    settings.DEBUG = True
    connection.queries_log.clear()
    acquire("obs", ttl=30, using=prepared_pg).release()
    assert len(connection.queries) >= 2


def test_simple_test_case_guard__refuses_the_stores_statements(prepared_pg: str) -> None:
    """``SimpleTestCase`` replaces ``connection.cursor`` of the databases it does not
    allow (django-debug-toolbar and ddtrace replace it too): the store's statements go
    through it, on a connection opened before as on a new one."""
    acquire("guard", ttl=30, using=prepared_pg).release()  # connection open, cursor kept

    from django.test.testcases import _DatabaseFailure

    connection = connections[prepared_pg]
    connection.cursor = _DatabaseFailure(connection.cursor, "queries not allowed")
    try:
        with pytest.raises(Exception, match="not allowed"):
            acquire("guard", ttl=30, using=prepared_pg)
    finally:
        connection.cursor = connection.cursor.wrapped  # as SimpleTestCase puts it back
    acquire("guard", ttl=30, using=prepared_pg).release()
    kept = connection.__dict__["_celery_fenced_cursor"]
    acquire("guard", ttl=30, using=prepared_pg).release()
    assert connection.__dict__["_celery_fenced_cursor"] is kept  # its own method: kept again


def test_kept_worker_connection__a_wrapt_apm_sees_its_statements(
    broker: Broker, prepared_pg: str
) -> None:
    """A delivery's grant and success on the worker's kept connection, through Celery's
    tracer, go through an APM's wrapt-like ``CursorWrapper.execute``."""
    kept = store.kept_connection(prepared_pg, DELIVERED)
    assert kept is not None
    deliver_id(broker, publish(broker, "warm"))
    task_id = publish(broker, "a")
    seen: list[str] = []
    original = CursorWrapper.execute
    CursorWrapper.execute = _wrapt_patch(original, seen)
    try:
        deliver_id(broker, task_id)
    finally:
        CursorWrapper.execute = original
    assert len(seen) >= 2, seen


class _CursorProxy:
    """``connection.cursor`` wrapped as ddtrace wraps it (wrapt): a proxy that hands on
    the bound method's attributes, ``__func__`` and ``__self__`` included."""

    def __init__(self, wrapped: Any, seen: list[str]) -> None:
        self.__wrapped__, self._seen = wrapped, seen

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__wrapped__, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._seen.append("cursor")
        return self.__wrapped__(*args, **kwargs)


def test_connection_cursor_wrapped_by_a_tracer__the_stores_statements_go_through_it(
    prepared_pg: str,
) -> None:
    """A tracer that wraps ``cursor`` on the connection with a proxy (ddtrace) sees the
    store's statements, as django-debug-toolbar's plain replacement does."""
    connection = connections[prepared_pg]
    acquire("proxied", ttl=30, using=prepared_pg).release()  # the kept cursor made
    seen: list[str] = []
    connection.cursor = _CursorProxy(connection.cursor, seen)
    try:
        acquire("proxied", ttl=30, using=prepared_pg).release()
    finally:
        del connection.cursor
    assert len(seen) >= 2
