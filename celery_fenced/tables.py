"""The lease tables must exist: a missing migration is named as such, not as a driver error."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from django.db import DatabaseError, connections

from celery_fenced.exceptions import FencedConfigurationError
from celery_fenced.models import Lease, LeaseEvent, PendingJob

TABLES = (Lease._meta.db_table, LeaseEvent._meta.db_table, PendingJob._meta.db_table)


#: the driver's code for "no such table": PostgreSQL's SQLSTATE, MySQL's error number
UNDEFINED_TABLE_SQLSTATE = "42P01"
NO_SUCH_TABLE_ERRNO = 1146


def _names_missing_table(alias: str, error: DatabaseError) -> str | None:
    """The lease table ``error`` is about because it does not exist, or None.

    Decided by the driver's error code where it gives one (never by message text, which
    PostgreSQL translates per ``lc_messages``), then by introspection.
    """
    cause = error.__cause__
    sqlstate = getattr(cause, "sqlstate", None) or getattr(cause, "pgcode", None)
    errno = cause.args[0] if cause is not None and cause.args else None
    if sqlstate is not None and sqlstate != UNDEFINED_TABLE_SQLSTATE:
        return None
    if sqlstate is None and isinstance(errno, int) and errno != NO_SUCH_TABLE_ERRNO:
        return None
    connection = connections[alias]
    if sqlstate is not None and connection.in_atomic_block:
        return TABLES[0]  # the transaction is aborted: no introspection until it ends
    try:
        with connection.cursor() as cursor:
            present = set(connection.introspection.table_names(cursor))
    except DatabaseError:
        return TABLES[0] if sqlstate is not None else None
    return next((table for table in TABLES if table not in present), None)


def missing_tables_error(alias: str, table: str) -> FencedConfigurationError:
    return FencedConfigurationError(
        f"the table {table} of celery_fenced does not exist in database {alias!r}: "
        f"run `python manage.py migrate celery_fenced --database {alias}`"
    )


@contextmanager
def tables_required(alias: str) -> Iterator[None]:
    """Translate "no such table" from the lease tables into :class:`FencedConfigurationError`."""
    try:
        yield
    except DatabaseError as error:
        table = _names_missing_table(alias, error)
        if table is None:
            raise
        raise missing_tables_error(alias, table) from error


def check_tables(alias: str) -> None:
    """Raise :class:`FencedConfigurationError` unless both lease tables exist in ``alias``."""
    connection = connections[alias]
    with connection.cursor() as cursor:
        present = set(connection.introspection.table_names(cursor))
    for table in TABLES:
        if table not in present:
            raise missing_tables_error(alias, table)
