"""The outbox's pending jobs: published, not yet started by any worker (read-only)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest

from celery_fenced import operations
from celery_fenced.admin.filters import ExactFirstSearchMixin, FastListMixin, ReadOnlyMixin
from celery_fenced.models import PendingJob

if TYPE_CHECKING:
    PendingModelAdmin = admin.ModelAdmin[PendingJob]
else:
    PendingModelAdmin = admin.ModelAdmin


@admin.register(PendingJob)
class PendingJobAdmin(ExactFirstSearchMixin, ReadOnlyMixin, FastListMixin, PendingModelAdmin):
    list_display = (
        "task_id",
        "task_name",
        "key",
        "published_at",
        "eta",
        "resend_at",
        "sends",
        "unsent",
        "abandoned_at",
        "abandoned_reason",
        "unique_until",
        "started_token",
    )
    list_filter = ("task_name", "unsent", "unique_until")
    search_fields = ("=task_id", "key")
    exact_search_fields = ("task_id", "key")
    ordering = ("published_at", "id")
    readonly_fields = (
        "task_id",
        "task_name",
        "key",
        "job",
        "published_at",
        "eta",
        "expires_at",
        "resend_at",
        "sends",
        "unsent",
        "abandoned_at",
        "abandoned_reason",
        "unique_key",
        "unique_until",
        "started_token",
    )

    def get_queryset(self, request: HttpRequest) -> QuerySet[PendingJob]:
        return super().get_queryset(request).using(operations.database_alias())
