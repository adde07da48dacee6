"""PostgreSQL: the permits' sequence above every token already issued.

A permit's token is its key's floor plus the sequence's next value (0007). Reversing 0007
drops the sequence and applying it again makes a new one starting at 1: a later permit
of a key could then be numbered below one of its earlier permits. Applied after it, this
moves the sequence past every token issued, so no token comes again (MariaDB's sequence
starts there when it is made: 0015).
"""

from typing import Any

from django.db import migrations

SEQUENCE = "celery_fenced_permit_token"


def above_every_token(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(
            f"SELECT setval('{SEQUENCE}', GREATEST("
            f"(SELECT last_value FROM {SEQUENCE}), "
            "(SELECT COALESCE(MAX(token), 0) + 1 FROM celery_fenced_lease)))"
        )


class Migration(migrations.Migration):
    dependencies = [
        ("celery_fenced", "0015_mariadb_permit_sequence"),
    ]

    operations = [
        migrations.RunPython(above_every_token, migrations.RunPython.noop),
    ]
