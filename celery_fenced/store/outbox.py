"""The outbox's rows: fenced jobs published and not yet granted (``PendingJob``).

Recorded at publish, deleted by the grant (see the dialects), sent again by the
reclaimer when due. Times are the database's: ``resend_at`` is computed by the insert.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from django.db import connections, transaction
from django.db.models import F, Q
from django.db.models.functions import Coalesce, Greatest, Now

from celery_fenced.models import Completion, PendingJob
from celery_fenced.store import dialects
from celery_fenced.store.types import Deduplicated, Delivery, Pending
from celery_fenced.tables import tables_required


@dataclass(frozen=True)
class Due:
    """A pending job the reclaimer claimed: send it again (``sends`` is this sending's)."""

    id: int
    task_id: str
    task_name: str
    key: str
    job: str
    sends: int
    eta: dt.datetime | None = None
    #: a plain task's job: its row ends when a worker starts it (no grant)
    plain: bool = False


def record_pending(alias: str, pending: Pending) -> str | Deduplicated:
    """Insert (or, for the same task id, replace) the pending row of a published job and
    return its task id — or, for a ``lease_unique`` job whose key already has a copy
    queued (or running, with ``until_done``), nothing but the ``deduplicated`` event is
    written, and the refusal (that copy's task id) is returned.

    One statement where the database can (PostgreSQL: the refusal and its event too;
    SQLite, MariaDB: a plain row), in the caller's transaction when one is open on
    ``alias``.
    """
    with tables_required(alias):
        dialect = dialects.for_alias(alias)
        if pending.unique is not None and pending.key:
            return dialect.record_unique_pending(pending)
        dialect.record_pending(pending)
        return pending.task_id


def mark_unsent(alias: str, task_id: str) -> None:
    """The broker refused the job's sending: the reclaimer's next sweep sends it (not
    before its ETA)."""
    PendingJob.objects.using(alias).filter(task_id=task_id).update(
        unsent=True, resend_at=Greatest(Now(), Coalesce(F("eta"), Now()))
    )


def forget_pending(alias: str, task_id: str, *, up_to: int | None = None) -> int:
    """Delete the pending row of ``task_id`` (revoked, or expired in the worker); with
    ``up_to``, a delivery's replacement count, not the row of a later replacement of
    the task (which keeps the task id)."""
    rows = PendingJob.objects.using(alias).filter(task_id=task_id)
    if up_to is not None:
        rows = rows.filter(nesting__lte=up_to)
    deleted, _ = rows.delete()
    return deleted


def expired_rows(alias: str, limit: int, grace: float) -> list[tuple[int, str, str, str]]:
    """``(id, task id, task name, job)`` of up to ``limit`` pending jobs whose ``expires``
    passed ``grace`` seconds ago and no worker started them (a started ``until_done`` row
    runs on). Within the grace, a message still queued reaches a worker, which discards
    it as expired and records its ``REVOKED`` itself."""
    rows = PendingJob.objects.using(alias).filter(
        expires_at__lte=Now() - dt.timedelta(seconds=grace), started_token=None
    )
    return list(rows.order_by("id").values_list("id", "task_id", "task_name", "job")[:limit])


def forget_row(alias: str, row_id: int) -> None:
    """Delete one pending row (its outcome recorded)."""
    PendingJob.objects.using(alias).filter(id=row_id).delete()


def claim_due(alias: str, *, resend_after: float, limit: int) -> tuple[list[Due], bool]:
    """Claim up to ``limit`` pending jobs due to be sent again; expired ones are deleted.

    Each row is claimed by a conditional ``UPDATE`` on the sendings count it was read
    with (still due), so several reclaimers send each due job once. A row locked by a
    transaction in progress (a worker granting the job, perhaps stopped in the middle of
    it: SIGSTOP, a GC pause) is passed over, not waited for: one stalled process must not
    stall the resending of every other job. Returns the claims and whether more may be
    due (``limit`` rows were read).
    """
    rows = PendingJob.objects.using(alias)
    dialects.for_alias(alias).delete_ended_copies()  # until_done rows whose run ended
    # an expired row is not sent again: the reclaimer records its REVOKED (expired_rows)
    due = rows.filter(
        Q(expires_at__isnull=True) | Q(expires_at__gt=Now()),
        resend_at__lte=Now(),
        abandoned_at__isnull=True,
        started_token=None,
    )
    candidates = list(
        due.order_by("resend_at").values_list(
            "id", "task_id", "task_name", "key", "job", "sends", "eta", "plain"
        )[:limit]
    )
    claimed = []
    # SKIP LOCKED where the database has it (PostgreSQL, MariaDB 10.6+, MySQL 8); SQLite
    # has one writer at a time and no row locks
    skip_locked = connections[alias].features.has_select_for_update_skip_locked
    for row_id, task_id, task_name, key, job, sends, eta, plain in candidates:
        with transaction.atomic(using=alias):
            row = due.filter(id=row_id, sends=sends)
            locked = row.select_for_update(skip_locked=True).values_list("id", flat=True)
            if skip_locked and not list(locked):
                continue  # locked by a transaction in progress, or claimed already
            won = row.update(
                sends=F("sends") + 1,
                unsent=False,
                resend_at=Now() + dt.timedelta(seconds=resend_after),
            )
        if won:
            claimed.append(Due(row_id, task_id, task_name, key, job, sends + 1, eta, plain))
    return claimed, len(candidates) == limit


def unclaim_due(alias: str, due: Due) -> None:
    """The claimed sending failed: due again at once, its count as before."""
    PendingJob.objects.using(alias).filter(id=due.id, sends=due.sends).update(
        sends=F("sends") - 1, resend_at=Now()
    )


def abandon_pending(alias: str, due: Due, reason: str) -> None:
    """Give up on a pending job: kept, with why, for the admin (pruned later)."""
    PendingJob.objects.using(alias).filter(id=due.id).update(
        abandoned_at=Now(), abandoned_reason=reason[:255]
    )


def pending_rows(alias: str, *, limit: int | None = 100) -> list[PendingJob]:
    """The pending jobs, oldest first (``fenced list --pending``; ``limit`` None: all);
    an ``until_done`` job's row while it runs too (``started_token`` set)."""
    rows = PendingJob.objects.using(alias).order_by("published_at", "id")
    return list(rows if limit is None else rows[:limit])


def delete_abandoned_before(alias: str, before: dt.datetime) -> int:
    """Prune: delete the jobs abandoned before ``before``."""
    deleted, _ = PendingJob.objects.using(alias).filter(abandoned_at__lt=before).delete()
    return deleted


def mark_ended(alias: str, delivery: Delivery) -> None:
    """A delivery that ended without a grant (skipped or failed as busy): like a
    completion, it makes later copies of its message duplicates (``Completion`` rows
    are kept for ``fenced_duplicate_window``)."""
    Completion.objects.using(alias).create(
        digest=delivery.digest, retries=delivery.retries, completed_at=Now()
    )
