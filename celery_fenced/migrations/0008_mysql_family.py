"""The MySQL family (MariaDB, MySQL): keys compared byte for byte, one job per permit.

MariaDB and MySQL ignore a condition on an index or a unique constraint (Django's
warnings ``models.W036``/``W037`` at every ``migrate``), and their default collations
compare ``'Key'`` equal to ``'key'`` and ``'pad'`` to ``'pad '``. So the conditional
index and constraints leave the models' state here — PostgreSQL and SQLite keep them,
made by migrations 0002 and 0007 — and on the MySQL family the key columns get a binary
NO PAD collation (MariaDB's ``utf8mb4_nopad_bin``, MySQL 8's ``utf8mb4_0900_bin``), and "one job holds one permit of a key" a unique index on a generated column
(the job's digest while the permit is unreleased, else NULL: NULLs never collide).
"""

from typing import Any

from django.db import migrations

from celery_fenced.collations import binary_collation

LEASE = "celery_fenced_lease"
PENDING = "celery_fenced_pendingjob"
#: (table, column, length, nullable) of every column holding a lease key
KEY_COLUMNS = (
    (LEASE, "key", 263, False),
    (PENDING, "key", 255, False),
    (PENDING, "unique_key", 255, True),
)


def mysql_family(apps: Any, schema_editor: Any) -> None:
    connection = schema_editor.connection
    if connection.vendor != "mysql":
        return
    quote = schema_editor.quote_name
    collation = binary_collation(connection)
    for table, column, length, nullable in KEY_COLUMNS:
        schema_editor.execute(
            f"ALTER TABLE {quote(table)} MODIFY {quote(column)} varchar({length}) "
            f"CHARACTER SET utf8mb4 COLLATE {collation} {'NULL' if nullable else 'NOT NULL'}"
        )
    schema_editor.execute(
        f"ALTER TABLE {quote(LEASE)} ADD COLUMN permit_job_unreleased varchar(32) "
        "AS (CASE WHEN released_at IS NULL THEN permit_job END) VIRTUAL, "
        "ADD UNIQUE INDEX celery_fenced_lease_one_permit_per_job (permit_job_unreleased)"
    )


def mysql_family_undone(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor != "mysql":
        return
    quote = schema_editor.quote_name
    schema_editor.execute(
        f"ALTER TABLE {quote(LEASE)} DROP INDEX celery_fenced_lease_one_permit_per_job, "
        "DROP COLUMN permit_job_unreleased"
    )


class Migration(migrations.Migration):
    atomic = False  # the MySQL family's DDL is not transactional

    dependencies = [
        ("celery_fenced", "0007_permits"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.RemoveConstraint(
                    model_name="lease", name="celery_fenced_lease_one_permit_per_job"
                ),
                migrations.RemoveIndex(model_name="lease", name="celery_fenced_lease_reclaim"),
                migrations.RemoveIndex(model_name="lease", name="celery_fenced_lease_unreleased"),
            ],
        ),
        migrations.RunPython(mysql_family, mysql_family_undone),
    ]
