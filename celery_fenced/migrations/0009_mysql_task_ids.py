"""The MySQL family (MariaDB, MySQL): task ids compared byte for byte, as lease keys are.

With the default collations, ``'Job-1'`` and ``'job-1'`` (or ``'t'`` and ``'t '``, ``'é'``
and ``'e'``) were one task id in the package's tables: the second job's publish replaced
the first's pending row — the outbox would then send the one job again under the other's
task id — its grant ended the other's pending row, and a report of one task ended or
waited for the other's grant. PostgreSQL and SQLite compare them exactly already; here
the columns get the binary NO PAD collation of 0008's keys.
"""

from typing import Any

from django.db import migrations

from celery_fenced.collations import binary_collation

#: (table, column) of every column of the package's holding a task id (all varchar(255)
#: NOT NULL)
TASK_ID_COLUMNS = (
    ("celery_fenced_lease", "task_id"),
    ("celery_fenced_pendingjob", "task_id"),
    ("celery_fenced_leaseevent", "task_id"),
)


def binary_task_ids(apps: Any, schema_editor: Any) -> None:
    connection = schema_editor.connection
    if connection.vendor != "mysql":
        return
    quote = schema_editor.quote_name
    collation = binary_collation(connection)
    for table, column in TASK_ID_COLUMNS:
        schema_editor.execute(
            f"ALTER TABLE {quote(table)} MODIFY {quote(column)} varchar(255) "
            f"CHARACTER SET utf8mb4 COLLATE {collation} NOT NULL"
        )


class Migration(migrations.Migration):
    atomic = False  # the MySQL family's DDL is not transactional

    dependencies = [
        ("celery_fenced", "0008_mysql_family"),
    ]

    operations = [
        # backwards the columns keep the binary collation (as 0008's keys do): distinct task
        # ids stay distinct
        migrations.RunPython(binary_task_ids, migrations.RunPython.noop),
    ]
