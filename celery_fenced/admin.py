"""Django admin for leases and their audit trail: read-only, fast on large tables.

Nothing here writes to the lease tables through the ORM: the force-release action and
button call :func:`celery_fenced.operations.force_release` (that is,
:func:`celery_fenced.force_release`), and need the permission
``celery_fenced.force_release_lease``. States are computed by the database's clock.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar
from urllib.parse import urlencode

from django.apps import apps
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.utils import quote, unquote
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.db.models import Q, QuerySet
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import NoReverseMatch, URLPattern, path, reverse
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString, mark_safe

from celery_fenced import kinds, operations, paging, timeline
from celery_fenced.models import Lease, LeaseEvent

if TYPE_CHECKING:
    LeaseModelAdmin = admin.ModelAdmin[Lease]
    EventModelAdmin = admin.ModelAdmin[LeaseEvent]
else:
    LeaseModelAdmin = EventModelAdmin = admin.ModelAdmin

EVENTS_PER_PAGE = 50
BULK_LIMIT = 1000  # leases force-released by one action

STATE_COLOURS = {
    operations.HELD: "#2e7d32",
    operations.EXPIRED: "#ef8f00",
    operations.RELEASED: "#6c7a89",
}


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True) if value else ""


def _first(task_id: str) -> str:
    return task_id if len(task_id) <= 13 else f"{task_id[:8]}…"


def badge(text: str, colour: str) -> SafeString:
    return format_html(
        '<span class="fenced-badge fenced-{}" style="background:{};color:#fff;'
        "padding:1px 8px;border-radius:9px;font-size:11px;font-weight:600;"
        'white-space:nowrap">{}</span>',
        text,
        colour,
        text.replace("_", " "),
    )


#: narrow columns: a short task id, times on one line, the detail wrapped (fits 1366 px)
CHANGE_LIST = "admin/celery_fenced/change_list.html"


def short_id(task_id: str) -> SafeString | str:
    """A task id as its first 8 characters, the whole id in the tooltip (a UUID would
    wrap onto four lines of a changelist column)."""
    if len(task_id) <= 13:
        return task_id
    return format_html('<span title="{}">{}…</span>', task_id, task_id[:8])


def when(value: dt.datetime | None) -> str:
    """A database timestamp to the millisecond, in UTC: lease times are short."""
    if value is None:
        return "—"
    return value.astimezone(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


class StateFilter(admin.SimpleListFilter):
    """Held / expired / released, compared with the database's clock in the query."""

    title = "state"
    parameter_name = "state"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(state, state) for state in operations.STATES]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        if value in operations.STATES:
            return queryset.filter(operations.state_condition(value))
        return queryset


class TaskNameFilter(admin.SimpleListFilter):
    """The task names, found with one index seek each (no DISTINCT over the table)."""

    title = "task name"
    parameter_name = "task_name"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(name, name) for name in operations.task_names()]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        return queryset.filter(task_name=value) if value else queryset


class ExactFirstSearchMixin:
    """A search term that is exactly a key or a task id is found through their indexes.

    Only when nothing matches exactly are the ``search_fields`` searched as usual (a
    substring search: a table scan on a large table).
    """

    exact_search_fields: tuple[str, ...] = ()

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Any], search_term: str
    ) -> tuple[QuerySet[Any], bool]:
        term = search_term.strip()
        if term and self.exact_search_fields:
            condition = Q()
            for name in self.exact_search_fields:
                condition |= Q(**{name: term})
            exact = queryset.filter(condition)
            if exact.exists():
                return exact, False
        found: tuple[QuerySet[Any], bool] = super().get_search_results(  # type: ignore[misc]
            request, queryset, search_term
        )
        return found


class ReadOnlyMixin:
    """No add, change or delete, whatever the user's permissions; view works."""

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class FastListMixin:
    """Changelist settings for tables of millions of rows."""

    paginator: ClassVar[type] = paging.FastCountPaginator
    show_full_result_count = False
    list_per_page = 50
    if hasattr(admin, "ShowFacets"):  # Django 5.0+: facet counts scan the table
        show_facets = admin.ShowFacets.NEVER


