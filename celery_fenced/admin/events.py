"""The event list: the audit trail of every key, newest first."""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.contrib import admin
from django.contrib.admin.utils import quote
from django.db.models import QuerySet
from django.db.models.functions import Now
from django.http import HttpRequest
from django.urls import reverse
from django.utils.html import format_html
from django.utils.safestring import SafeString

from celery_fenced import kinds, store
from celery_fenced.admin.display import (
    CHANGE_LIST,
    badge,
    compact_when,
    short_id,
    short_key,
    short_owner,
)
from celery_fenced.admin.filters import ExactFirstSearchMixin, FastListMixin, ReadOnlyMixin
from celery_fenced.models import Lease, LeaseEvent

if TYPE_CHECKING:
    LeaseModelAdmin = admin.ModelAdmin[Lease]
    EventModelAdmin = admin.ModelAdmin[LeaseEvent]
else:
    LeaseModelAdmin = EventModelAdmin = admin.ModelAdmin


@admin.register(LeaseEvent)
class LeaseEventAdmin(ExactFirstSearchMixin, ReadOnlyMixin, FastListMixin, EventModelAdmin):
    list_display = (
        "at_utc",
        "kind_badge",
        "lease_link",
        "token",
        "owner_column",
        "task",
        "detail",
    )
    change_list_template = CHANGE_LIST
    list_filter = ("kind",)
    search_fields = ("lease__key", "=task_id")
    exact_search_fields = ("lease__key", "task_id")
    list_select_related = ("lease",)
    ordering = ("-at", "-id")
    sortable_by = ("at_utc",)

    def get_queryset(self, request: HttpRequest) -> QuerySet[LeaseEvent]:
        events = super().get_queryset(request).using(store.database_alias())
        return events.annotate(db_now=Now())

    @admin.display(description="at (UTC)", ordering="at")
    def at_utc(self, event: LeaseEvent) -> SafeString | str:
        return compact_when(event.at, getattr(event, "db_now"))  # noqa: B009

    @admin.display(description="owner")
    def owner_column(self, event: LeaseEvent) -> SafeString | str:
        return short_owner(event.owner)

    @admin.display(description="task id")
    def task(self, event: LeaseEvent) -> SafeString | str:
        return short_id(event.task_id) if event.task_id else "—"

    @admin.display(description="kind", ordering="kind")
    def kind_badge(self, event: LeaseEvent) -> SafeString:
        return badge(event.kind, kinds.colour(event.kind))

    @admin.display(description="lease")
    def lease_link(self, event: LeaseEvent) -> SafeString:
        url = reverse(
            f"{self.admin_site.name}:celery_fenced_lease_change", args=[quote(event.lease_id)]
        )
        return format_html('<a href="{}">{}</a>', url, short_key(event.lease.key))
