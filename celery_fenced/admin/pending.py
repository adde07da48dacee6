"""The outbox's pending jobs: published, not yet started by any worker (read-only).

Times as the lease pages show them: in UTC, to the millisecond on a job's page, compact
in the list (by the database's clock), the whole time in the tooltip.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.contrib import admin
from django.db.models import QuerySet
from django.db.models.functions import Now
from django.http import HttpRequest
from django.utils.html import format_html
from django.utils.safestring import SafeString

from celery_fenced import store
from celery_fenced.admin import jobs
from celery_fenced.admin.display import CHANGE_LIST, compact_when, short_id, short_key, when
from celery_fenced.admin.filters import ExactFirstSearchMixin, FastListMixin, ReadOnlyMixin
from celery_fenced.models import PendingJob

if TYPE_CHECKING:
    PendingModelAdmin = admin.ModelAdmin[PendingJob]
else:
    PendingModelAdmin = admin.ModelAdmin

#: the characters of a job's call the list shows (the whole call in its tooltip)
CALL_SHOWN = 40

#: the job page's field groups: (title, fields)
FIELD_GROUPS: tuple[tuple[str | None, tuple[str, ...]], ...] = (
    (None, ("task_id", "task_name", "key", "job_call", "plain")),
    (
        "Times (UTC, the database's clock)",
        ("published", "eta_at", "expires", "resend", "abandoned", "abandoned_reason"),
    ),
    ("Sending", ("sends", "unsent", "unique_key", "unique_until", "started_token", "job")),
)


@admin.register(PendingJob)
class PendingJobAdmin(ExactFirstSearchMixin, ReadOnlyMixin, FastListMixin, PendingModelAdmin):
    list_display = (
        "task_column",
        "job_column",
        "key_column",
        "published_column",
        "eta_column",
        "resend_column",
        "sends",
        "unsent",
        "plain",
        "abandoned_column",
        "unique_until",
        "started_token",
    )
    change_list_template = CHANGE_LIST
    list_filter = ("task_name", "unsent", "plain", "unique_until")
    search_fields = ("=task_id", "key")
    exact_search_fields = ("task_id", "key")
    ordering = ("published_at", "id")
    sortable_by = ("published_column", "resend_column")
    fieldsets = tuple((title, {"fields": names}) for title, names in FIELD_GROUPS)
    readonly_fields = tuple(name for _, names in FIELD_GROUPS for name in names)

    def get_queryset(self, request: HttpRequest) -> QuerySet[PendingJob]:
        pending = super().get_queryset(request).using(store.database_alias())
        return pending.annotate(db_now=Now())

    # -- the list ----------------------------------------------------------------------
    @admin.display(description="task id", ordering="task_id")
    def task_column(self, pending: PendingJob) -> SafeString | str:
        return short_id(pending.task_id)

    @admin.display(description="job")
    def job_column(self, pending: PendingJob) -> SafeString | str:
        """The task and its arguments (``send(2024, 7)``), the whole call in the tooltip."""
        summary = jobs.from_job(pending.job, jobs.FROM_OUTBOX)
        if summary is None:
            return pending.task_name
        return format_html(
            '<span title="{}">{}</span>', summary.call, summary.short_call(CALL_SHOWN)
        )

    @admin.display(description="key")
    def key_column(self, pending: PendingJob) -> SafeString | str:
        return short_key(pending.key) if pending.key else "—"

    @admin.display(description="published (UTC)", ordering="published_at")
    def published_column(self, pending: PendingJob) -> SafeString | str:
        return compact_when(pending.published_at, getattr(pending, "db_now"))  # noqa: B009

    @admin.display(description="eta")
    def eta_column(self, pending: PendingJob) -> SafeString | str:
        return compact_when(pending.eta, getattr(pending, "db_now"))  # noqa: B009

    @admin.display(description="sent again at", ordering="resend_at")
    def resend_column(self, pending: PendingJob) -> SafeString | str:
        return compact_when(pending.resend_at, getattr(pending, "db_now"))  # noqa: B009

    @admin.display(description="abandoned")
    def abandoned_column(self, pending: PendingJob) -> SafeString | str:
        if pending.abandoned_at is None:
            return "—"
        shown = compact_when(pending.abandoned_at, getattr(pending, "db_now"))  # noqa: B009
        return format_html("{} {}", shown, pending.abandoned_reason)

    # -- a job's page ------------------------------------------------------------------
    @admin.display(description="job")
    def job_call(self, pending: PendingJob) -> str:
        summary = jobs.from_job(pending.job, jobs.FROM_OUTBOX)
        return summary.call if summary is not None else "—"

    @admin.display(description="published at")
    def published(self, pending: PendingJob) -> str:
        return when(pending.published_at)

    @admin.display(description="eta")
    def eta_at(self, pending: PendingJob) -> str:
        return when(pending.eta)

    @admin.display(description="expires at")
    def expires(self, pending: PendingJob) -> str:
        return when(pending.expires_at)

    @admin.display(description="sent again at")
    def resend(self, pending: PendingJob) -> str:
        return when(pending.resend_at)

    @admin.display(description="abandoned at")
    def abandoned(self, pending: PendingJob) -> str:
        return when(pending.abandoned_at)
