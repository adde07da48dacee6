"""The migrations' step that gives columns the binary NO PAD collation (MySQL family).

A module of the migrations package (its name starts with ``_``: Django's loader passes
it over) because it runs DDL assembled from the database's own description of the
columns, as only a migration may; the package's other code executes fixed SQL text.
"""

from __future__ import annotations

from typing import Any

from celery_fenced.collations import binary_collation, binary_sql, columns


def make_binary(schema_editor: Any, names: tuple[tuple[str, str], ...]) -> None:
    """Give the columns ``names`` the binary NO PAD collation (a migration's step; nothing
    outside the MySQL family)."""
    connection = schema_editor.connection
    if connection.vendor != "mysql":
        return
    for column in columns(connection, names):
        if column.collation != binary_collation(connection):
            schema_editor.execute(binary_sql(connection, column))
