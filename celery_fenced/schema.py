"""The lease tables must exist: a missing migration is named as such, not as a driver error."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from django.db import DatabaseError, connections

from celery_fenced.exceptions import FencedConfigurationError
from celery_fenced.models import Lease, LeaseEvent

TABLES = (Lease._meta.db_table, LeaseEvent._meta.db_table)


def _names_missing_table(error: DatabaseError) -> str | None:
    text = str(error)
    for table in TABLES:
        # SQLite: "no such table: t"; PostgreSQL: 'relation "t" does not exist'
        if f"no such table: {table}" in text or f'relation "{table}" does not exist' in text:
            return table
    return None


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
        table = _names_missing_table(error)
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
