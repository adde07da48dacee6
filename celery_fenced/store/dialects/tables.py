"""The names the dialects' statements use: tables, result columns, SQL literals."""

from __future__ import annotations

import functools

from django.apps import apps
from django.db.models import Model

from celery_fenced.models import Completion, Lease, LeaseEvent, PendingJob
from celery_fenced.store.types import RESULT_COLUMNS

LEASE = Lease._meta.db_table
EVENT = LeaseEvent._meta.db_table
COMPLETION = Completion._meta.db_table
PENDING = PendingJob._meta.db_table

#: the same columns as SQL text (the statements are built from fixed text only), and what
#: a write over an existing row changes: what ``DatabaseBackend`` writes, not the row's
#: creation or start time
SQL_RESULT_COLUMNS = (
    "task_id, periodic_task_name, task_name, task_args, task_kwargs, status, worker, "
    "content_type, content_encoding, result, date_created, date_started, date_done, "
    "traceback, meta"
)
SQL_RESULT_UPDATE = (
    "periodic_task_name = EXCLUDED.periodic_task_name, task_name = EXCLUDED.task_name, "
    "task_args = EXCLUDED.task_args, task_kwargs = EXCLUDED.task_kwargs, "
    "status = EXCLUDED.status, worker = EXCLUDED.worker, "
    "content_type = EXCLUDED.content_type, content_encoding = EXCLUDED.content_encoding, "
    "result = EXCLUDED.result, date_done = EXCLUDED.date_done, "
    "traceback = EXCLUDED.traceback, meta = EXCLUDED.meta"
)


def task_result_model() -> type[Model]:
    """django-celery-results' ``TaskResult``, looked up when a statement needs it: the store
    imports without that app installed, so the system check can name it (E004)."""
    return apps.get_model("django_celery_results", "TaskResult")


@functools.cache
def result_row_known() -> bool:
    """Whether the installed ``TaskResult`` has exactly :data:`RESULT_COLUMNS`, by name:
    another version of the model (a column added or renamed) is written the general way."""
    fields = [f for f in task_result_model()._meta.concrete_fields if not f.primary_key]
    columns = [f.column for f in fields]
    return columns == [f.name for f in fields] and sorted(map(str, columns)) == sorted(
        RESULT_COLUMNS
    )


#: the event kinds and reclaim states the SQL dialects write, as SQL literals: written out
#: (the SQL checker of tests/acceptance/test_security.py accepts only fixed text), and checked
#: against the model's enums by tests/unit/test_kinds.py
SQL_ACQUIRED = "'acquired'"
SQL_RECLAIMED = "'reclaimed'"
SQL_RELEASED = "'released'"
SQL_BUSY = "'busy'"
SQL_FORCE_RELEASED = "'force_released'"
SQL_ABANDONED = "'abandoned'"
SQL_STATE_RESENT = "'resent'"
SQL_STATE_ABANDONED = "'abandoned'"
