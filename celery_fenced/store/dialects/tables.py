"""The names the dialects' statements use: tables and the result model."""

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
