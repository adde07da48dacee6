"""The lease pages: the list, a lease with its timeline and history, force release."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

from django.apps import apps
from django.contrib import admin
from django.contrib.admin.utils import quote
from django.contrib.admin.views.main import ChangeList
from django.core.paginator import Paginator
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.urls import NoReverseMatch, reverse
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from celery_fenced import kinds, operations, paging, permits, store, timeline
from celery_fenced.admin import jobs
from celery_fenced.admin.display import (
    CHANGE_LIST,
    STATE_COLOURS,
    badge,
    compact_when,
    detail_json,
    key_head,
    short_id,
    short_key,
    short_owner,
    task_id_head,
    when,
)
from celery_fenced.admin.filters import (
    ExactFirstSearchMixin,
    FastListMixin,
    ReadOnlyMixin,
    StateFilter,
    TaskNameFilter,
)
from celery_fenced.admin.force_release import ForceReleaseMixin
from celery_fenced.models import Lease, LeaseEvent

if TYPE_CHECKING:
    LeaseModelAdmin = admin.ModelAdmin[Lease]
    EventModelAdmin = admin.ModelAdmin[LeaseEvent]
else:
    LeaseModelAdmin = EventModelAdmin = admin.ModelAdmin


EVENTS_PER_PAGE = 50


#: the lease page's field groups: (title, fields)
FIELD_GROUPS: tuple[tuple[str | None, tuple[str, ...]], ...] = (
    (None, ("lease_key", "state_badge", "token", "owner", "reclaimed_from", "permit_list")),
    ("Task", ("task_name", "task_link", "job_call")),
    (
        "Times (UTC, the database's clock)",
        ("acquired", "last_renewed", "expires", "expires_in", "released", "release_state"),
    ),
    ("Reclaim", ("reclaim_state", "reclaim_attempts", "reclaim_claimed", "reclaim_job")),
)

#: the spaces inside a duration (``9m 59s``)
DURATION_SPACE = re.compile(r"(?<=[0-9][a-z]) (?=[0-9])")
#: the characters of a job's call a list column shows (the whole call in its tooltip)
CALL_SHOWN = 36


class LeaseChangeList(ChangeList):
    """The lease list, each row's job looked up for the whole page at once."""

    def get_results(self, request: HttpRequest) -> None:
        super().get_results(request)
        jobs.attach(list(self.result_list))


