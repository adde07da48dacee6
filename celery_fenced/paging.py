"""Changelist helpers for tables of millions of rows: counting and date drill-down.

Django's admin counts the whole filtered table for its paginator, and its date hierarchy
runs ``SELECT DISTINCT date_trunc(…)`` over every matching row. Here the paginator
uses :func:`celery_fenced.operations.fast_count`, and the date hierarchy finds its
years, months or days with one index probe each (``MIN(field) WHERE field >= start``
of the next period), reading a handful of index entries instead of the table.
"""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.core.paginator import Paginator
from django.db.models import Min, QuerySet
from django.utils import timezone
from django.utils.functional import cached_property

from celery_fenced import operations

if TYPE_CHECKING:
    AnyPaginator = Paginator[Any]
    AnyQuerySet = QuerySet[Any]
else:
    AnyPaginator = Paginator
    AnyQuerySet = QuerySet

MAX_PERIODS = 400  # the date hierarchy lists at most this many years, months or days


class FastCountPaginator(AnyPaginator):
    """A paginator that never counts a whole large table (see ``operations.fast_count``)."""

    @cached_property
    def counted(self) -> operations.RowCount:
        counted = operations.fast_count(self.object_list)  # type: ignore[arg-type]
        # the changelist's date hierarchy runs on this same queryset: tell it the size
        if isinstance(self.object_list, DrillDownQuerySet):
            self.object_list.counted = counted
        return counted

    @cached_property
    def count(self) -> int:
        return self.counted.value


class DrillDownQuerySet(AnyQuerySet):
    """A queryset whose ``datetimes()`` walks an index instead of a DISTINCT scan.

    It probes only when many rows match (over ``operations.COUNT_CAP``): then every probe
    meets a matching row within a few index entries. A few matching rows (a rare state,
    a search) are found through their own filter's index, and DISTINCT over them is cheap.
    """

    counted: operations.RowCount | None = None

    def datetimes(  # type: ignore[override]
        self,
        field_name: str,
        kind: str,
        order: str = "ASC",
        tzinfo: dt.tzinfo | None = None,
        **kwargs: Any,
    ) -> list[dt.datetime]:
        if kind not in ("year", "month", "day") or kwargs:
            return list(super().datetimes(field_name, kind, order, tzinfo, **kwargs))  # type: ignore[arg-type]
        counted = self.counted or operations.fast_count(self)
        if counted.kind == "exact":
            return list(super().datetimes(field_name, kind, order, tzinfo))  # type: ignore[arg-type]
        zone = tzinfo or (timezone.get_current_timezone() if settings.USE_TZ else None)
        rows = self.order_by()
        periods: list[dt.datetime] = []
        first = rows.aggregate(first=Min(field_name))["first"]
        while first is not None and len(periods) < MAX_PERIODS:
            start = _truncate(first.astimezone(zone) if zone else first, kind)
            periods.append(start)
            following = _following(start, kind, zone)
            first = rows.filter(**{f"{field_name}__gte": following}).aggregate(
                first=Min(field_name)
            )["first"]
        return periods if order == "ASC" else periods[::-1]


def _truncate(value: dt.datetime, kind: str) -> dt.datetime:
    value = value.replace(hour=0, minute=0, second=0, microsecond=0)
    if kind in ("month", "year"):
        value = value.replace(day=1)
    if kind == "year":
        value = value.replace(month=1)
    return value


def _following(start: dt.datetime, kind: str, zone: dt.tzinfo | None) -> dt.datetime:
    naive = start.replace(tzinfo=None)
    if kind == "day":
        naive += dt.timedelta(days=1)
    elif kind == "month":
        naive = naive.replace(year=naive.year + naive.month // 12, month=naive.month % 12 + 1)
    else:
        naive = naive.replace(year=naive.year + 1)
    return timezone.make_aware(naive, zone) if zone else naive
