"""Operating the lease table: state by the database's clock, listing, counting, pruning.

Shared by the admin, ``manage.py fenced`` and ``celery fenced`` so that none of them talks
to the ORM for writes: the only write here is :func:`prune_events`, which deletes old
:class:`~celery_fenced.models.LeaseEvent` rows and never a lease row, so a key's next
token always stays above every token it issued. A force-release, the lease database's
alias and its clock are the store's (:func:`celery_fenced.store.force_release`,
:func:`~celery_fenced.store.database_alias`, :func:`~celery_fenced.store.database_now`).

A lease's state is never decided with this process's clock: every comparison of
``expires_at`` is made inside the query, against the database's ``Now()``.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from django.db.models import Case, Q, QuerySet, Value, When
from django.db.models.functions import Now

from celery_fenced import conf, permits, store
from celery_fenced.models import Lease, LeaseEvent, PendingJob

HELD = "held"
EXPIRED = "expired"
RELEASED = "released"
STATES = (HELD, EXPIRED, RELEASED)

PRUNE_BATCH_SIZE = 10_000
COUNT_CAP = 10_000


def state_condition(state: str) -> Q:
    """A filter selecting the leases in ``state``, compared with the database's clock."""
    if state == RELEASED:
        return Q(released_at__isnull=False)
    if state == HELD:
        return Q(released_at__isnull=True, expires_at__gt=Now())
    if state == EXPIRED:
        return Q(released_at__isnull=True, expires_at__lte=Now())
    raise ValueError(f"state must be one of {', '.join(STATES)}, got {state!r}")


def with_state(queryset: QuerySet[Lease]) -> QuerySet[Lease]:
    """Annotate ``state`` (held / expired / released) and ``db_now``, both by the DB clock."""
    return queryset.annotate(
        state=Case(
            When(released_at__isnull=False, then=Value(RELEASED)),
            When(expires_at__gt=Now(), then=Value(HELD)),
            default=Value(EXPIRED),
        ),
        db_now=Now(),
    )


def expires_in(lease: Lease) -> float | None:
    """Seconds until ``lease`` expires by the database's clock (negative: expired ago).

    ``None`` for a released lease. ``lease`` must come from :func:`with_state`.
    """
    if lease.released_at is not None:
        return None
    now: dt.datetime = getattr(lease, "db_now")  # noqa: B009 - an annotation
    return (lease.expires_at - now).total_seconds()


def describe_expiry(seconds: float | None) -> str:
    """``in 12s`` / ``expired 3m 04s ago`` / ``—`` (released) for :func:`expires_in`."""
    if seconds is None:
        return "—"
    if seconds > 0:
        return f"in {duration(seconds)}"
    return f"expired {duration(seconds)} ago"


def duration(seconds: float) -> str:
    """``2d 03h``, ``3h 02m``, ``4m 10s``, ``12s``, ``0.4s`` (sign ignored)."""
    seconds = abs(seconds)
    if seconds < 10:
        return f"{seconds:.1f}s"
    days, rest = divmod(int(seconds), 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours:02d}h"
    if hours:
        return f"{hours}h {minutes:02d}m"
    if minutes:
        return f"{minutes}m {secs:02d}s"
    return f"{secs}s"


def leases(
    *,
    state: str | None = None,
    task: str | None = None,
    prefix: str | None = None,
    using: str | None = None,
) -> QuerySet[Lease]:
    """Leases with their state, newest grant first, optionally filtered."""
    queryset = with_state(Lease._default_manager.using(store.database_alias(using)).all())
    if state:
        queryset = queryset.filter(state_condition(state))
    if task:
        queryset = queryset.filter(task_name=task)
    if prefix:
        queryset = queryset.filter(key__startswith=prefix)
    return queryset.order_by("-acquired_at", "-id")


def find(key: str, *, using: str | None = None) -> Lease | None:
    """The lease row of ``key`` with its state, or None."""
    return with_state(
        Lease._default_manager.using(store.database_alias(using)).filter(key=key)
    ).first()


def permit_rows(head: Lease) -> list[Lease]:
    """The permits of ``head``, a key's own row with permits (``lease_limit``), in order,
    each with its state; none for a plain lease."""
    if not head.permits:
        return []
    names = [permits.permit_key(head.key, i) for i in range(head.permits)]
    rows = with_state(Lease._default_manager.using(head._state.db).filter(key__in=names))
    return sorted(rows, key=lambda row: permits.split(row.key)[1] or 0)


