"""The models' table names the statements write, and whether the result row is the known one."""

from __future__ import annotations

from django_celery_results.models import TaskResult

from celery_fenced.models import Completion, Lease, LeaseEvent, PendingJob
from celery_fenced.store.types import RESULT_COLUMNS

LEASE = Lease._meta.db_table
EVENT = LeaseEvent._meta.db_table
COMPLETION = Completion._meta.db_table
PENDING = PendingJob._meta.db_table
RESULT = TaskResult._meta.db_table


def _result_row_is_known() -> bool:
    """Whether the installed ``TaskResult`` has exactly :data:`RESULT_COLUMNS`, by name."""
    fields = [f for f in TaskResult._meta.concrete_fields if not f.primary_key]
    columns = [f.column for f in fields]
    return columns == [f.name for f in fields] and sorted(map(str, columns)) == sorted(
        RESULT_COLUMNS
    )


#: another version of the model (a column added or renamed) is written the general way
RESULT_ROW_KNOWN = _result_row_is_known()
