"""The admin's list filters and the mixins both of its pages share."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from django.contrib import admin
from django.db.models import Q, QuerySet
from django.http import HttpRequest

from celery_fenced import operations, paging
from celery_fenced.models import Lease, LeaseEvent

if TYPE_CHECKING:
    LeaseModelAdmin = admin.ModelAdmin[Lease]
    EventModelAdmin = admin.ModelAdmin[LeaseEvent]
else:
    LeaseModelAdmin = EventModelAdmin = admin.ModelAdmin


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