def events(lease: Lease) -> QuerySet[LeaseEvent]:
    """The audit trail of ``lease``, newest first."""
    return (
        LeaseEvent._default_manager.using(lease._state.db)
        .filter(lease_id=lease.pk)
        .order_by("-at", "-id")
    )


def pending_jobs(task_ids: Iterable[str], *, using: str | None = None) -> dict[str, str]:
    """The recorded jobs (JSON) the outbox holds for ``task_ids``, by task id: a job
    waiting to be sent again, or a ``lease_unique`` job kept while it runs."""
    ids = sorted(set(task_ids))
    if not ids:
        return {}
    rows = PendingJob._default_manager.using(store.database_alias(using)).filter(task_id__in=ids)
    return dict(rows.values_list("task_id", "job"))


def prune_events(
    *,
    older_than_days: float,
    using: str | None = None,
    batch_size: int = PRUNE_BATCH_SIZE,
    progress: Callable[[int, int], None] | None = None,
) -> int:
    """Delete the events recorded more than ``older_than_days`` ago; return how many.

    Deletes ``batch_size`` rows per statement (each its own short transaction), so a
    large trail is pruned without a long lock. The age is measured by the database's
    clock. Lease rows are never deleted: a key keeps its token, and its next grant still
    gets a higher one. ``progress(deleted, total)`` is called after every batch.

    The completed-duplicate check of fenced tasks does not read events (it reads the
    lease rows' completion markers, kept for ``fenced_duplicate_window``): pruning
    events never lets a redelivered job run again. The moved markers of jobs completed
    before that window are deleted too (:func:`prune_completions`), and the outbox's
    pending jobs abandoned before the cutoff.
    """
    if not older_than_days > 0:
        raise ValueError(f"older_than_days must be greater than 0, got {older_than_days!r}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size!r}")
    alias = store.database_alias(using)
    cutoff = store.database_now(alias) - dt.timedelta(days=older_than_days)
    deleted = store.delete_events_before(alias, cutoff, batch_size=batch_size, progress=progress)
    prune_completions(using=alias)
    store.delete_abandoned_before(alias, cutoff)
    return deleted


def prune_completions(*, using: str | None = None) -> int:
    """Delete the completion markers older than ``fenced_duplicate_window``; how many.

    They are written only when a second job completes under a key, and cannot match a
    delivery once the window has passed.
    """
    alias = store.database_alias(using)
    window = dt.timedelta(seconds=conf.load().duplicate_window)
    return store.delete_completions_before(alias, store.database_now(alias) - window)


def task_names(*, using: str | None = None, limit: int = 50) -> list[str]:
    """The distinct task names in the lease table (at most ``limit``), in order.

    One index seek per name (a loose index scan), not a scan of the whole table.
    """
    names = (
        Lease._default_manager.using(store.database_alias(using))
        .exclude(task_name="")
        .order_by("task_name")
        .values_list("task_name", flat=True)
    )
    found: list[str] = []
    while len(found) < limit:
        name = (names.filter(task_name__gt=found[-1]) if found else names).first()
        if name is None:
            break
        found.append(name)
    return found


@dataclass(frozen=True)
class RowCount:
    """A row count that may be estimated (``about``) or capped (``at_least``)."""

    value: int
    kind: Literal["exact", "about", "at_least"] = "exact"

    def __str__(self) -> str:
        if self.kind == "about":
            return f"about {self.value:,}"
        if self.kind == "at_least":
            return f"more than {self.value:,}"
        return f"{self.value:,}"


def fast_count(queryset: QuerySet[Any], *, cap: int | None = None) -> RowCount:
    """Count ``queryset`` without reading a whole large table.

    An unfiltered query on PostgreSQL uses the planner's estimate (``pg_class.reltuples``)
    when it is above ``cap``; any other query is counted up to ``cap`` rows only
    (default :data:`COUNT_CAP`).
    """
    cap = COUNT_CAP if cap is None else cap
    unordered = queryset.order_by()
    if not queryset.query.where:
        table = queryset.model._meta.db_table
        estimate = store.estimated_rows(queryset.db, table) or 0
        # a stale estimate of a table emptied since: check there really are > cap rows
        if estimate > cap and unordered[cap : cap + 1].exists():
            return RowCount(estimate, "about")
    counted = unordered[: cap + 1].count()
    if counted > cap:
        return RowCount(cap, "at_least")
    return RowCount(counted)
