"""The lease store's SQL: one implementation per database family.

This is the only module that knows SQL dialects. Every expiry decision is made inside a
statement with the database's own clock; no worker clock is ever compared with
``expires_at``. PostgreSQL does each operation, event included, in one statement (a
data-modifying CTE); SQLite does the state change in one ``INSERT … ON CONFLICT … DO
UPDATE … WHERE … RETURNING`` and writes the event in the same transaction; any other
database gets a transactional fallback through the ORM with row locks.
"""

from __future__ import annotations

from django.db import connections

from celery_fenced.dialects.portable import Dialect
from celery_fenced.dialects.postgresql import PostgreSQL
from celery_fenced.dialects.records import (
    EVENT,
    LEASE,
    Claim,
    Completed,
    Delivery,
    Grant,
    Holder,
    Renewal,
)
from celery_fenced.dialects.sql import SQLDialect
from celery_fenced.dialects.sqlite import SQLite


def for_alias(alias: str, *, portable: bool = False) -> Dialect:
    """The dialect for database ``alias`` (``portable=True`` forces the ORM fallback)."""
    vendor = connections[alias].vendor
    if portable:
        return Dialect(alias)
    if vendor == "postgresql":
        return PostgreSQL(alias)
    if vendor == "sqlite":
        return SQLite(alias)
    return Dialect(alias)


__all__ = [
    "EVENT",
    "LEASE",
    "Claim",
    "Completed",
    "Delivery",
    "Dialect",
    "Grant",
    "Holder",
    "PostgreSQL",
    "Renewal",
    "SQLDialect",
    "SQLite",
    "for_alias",
]
