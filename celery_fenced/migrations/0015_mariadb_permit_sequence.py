"""MariaDB: the sequence of permit tokens (PostgreSQL's since 0007).

A free permit's grant on MariaDB is one statement that locks only the permit it takes
(``FOR UPDATE SKIP LOCKED``) and numbers it the key's floor (its head's token) plus the
next value of this sequence, as on PostgreSQL: acquirers of one key's permits share no
row. A sequence never hands out a value twice, restarts included (MariaDB keeps the next
uncached value on disk), and it starts above every token already issued: a permit's token
is then above every earlier token of its key, whatever its floor — after a database whose
permits were numbered by the transaction, and after this migration was reversed and
applied again (which drops and makes the sequence). MySQL 8 has no sequences; its permits
keep the transaction that locks the key's head.
"""

from typing import Any

from django.db import migrations

SEQUENCE = "celery_fenced_permit_token"


def _mariadb(schema_editor: Any) -> bool:
    connection = schema_editor.connection
    return connection.vendor == "mysql" and bool(getattr(connection, "mysql_is_mariadb", False))


def create_sequence(apps: Any, schema_editor: Any) -> None:
    if _mariadb(schema_editor):
        with schema_editor.connection.cursor() as cursor:
            cursor.execute("SELECT COALESCE(MAX(token), 0) + 1 FROM celery_fenced_lease")
            start = int(cursor.fetchone()[0])
        schema_editor.execute(f"CREATE SEQUENCE IF NOT EXISTS {SEQUENCE} START WITH {start}")


def drop_sequence(apps: Any, schema_editor: Any) -> None:
    if _mariadb(schema_editor):
        schema_editor.execute(f"DROP SEQUENCE IF EXISTS {SEQUENCE}")


class Migration(migrations.Migration):
    atomic = False  # the MySQL family's DDL is not transactional

    dependencies = [
        ("celery_fenced", "0014_mysql_beat_names"),
    ]

    operations = [
        migrations.RunPython(create_sequence, drop_sequence),
    ]