@admin.register(Lease)
class LeaseAdmin(ExactFirstSearchMixin, ReadOnlyMixin, FastListMixin, LeaseModelAdmin):
    list_display = (
        "key",
        "token",
        "state_badge",
        "owner",
        "task_name_column",
        "task_link",
        "expires_in",
        "last_renewed",
        "acquired",
    )
    list_filter = (StateFilter, TaskNameFilter)
    search_fields = ("key", "owner", "=task_id")
    exact_search_fields = ("key", "task_id")
    date_hierarchy = "acquired_at"
    ordering = ("-acquired_at",)
    # only the columns an index can sort
    sortable_by = ("key", "task_name_column", "expires_in", "acquired")
    actions = ("force_release_selected",)
    change_form_template = "admin/celery_fenced/lease/change_form.html"
    change_list_template = CHANGE_LIST
    fieldsets = (
        (None, {"fields": ("key", "state_badge", "token", "owner", "reclaimed_from")}),
        ("Task", {"fields": ("task_name", "task_link")}),
        (
            "Times (UTC, the database's clock)",
            {"fields": ("acquired", "last_renewed", "expires", "expires_in", "released")},
        ),
        (
            "Reclaim",
            {"fields": ("reclaim_state", "reclaim_attempts", "reclaim_claimed", "job")},
        ),
    )
    readonly_fields = (
        "key",
        "state_badge",
        "token",
        "owner",
        "reclaimed_from",
        "task_name",
        "task_link",
        "acquired",
        "last_renewed",
        "expires",
        "expires_in",
        "released",
        "reclaim_state",
        "reclaim_attempts",
        "reclaim_claimed",
        "job",
    )

    def get_queryset(self, request: HttpRequest) -> QuerySet[Lease]:
        leases = paging.DrillDownQuerySet(self.model, using=operations.database_alias())
        ordering = self.get_ordering(request)
        return operations.with_state(leases.order_by(*ordering) if ordering else leases)

    # -- columns -----------------------------------------------------------------------
    @admin.display(description="state")
    def state_badge(self, lease: Lease) -> SafeString:
        state = str(getattr(lease, "state", ""))
        return badge(state, STATE_COLOURS.get(state, "#999"))

    @admin.display(description="expires in", ordering="expires_at")
    def expires_in(self, lease: Lease) -> str:
        return operations.describe_expiry(operations.expires_in(lease))

    @admin.display(description="acquired at", ordering="acquired_at")
    def acquired(self, lease: Lease) -> str:
        return when(lease.acquired_at)

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

    @admin.display(description="task name", ordering="task_name")
    def task_name_column(self, lease: Lease) -> SafeString:
        """The task name, allowed to wrap after each dot (a narrow column)."""
        parts = lease.task_name.split(".")
        return format_html_join(mark_safe(".<wbr>"), "{}", ((part,) for part in parts))

    @admin.display(description="task id")
    def task_link(self, lease: Lease) -> str:
        if not lease.task_id:
            return "—"
        url = self.task_result_url(lease.task_id)
        if url is None:
            return short_id(lease.task_id)
        return format_html(
            '<a href="{}" title="{}">{}</a>', url, lease.task_id, _first(lease.task_id)
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

    # -- force release -----------------------------------------------------------------
    def has_force_release_permission(self, request: HttpRequest) -> bool:
        return bool(request.user.has_perm(f"{self.opts.app_label}.force_release_lease"))

    @admin.action(permissions=["force_release"], description="Force-release selected leases")
    def force_release_selected(
        self, request: HttpRequest, queryset: QuerySet[Lease]
    ) -> HttpResponse | None:
        targets = list(queryset.filter(released_at__isnull=True)[: BULK_LIMIT + 1])
        if len(targets) > BULK_LIMIT:
            self.message_user(
                request,
                f"At most {BULK_LIMIT} leases can be force-released at once; narrow the "
                "selection with the filters.",
                messages.ERROR,
            )
            return None
        if not targets:
            self.message_user(request, "None of the selected leases is held.", messages.WARNING)
            return None
        if request.POST.get("post") == "yes":
            self.force_release_leases(request, targets)
            return None
        return self.confirmation(request, targets, bulk=True)

    def force_release_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        lease = self.get_object(request, unquote(object_id))
        if lease is None:
            raise Http404(f"No lease with id {object_id!r}")
        if not (
            self.has_view_permission(request, lease) and self.has_force_release_permission(request)
        ):
            raise PermissionDenied
        change_url = reverse(
            f"{self.admin_site.name}:celery_fenced_lease_change", args=[quote(lease.pk)]
        )
        if request.method == "POST":
            self.force_release_leases(request, [lease])
            return HttpResponseRedirect(change_url)
        return self.confirmation(request, [lease], bulk=False, cancel_url=change_url)

    def force_release_leases(self, request: HttpRequest, leases: Sequence[Lease]) -> None:
        by = f"admin:{request.user.get_username()}"
        ended: list[str] = []
        for lease in leases:
            token = operations.force_release(lease.key, by=by, using=lease._state.db)
            if token is None:
                self.message_user(
                    request, f"{lease.key} was not held: nothing released.", messages.WARNING
                )
                continue
            ended.append(f"{lease.key} (token {token})")
            self.log_change(request, lease, f"Force-released token {token} ({by}).")
        if ended:
            self.message_user(
                request,
                f"Force-released {len(ended)} lease{'s' if len(ended) != 1 else ''}: "
                f"{', '.join(ended[:20])}{' …' if len(ended) > 20 else ''}. Their holders "
                "are fenced out: their next renewal, guarded write or result is refused.",
                messages.SUCCESS,
            )

    def confirmation(
        self,
        request: HttpRequest,
        leases: Sequence[Lease],
        *,
        bulk: bool,
        cancel_url: str = "",
    ) -> TemplateResponse:
        request.current_app = self.admin_site.name
        context = {
            **self.admin_site.each_context(request),
            "title": "Force-release leases?" if bulk else f"Force-release {leases[0].key}?",
            "subtitle": None,
            "opts": self.opts,
            "leases": [(lease, self.expires_in(lease)) for lease in leases],
            "bulk": bulk,
            "cancel_url": cancel_url,
            "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
            "media": self.media,
        }
        return TemplateResponse(
            request, "admin/celery_fenced/lease/force_release_confirmation.html", context
        )

    def get_urls(self) -> list[URLPattern]:
        info = self.opts.app_label, self.opts.model_name
        return [
            path(
                "<path:object_id>/force-release/",
                self.admin_site.admin_view(self.force_release_view),
                name="{}_{}_force_release".format(*info),
            ),
            *super().get_urls(),
        ]

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
                (e, badge(e.kind, kinds.colour(e.kind)), _json(e.detail)) for e in page
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


@admin.register(LeaseEvent)
class LeaseEventAdmin(ExactFirstSearchMixin, ReadOnlyMixin, FastListMixin, EventModelAdmin):
    list_display = ("at_utc", "kind_badge", "lease_link", "token", "owner", "task", "detail")
    change_list_template = CHANGE_LIST
    list_filter = ("kind",)
    search_fields = ("lease__key", "=task_id")
    exact_search_fields = ("lease__key", "task_id")
    list_select_related = ("lease",)
    ordering = ("-at", "-id")
    sortable_by = ("at_utc",)

    def get_queryset(self, request: HttpRequest) -> QuerySet[LeaseEvent]:
        return super().get_queryset(request).using(operations.database_alias())

    @admin.display(description="at (UTC)", ordering="at")
    def at_utc(self, event: LeaseEvent) -> str:
        return when(event.at)

    @admin.display(description="task id")
    def task(self, event: LeaseEvent) -> SafeString | str:
        return short_id(event.task_id) if event.task_id else "—"

    @admin.display(description="kind", ordering="kind")
    def kind_badge(self, event: LeaseEvent) -> SafeString:
        return badge(event.kind, kinds.colour(event.kind))

    @admin.display(description="lease")
    def lease_link(self, event: LeaseEvent) -> str:
        url = reverse(
            f"{self.admin_site.name}:celery_fenced_lease_change", args=[quote(event.lease_id)]
        )
        return format_html('<a href="{}">{}</a>', url, event.lease.key)
