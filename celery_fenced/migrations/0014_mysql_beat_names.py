"""The MySQL family (MariaDB, MySQL): beat keys and entry names compared byte for byte.

0013 made :class:`~celery_fenced.models.BeatEntry` with the server's collation: entries
``Report`` and ``report`` (or ``t`` and ``t ``) were one row — one's ticks counted as the
other's, so a leader found its entry moved and the other entry's tick was not sent —
and two beat keys that differ only in case, two leases apart, shared their entries.
Here ``beat_key``, ``name`` and ``task_id`` get the binary NO PAD collation of 0008 and
0009, their length, nullability and unique index kept.
"""

from typing import Any

from django.db import migrations

from celery_fenced.migrations._binary import make_binary

#: (table, column) of BeatEntry's text columns that name something
BEAT_COLUMNS = (
    ("celery_fenced_beatentry", "beat_key"),
    ("celery_fenced_beatentry", "name"),
    ("celery_fenced_beatentry", "task_id"),
)


def binary_beat_names(apps: Any, schema_editor: Any) -> None:
    make_binary(schema_editor, BEAT_COLUMNS)


class Migration(migrations.Migration):
    atomic = False  # the MySQL family's DDL is not transactional

    dependencies = [
        ("celery_fenced", "0013_beat_entries"),
    ]

    operations = [
        # backwards the columns keep the binary collation (as 0008's keys do): distinct
        # names stay distinct
        migrations.RunPython(binary_beat_names, migrations.RunPython.noop),
    ]
