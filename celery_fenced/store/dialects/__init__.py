"""The lease store's SQL: one class per database family (private to the store).

Each implements :class:`~.interface.Dialect`. PostgreSQL does each operation, event
included, in one statement (a data-modifying CTE); SQLite does the state change in one
``INSERT … ON CONFLICT … DO UPDATE … WHERE … RETURNING`` and writes the event in the
same transaction; any other database gets the portable dialect: transactions with row
locks through the ORM; MariaDB and MySQL grant that way too (:mod:`.row_locking`, with
their own row locks and clock) and have their own SQL where one statement does the work
of several. The bookkeeping every database does the same way (pending rows, events, the
reclaimer's claims, permits) is in helpers the classes compose (:mod:`.pending`,
:mod:`.bookkeeping`, :mod:`.permits`).
:data:`VENDORS` maps a Django database vendor to its dialect.
"""

from __future__ import annotations

from collections.abc import Callable

from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper

from celery_fenced.store.dialects.base import DialectBase
from celery_fenced.store.dialects.interface import Dialect, ReleasesWithResult
from celery_fenced.store.dialects.mysql import MySQL
from celery_fenced.store.dialects.orm import ORMDialect
from celery_fenced.store.dialects.postgresql import PostgreSQL
from celery_fenced.store.dialects.sql import SQLDialect
from celery_fenced.store.dialects.sqlite import SQLite
from celery_fenced.store.dialects.tables import EVENT, LEASE

#: Django's ``connection.vendor`` → the dialect of that database family; any other
#: vendor gets :class:`ORMDialect`
VENDORS: dict[str, Callable[[str, BaseDatabaseWrapper | None], Dialect]] = {
    "mysql": MySQL,
    "postgresql": PostgreSQL,
    "sqlite": SQLite,
}


def for_alias(
    alias: str, *, portable: bool = False, connection: BaseDatabaseWrapper | None = None
) -> Dialect:
    """The dialect for database ``alias`` (``portable=True`` forces the ORM dialect).

    ``connection``: a connection to ``alias`` to use instead of Django's.

    A dialect holds no state of its own beyond its alias and connection (Django's is looked
    up at each statement, in the thread that runs it): one is made per alias and class,
    and per kept connection, not per statement of every task.
    """
    if portable:
        return ORMDialect(alias)
    make = _vendor_dialects.get(alias)
    if make is None:
        make = _vendor_dialects[alias] = VENDORS.get(connections[alias].vendor, ORMDialect)
    kept = _made if connection is None else _made_on(connection)
    dialect = kept.get((alias, make))
    if dialect is None:
        dialect = kept[(alias, make)] = make(alias, connection)
    return dialect


#: each alias's dialect class, by its vendor (a database's vendor is its engine's: the
#: same in every thread, for good)
_vendor_dialects: dict[str, Callable[[str, BaseDatabaseWrapper | None], Dialect]] = {}
#: the dialects made for Django's connections, by alias and class
_made: dict[tuple[str, object], Dialect] = {}
#: where the dialects made for one kept connection are kept, on that connection
_ON_CONNECTION = "_celery_fenced_dialects"


def _made_on(connection: BaseDatabaseWrapper) -> dict[tuple[str, object], Dialect]:
    """The dialects made for ``connection``: they go with it."""
    kept: dict[tuple[str, object], Dialect] | None = getattr(connection, _ON_CONNECTION, None)
    if kept is None:
        kept = {}
        setattr(connection, _ON_CONNECTION, kept)
    return kept


def releasing_with_result(
    alias: str, *, connection: BaseDatabaseWrapper | None = None
) -> ReleasesWithResult | None:
    """The dialect of ``alias`` if it writes a success's result row in the releasing
    statement (PostgreSQL); None where the result is written apart."""
    dialect = for_alias(alias, connection=connection)
    return dialect if isinstance(dialect, PostgreSQL) else None


__all__ = [
    "EVENT",
    "LEASE",
    "VENDORS",
    "Dialect",
    "DialectBase",
    "MySQL",
    "ORMDialect",
    "PostgreSQL",
    "ReleasesWithResult",
    "SQLDialect",
    "SQLite",
    "for_alias",
    "releasing_with_result",
]
