"""Pruning: old events and expired completion markers go; lease rows (and tokens) stay."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable

from django.db.models import Count, Max, Min

from celery_fenced.models import Completion, LeaseEvent


def delete_events_before(
    alias: str,
    cutoff: dt.datetime,
    *,
    batch_size: int,
    progress: Callable[[int, int], None] | None = None,
) -> int:
    """Delete the events of ``alias`` recorded before ``cutoff``, ``batch_size`` ids per
    statement (each its own short transaction); return how many.

    ``progress(deleted, total)`` is called after every batch that deleted rows.
    """
    manager = LeaseEvent._default_manager.using(alias)
    old = manager.filter(at__lt=cutoff).order_by()
    span = old.aggregate(first=Min("id"), last=Max("id"), total=Count("id"))
    if not span["total"]:
        return 0
    deleted = 0
    # walk the primary key in ranges of batch_size ids: each DELETE is an index range scan
    # (a LIMITed subquery on `at` would rescan the dead rows of every earlier batch)
    for start in range(span["first"], span["last"] + 1, batch_size):
        in_range = {"id__gte": start, "id__lt": start + batch_size, "at__lt": cutoff}
        count, _ = manager.filter(**in_range).delete()
        deleted += count
        if progress is not None and count:
            progress(deleted, max(span["total"], deleted))
    return deleted


def delete_completions_before(alias: str, cutoff: dt.datetime) -> int:
    """Delete the moved completion markers of jobs completed before ``cutoff`` (past the
    duplicate window, they can no longer match a delivery); return how many."""
    count, _ = Completion._default_manager.using(alias).filter(completed_at__lt=cutoff).delete()
    return count