@admin.register(Lease)
class LeaseAdmin(
    ExactFirstSearchMixin, ReadOnlyMixin, FastListMixin, ForceReleaseMixin, LeaseModelAdmin
):
    list_display = (
        "key_column",
        "token",
        "state_badge",
        "owner_column",
        "job_column",
        "task_link",
        "expires_in",
        "acquired_column",
    )
    list_filter = (StateFilter, TaskNameFilter)
    search_fields = ("key", "owner", "=task_id")
    exact_search_fields = ("key", "task_id")
    date_hierarchy = "acquired_at"
    ordering = ("-acquired_at",)
    # only the columns an index can sort
    sortable_by = ("key_column", "job_column", "expires_in", "acquired_column")
    actions = ("force_release_selected",)
    change_form_template = "admin/celery_fenced/lease/change_form.html"
    change_list_template = CHANGE_LIST
    fieldsets = tuple((title, {"fields": names}) for title, names in FIELD_GROUPS)
    # every field shown is read-only: the admin changes nothing but by force release
    readonly_fields = tuple(name for _, names in FIELD_GROUPS for name in names)

    def get_queryset(self, request: HttpRequest) -> QuerySet[Lease]:
        leases = paging.DrillDownQuerySet(self.model, using=store.database_alias())
        ordering = self.get_ordering(request)
        return operations.with_state(leases.order_by(*ordering) if ordering else leases)

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return LeaseChangeList

    # -- columns -----------------------------------------------------------------------
    @admin.display(description="key")
    def lease_key(self, lease: Lease) -> str:
        """The key; a permit's as ``key (permit 2)``, a key's own row with its permits."""
        if lease.permits:
            return f"{lease.key} ({lease.permits} permits)"
        return permits.describe(lease.key)

    @admin.display(description="key", ordering="key")
    def key_column(self, lease: Lease) -> SafeString | str:
        """:meth:`lease_key` with the key shortened (a default key is 60 characters), the
        whole key in the tooltip."""
        key, index = permits.split(lease.key)
        whole = self.lease_key(lease)
        if lease.permits:
            return short_key(whole, f"{key_head(lease.key)} ({lease.permits} permits)")
        if index is not None:
            return short_key(whole, f"{key_head(key)} (permit {index})")
        return short_key(whole)

    @admin.display(description="owner", ordering="owner")
    def owner_column(self, lease: Lease) -> SafeString | str:
        return short_owner(lease.owner)

    @admin.display(description="job", ordering="task_name")
    def job_column(self, lease: Lease) -> SafeString | str:
        """The task and its arguments (``send(2024, 7)``), the whole call in the tooltip;
        the task name alone when its arguments are not kept."""
        summary = jobs.of(lease)
        if summary is not None:
            return format_html(
                '<span title="{} ({})">{}</span>',
                summary.call,
                summary.source,
                summary.short_call(CALL_SHOWN),
            )
        if not lease.task_name:
            return "—"
        return format_html(
            '<span title="{} (arguments not kept)">{}</span>',
            lease.task_name,
            jobs.cut(lease.task_name.rsplit(".", 1)[-1], CALL_SHOWN),
        )

    @admin.display(description="job")
    def job_call(self, lease: Lease) -> str:
        """The task and its arguments, and where they were found."""
        summary = jobs.of(lease)
        if summary is not None:
            return f"{summary.call} ({summary.source})"
        return jobs.NOT_KEPT if lease.task_id else "—"

    @admin.display(description="job to re-send (JSON)")
    def reclaim_job(self, lease: Lease) -> str:
        return lease.job or "—"

    @admin.display(description="permits")
    def permit_list(self, lease: Lease) -> SafeString | str:
        """A key's permits (``lease_limit``): each one's state, token, holder and expiry."""
        rows = operations.permit_rows(lease)
        if not rows:
            return "-"
        return format_html(
            "<ul>{}</ul>",
            format_html_join(
                "",
                "<li>permit {}: {}, token {}, {} ({})</li>",
                (
                    (
                        permits.split(row.key)[1],
                        getattr(row, "state", ""),
                        row.token,
                        row.owner or "-",
                        operations.describe_expiry(operations.expires_in(row)),
                    )
                    for row in rows
                ),
            ),
        )

    @admin.display(description="state")
    def state_badge(self, lease: Lease) -> SafeString:
        state = str(getattr(lease, "state", ""))
        return badge(state, STATE_COLOURS.get(state, "#999"))

    @admin.display(description="expires in", ordering="expires_at")
    def expires_in(self, lease: Lease) -> SafeString:
        """When the grant expires by the database's clock; when it was last renewed (each
        renewal moves the expiry on) in the tooltip."""
        seconds = operations.expires_in(lease)
        return format_html(
            '<span title="expires at {}, last renewed at {} (UTC)">{}</span>',
            when(lease.expires_at),
            when(lease.renewed_at),
            # a duration never wraps inside: ``in 9m 59s`` wraps after ``in`` only
            DURATION_SPACE.sub("\N{NO-BREAK SPACE}", operations.describe_expiry(seconds)),
        )

    @admin.display(description="acquired at", ordering="acquired_at")
    def acquired(self, lease: Lease) -> str:
        return when(lease.acquired_at)

    @admin.display(description="acquired (UTC)", ordering="acquired_at")
    def acquired_column(self, lease: Lease) -> SafeString | str:
        return compact_when(lease.acquired_at, getattr(lease, "db_now"))  # noqa: B009

    @admin.display(description="last renewed")
    def last_renewed(self, lease: Lease) -> str:
        return when(lease.renewed_at)

    @admin.display(description="expires at")
    def expires(self, lease: Lease) -> str:
        return when(lease.expires_at)

    @admin.display(description="released at")
    def released(self, lease: Lease) -> str:
        return when(lease.released_at)

    @admin.display(description="reclaim claimed at")
    def reclaim_claimed(self, lease: Lease) -> str:
        """When the reclaimer last claimed this lease (the same format as the times)."""
        return when(lease.reclaim_claimed_at)

    @admin.display(description="task id")
    def task_link(self, lease: Lease) -> str:
        if not lease.task_id:
            return "—"
        url = self.task_result_url(lease.task_id)
        if url is None:
            return short_id(lease.task_id)
        return format_html(
            '<a href="{}" title="{}">{}</a>', url, lease.task_id, task_id_head(lease.task_id)
        )

    def task_result_url(self, task_id: str) -> str | None:
        """django-celery-results' TaskResult changelist filtered on ``task_id``."""
        if not apps.is_installed("django_celery_results"):
            return None
        try:
            url = reverse(f"{self.admin_site.name}:django_celery_results_taskresult_changelist")
        except NoReverseMatch:
            return None
        return f"{url}?{urlencode({'task_id': task_id})}"

    # -- the lease page ----------------------------------------------------------------
    def render_change_form(
        self,
        request: HttpRequest,
        context: dict[str, Any],
        add: bool = False,
        change: bool = False,
        form_url: str = "",
        obj: Lease | None = None,
    ) -> HttpResponse:
        if obj is not None:
            context.update(self.history_context(request, obj))
        return super().render_change_form(request, context, add, change, form_url, obj)

    def history_context(self, request: HttpRequest, lease: Lease) -> dict[str, Any]:
        """The lease page's event table (one page, newest first) and timeline picture."""
        trail = operations.events(lease)
        page = Paginator(trail, EVENTS_PER_PAGE).get_page(request.GET.get("events_page"))
        params = request.GET.copy()

        def page_url(number: int | str) -> str:
            params["events_page"] = str(number)
            return f"?{params.urlencode()}#events"

        page_links = [
            (number, page_url(number) if isinstance(number, int) else "")
            for number in page.paginator.get_elided_page_range(page.number)
        ]
        recent = list(trail[: timeline.MAX_EVENTS])
        return {
            "events_page": page,
            "event_rows": [
                (e, badge(e.kind, kinds.colour(e.kind)), detail_json(e.detail)) for e in page
            ],
            "events_page_links": page_links,
            "timeline": timeline.picture(lease, recent, getattr(lease, "db_now")),  # noqa: B009
            "timeline_colours": timeline.COLOURS,
            "can_force_release": lease.released_at is None
            and self.has_force_release_permission(request),
            "force_release_url": reverse(
                f"{self.admin_site.name}:celery_fenced_lease_force_release",
                args=[quote(lease.pk)],
            ),
        }
