"""The MySQL family (MariaDB, MySQL): result and group ids compared byte for byte too.

django-celery-results' ``task_id`` and ``group_id`` columns kept the server's collation
after 0009: jobs ``Job-1`` and ``job-1`` (or ``t`` and ``t ``) wrote one result row — the
fenced backend's ``INSERT … ON DUPLICATE KEY UPDATE`` put the second's outcome over the
first's, and each read the other's — and two such groups shared one group result and
one chord counter. Here those columns get the binary NO PAD collation of 0008 and 0009,
their length (``DJANGO_CELERY_RESULTS_TASK_ID_MAX_LENGTH`` when they were made),
nullability and unique indexes kept. The migration follows django-celery-results' last
one so its tables exist; a later one that rewrites a column gives it back the table's
collation, which system check ``celery_fenced.E007`` reports.
"""

from typing import Any

from django.db import migrations

from celery_fenced.collations import RESULT_ID_COLUMNS
from celery_fenced.migrations._binary import make_binary


def binary_result_ids(apps: Any, schema_editor: Any) -> None:
    make_binary(schema_editor, RESULT_ID_COLUMNS)


class Migration(migrations.Migration):
    atomic = False  # the MySQL family's DDL is not transactional

    dependencies = [
        ("celery_fenced", "0009_mysql_task_ids"),
        ("django_celery_results", "0014_alter_taskresult_status"),
    ]

    operations = [
        # backwards the columns keep the binary collation (as 0008's and 0009's do): the
        # case-insensitive one would refuse ids that differ only in case, and join them
        migrations.RunPython(binary_result_ids, migrations.RunPython.noop),
    ]
