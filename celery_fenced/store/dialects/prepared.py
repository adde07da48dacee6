"""The store's statements prepared on Django's own PostgreSQL connections.

Django binds parameters on the client and never prepares (its default ``OPTIONS``), so
each of the store's statements — a grant, a release, a publish's outbox row, a permit —
is parsed and planned by the server every time it runs; the permit's grant spends more
on its planning than on its work. With ``fenced_prepare`` (on by default) and psycopg 3,
the store runs them through a cursor of Django's connection that binds on the server and
prepares the statement on its first run: once per connection, not once per call.

The statements run on one such cursor kept with the session (:func:`fetch`), after the
checks Django's cursor makes and under its error translation; while anything watches
Django's cursors (query logging, execute wrappers, a replaced ``CursorWrapper.execute``)
they go through a cursor wrapped as Django wraps its own (:func:`cursor`) instead, and
while Django logs queries through its own cursor, unprepared.
Only the store's statements go through it: the application's own queries keep the
connection's default cursor. Each statement is named once per session (psycopg's
prepared statements, up to its ``prepared_max`` of 100, forgotten at a rollback or a
reconnection and made again). ``OPTIONS`` that refuse prepared statements
(``prepare_threshold`` None, ``server_side_binding`` False) win over ``fenced_prepare``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import FunctionType, MethodType
from typing import Any

from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.utils import CursorWrapper

try:
    from django.db.backends.postgresql.psycopg_any import is_psycopg3
except ImportError:  # pragma: no cover - neither psycopg nor psycopg2 installed
    is_psycopg3 = False

#: psycopg prepares a statement after this many runs when asked to count: a connection
#: Django made without ``prepare_threshold`` (None: never prepare, not even on request)
#: gets it, which prepares only what asks for it — the application's queries through a
#: server-binding cursor would reach it after two billion runs
_ON_REQUEST_ONLY = 2**31 - 1

if is_psycopg3:
    import psycopg
    from django.db.backends.postgresql import base as postgresql

    class _PreparingCursor(psycopg.Cursor[Any]):
        """Server-side binding, each statement prepared on its first run."""

        def execute(self, query: Any, params: Any = None, **options: Any) -> Any:
            return super().execute(query, params, **{**options, "prepare": True})

    #: the cursor classes Django's own PostgreSQL backend gives its connections
    _DJANGOS_CURSORS: tuple[type, ...] = (postgresql.Cursor, postgresql.ServerBindingCursor)


def preparing(connection: BaseDatabaseWrapper) -> bool:
    """Whether the store's statements can be prepared on ``connection`` (PostgreSQL
    through psycopg 3), unless its ``OPTIONS`` say no prepared statements: an explicit
    ``prepare_threshold`` of None or ``server_side_binding`` False (PgBouncer in
    transaction mode) wins, as on the kept connection (:mod:`celery_fenced.store.owned`);
    and only on a backend that makes its cursors as Django's does (:func:`_djangos_cursors`)."""
    if not is_psycopg3 or connection.vendor != "postgresql" or not _djangos_cursors(connection):
        return False
    options = connection.settings_dict.get("OPTIONS", {})
    return not (
        ("prepare_threshold" in options and options["prepare_threshold"] is None)
        or options.get("server_side_binding") is False
    )


def _djangos_cursors(connection: BaseDatabaseWrapper) -> bool:
    """Whether ``connection`` makes its cursors as Django's PostgreSQL backend does.

    A backend that makes them its own way (django-tenants sets the schema's
    ``search_path`` in ``_cursor()``, django-prometheus counts in ``create_cursor()``)
    must see the store's statements too: they go through its own cursor, unprepared.
    So do they when the connection's ``cursor_factory`` is not Django's (given in
    ``OPTIONS``, or set by a tracer): :func:`cursor` looks at the connection made.
    """
    wrapper = type(connection)
    return (
        getattr(wrapper, "_cursor", None) is getattr(BaseDatabaseWrapper, "_cursor", None)
        and wrapper.create_cursor is postgresql.DatabaseWrapper.create_cursor
    )


def cursor(connection: BaseDatabaseWrapper) -> CursorWrapper:
    """A cursor of ``connection`` that prepares each statement on its first run,
    wrapped as :meth:`BaseDatabaseWrapper.cursor` wraps Django's own; Django's own
    cursor while queries are logged (``DEBUG``, ``CaptureQueriesContext``: Django reads
    a statement's text back from the cursor, which psycopg does not keep for a prepared
    one) or while a tool has replaced ``cursor`` on the connection (it sees them)."""
    if connection.queries_logged or _cursor_replaced(connection):
        return connection.cursor()
    with connection.wrap_database_errors:
        raw = _session(connection, prepare=True)
        if raw is None:
            return connection.cursor()
        connection.validate_thread_sharing()
        made: Any = _PreparingCursor(raw)
        return connection.make_cursor(made)


