"""PostgreSQL: the unique index of one permit per job, its predicate spelled anew.

The statements that find a lease row by its key or job say "unreleased" as
``(released_at IS NULL) IS TRUE``, which keeps the planner from scanning the partial
index of unreleased rows (``celery_fenced_lease_unreleased``) for them: a prepared
statement's generic plan, made while few leases were held, would otherwise scan it,
slower with every grant. The permit grant's check that a job holds no other permit must
still read this index, so its predicate says it the same way. The same rows, the same
uniqueness.
"""

from typing import Any

from django.db import migrations

INDEX = "celery_fenced_lease_one_permit_per_job"
TABLE = "celery_fenced_lease"


def _recreate(schema_editor: Any, unreleased: str) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute(f"DROP INDEX IF EXISTS {INDEX}")
    schema_editor.execute(
        f"CREATE UNIQUE INDEX {INDEX} ON {TABLE} (permit_job)"
        f" WHERE permit_job IS NOT NULL AND {unreleased}"
    )


def spell_anew(apps: Any, schema_editor: Any) -> None:
    _recreate(schema_editor, "(released_at IS NULL) IS TRUE")


def spell_as_before(apps: Any, schema_editor: Any) -> None:
    _recreate(schema_editor, "released_at IS NULL")


class Migration(migrations.Migration):
    dependencies = [
        ("celery_fenced", "0017_mysql_result_locks"),
    ]

    operations = [
        migrations.RunPython(spell_anew, spell_as_before),
    ]
