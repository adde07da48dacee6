"""The MySQL family: the table of result locks.

A fenced result write and an untokened one take the task id's result lock for their
transaction (PostgreSQL: an advisory lock on a 64-bit hash of the task id). Here the lock
is a row of this table, locked by ``INSERT … ON DUPLICATE KEY UPDATE`` on its primary key
(one of 65,536 buckets of the task id's CRC-32): a record lock only, made the first time
and then kept. The lock was the task's result row, made and deleted again when missing;
InnoDB's duplicate checks lock the gap beside a deleted record, and three takers of a new
task id could deadlock (error 1213).
"""

from typing import Any

from django.db import migrations

TABLE = "celery_fenced_result_lock"


def create_table(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "mysql":
        schema_editor.execute(
            f"CREATE TABLE IF NOT EXISTS {TABLE} (bucket INT UNSIGNED NOT NULL PRIMARY KEY)"
            " ENGINE=InnoDB"
        )


def drop_table(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "mysql":
        schema_editor.execute(f"DROP TABLE IF EXISTS {TABLE}")


class Migration(migrations.Migration):
    atomic = False  # the MySQL family's DDL is not transactional

    dependencies = [
        ("celery_fenced", "0016_postgresql_permit_sequence_floor"),
    ]

    operations = [
        migrations.RunPython(create_table, drop_table),
    ]