def _session(connection: BaseDatabaseWrapper, *, prepare: bool) -> Any:
    """``connection``'s psycopg connection, checked and opened as Django's cursor does
    it; ready to prepare the statements asked to (``prepare``); None when its cursors are
    a tracer's own (its ``cursor_factory``): they must see the statements."""
    connection.close_if_health_check_failed()
    connection.ensure_connection()
    raw = connection.connection
    if raw.cursor_factory not in _DJANGOS_CURSORS:
        return None
    if prepare and raw.prepare_threshold is None:
        raw.prepare_threshold = _ON_REQUEST_ONLY
    return raw


#: where :func:`fetch` keeps its cursor on a connection: (the session, prepare?, cursor)
_KEPT = "_celery_fenced_cursor"
#: Django's own ``CursorWrapper.execute`` (an APM may replace it): its code, checked once
#: per function seen
_WRAPPER_SEEN: list[Any] = [None, False]


def fetch(
    connection: BaseDatabaseWrapper,
    sql: str,
    params: Sequence[Any] | Mapping[str, Any],
    *,
    prepare: bool,
) -> list[tuple[Any, ...]] | None:
    """The rows of one of the store's statements, sent on a psycopg cursor kept with the
    session, or None: send it through Django's cursor (:meth:`cursor`) instead.

    Django's cursor wrapper, made and closed for every statement, costs more than the
    statement's own Python in psycopg; the store's statements need none of it when
    nothing else would see them there. So this does what Django's cursor does for a
    statement — the health check, the connection, the thread check, the broken-
    transaction check, the translation of errors — on one cursor per session, and is
    used only while nothing else looks at the connection's cursors: no query logging, no
    execute wrapper, no thread sharing, no ``cursor`` replaced on the connection
    (django-debug-toolbar, ddtrace, ``SimpleTestCase``'s guard), Django's own
    ``CursorWrapper.execute`` (an APM that replaces it sees the statements through it)
    and a backend that makes its cursors as Django's does.

    ``prepare``: a cursor that prepares each statement on its first run (see
    :func:`cursor`); otherwise the connection's own cursor class (a kept connection
    prepares by its ``OPTIONS``).
    """
    if (
        not is_psycopg3
        or connection.queries_logged
        or connection.execute_wrappers
        or connection.allow_thread_sharing
        or _cursor_replaced(connection)
        or not _djangos_wrapper()
        or not _djangos_cursors(connection)
    ):
        return None
    raw = _session(connection, prepare=prepare)
    if raw is None:
        return None
    connection.validate_thread_sharing()
    connection.validate_no_broken_transaction()
    with connection.wrap_database_errors:  # psycopg's errors as Django's, a cursor's too
        kept = connection.__dict__.get(_KEPT)
        if kept is None or kept[0] is not raw or kept[1] is not prepare:
            kept = (raw, prepare, _PreparingCursor(raw) if prepare else raw.cursor())
            connection.__dict__[_KEPT] = kept
        found = kept[2]
        found.execute(sql, params)
        return found.fetchall()


def _cursor_replaced(connection: BaseDatabaseWrapper) -> bool:
    """Whether a tool has replaced ``cursor`` on ``connection`` itself (django-debug-
    toolbar, ddtrace, ``SimpleTestCase``'s guard); not when what it put back is the
    connection's own method (as ``SimpleTestCase`` does after its tests)."""
    found = connection.__dict__.get("cursor")
    if found is None:
        return False
    # a bound method of the connection's own class, not a proxy that hands its
    # attributes on (wrapt's, as ddtrace wraps it)
    return not (
        type(found) is MethodType
        and found.__self__ is connection
        and found.__func__ is type(connection).cursor
    )


def _djangos_wrapper() -> bool:
    """Whether ``CursorWrapper.execute`` is Django's own (no APM replaced it)."""
    execute = CursorWrapper.execute
    if _WRAPPER_SEEN[0] is not execute:
        code = getattr(execute, "__code__", None)
        _WRAPPER_SEEN[:] = [
            execute,
            # a plain function: a proxy (wrapt's FunctionWrapper, as APMs patch) hands
            # on the ``__code__`` of the function it wraps
            type(execute) is FunctionType
            and code is not None
            and code.co_name == "execute"
            and code.co_filename.replace("\\", "/").endswith("django/db/backends/utils.py"),
        ]
    return bool(_WRAPPER_SEEN[1])


def plan_changed(exc: BaseException) -> bool:
    """Whether ``exc`` is PostgreSQL refusing a prepared statement whose result type a
    schema change altered (a migration in another session widened a column it returns):
    the session's statement fails so on every run until the session ends."""
    cause = exc.__cause__
    return (
        is_psycopg3
        and isinstance(cause, psycopg.errors.FeatureNotSupported)
        and "cached plan must not change result type" in str(cause)
    )


def replaceable(connection: BaseDatabaseWrapper) -> bool:
    """Whether ``connection`` can be closed and opened again for the store's statement:
    in autocommit, outside any transaction (nothing of the caller's is lost)."""
    return not connection.in_atomic_block and connection.get_autocommit()


def end_session(connection: BaseDatabaseWrapper) -> None:
    """Close ``connection`` and its session, which a pool (``OPTIONS["pool"]``) then
    drops instead of handing out again with its stale statements."""
    if connection.connection is not None:
        connection.connection.close()
    connection.close()
