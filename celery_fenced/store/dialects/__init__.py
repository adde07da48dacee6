"""The lease store's SQL: one implementation per database family (private to the store).

PostgreSQL does each operation, event included, in one statement (a data-modifying CTE);
SQLite does the state change in one ``INSERT … ON CONFLICT … DO UPDATE … WHERE …
RETURNING`` and writes the event in the same transaction; MariaDB and MySQL take the
portable dialect with their own SQL where one statement does the work of several; any
other database gets the portable dialect: transactions with row locks through the ORM.
:data:`VENDORS` maps a Django database vendor to its dialect.
"""

from __future__ import annotations

from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper

from celery_fenced.store.dialects.base import Dialect
from celery_fenced.store.dialects.mysql import MySQL
from celery_fenced.store.dialects.orm import ORMDialect
from celery_fenced.store.dialects.postgresql import PostgreSQL
from celery_fenced.store.dialects.records import (
    EVENT,
    LEASE,
    Claim,
    Completed,
    Delivery,
    Ending,
    Grant,
    GrantRequest,
    Holder,
    Renewal,
)
from celery_fenced.store.dialects.shared import PortableOperations
from celery_fenced.store.dialects.sql import SQLDialect
from celery_fenced.store.dialects.sqlite import SQLite

#: Django's ``connection.vendor`` → the dialect of that database family; any other
#: vendor gets :class:`ORMDialect`
VENDORS: dict[str, type[Dialect]] = {"mysql": MySQL, "postgresql": PostgreSQL, "sqlite": SQLite}


def for_alias(
    alias: str, *, portable: bool = False, connection: BaseDatabaseWrapper | None = None
) -> Dialect:
    """The dialect for database ``alias`` (``portable=True`` forces the ORM dialect).

    ``connection``: a connection to ``alias`` to use instead of Django's.
    """
    if portable:
        return ORMDialect(alias)
    return VENDORS.get(connections[alias].vendor, ORMDialect)(alias, connection)


__all__ = [
    "EVENT",
    "LEASE",
    "VENDORS",
    "Claim",
    "Completed",
    "Delivery",
    "Dialect",
    "Ending",
    "Grant",
    "GrantRequest",
    "Holder",
    "MySQL",
    "ORMDialect",
    "PortableOperations",
    "PostgreSQL",
    "Renewal",
    "SQLDialect",
    "SQLite",
    "for_alias",
]
