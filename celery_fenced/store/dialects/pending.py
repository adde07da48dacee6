"""The outbox's rows as every dialect keeps them: recorded at publish, ended by the grant.

:class:`PendingRows` writes and ends ``PendingJob`` rows through the ORM: one-row
bookkeeping no database does better in SQL. The dialects call it; PostgreSQL does the
common cases in its own statements and comes here for the rare ones.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any

from django.db import IntegrityError, connections, transaction
from django.db.models import Exists, OuterRef, Q
from django.db.models.functions import Now

from celery_fenced.models import Lease, PendingJob, ReclaimState
from celery_fenced.store.types import (
    Completed,
    Deduplicated,
    Displaced,
    Grant,
    GrantRequest,
    Holder,
    Pending,
)

#: what a grant comes to
Outcome = Grant | Holder | Completed


class PendingRows:
    """The pending rows (``PendingJob``) of the database ``alias``, through the ORM."""

    def __init__(self, alias: str) -> None:
        self.alias = alias

    def record(self, pending: Pending) -> None:
        """The outbox's row of a published job, written or replaced (same task id).

        Two copies of one job retried at once (a redelivery beside the original) both
        find no row and both insert: the later insert, refused by the unique task id
        once the first commits, replaces that row instead.
        """
        values = {
            **self._values(pending),
            "unique_key": None,
            "unique_until": "",
            "started_token": None,
            "plain": pending.plain,
        }
        rows = PendingJob._default_manager.using(self.alias).filter(task_id=pending.task_id)
        with transaction.atomic(using=self.alias):
            if rows.update(**values):
                return
            try:
                with transaction.atomic(using=self.alias):
                    rows.create(task_id=pending.task_id, **values)
            except IntegrityError:  # the other copy's row, committed meanwhile
                rows.update(**values)

    def _values(self, pending: Pending) -> dict[str, Any]:
        countdown = dt.timedelta(seconds=pending.countdown or 0.0)
        eta = pending.eta if pending.eta is not None else Now() + countdown
        expires = pending.expires
        return {
            "task_name": pending.task_name[:255],
            "key": pending.key,
            "job": pending.job,
            "published_at": Now(),
            "eta": eta if pending.eta is not None or pending.countdown else None,
            "expires_at": (
                Now() + dt.timedelta(seconds=expires)
                if isinstance(expires, int | float)
                else expires
            ),
            "resend_at": eta + dt.timedelta(seconds=pending.resend_after),
            "sends": 0,
            "unsent": False,
            "abandoned_at": None,
            "abandoned_reason": "",
            "nesting": pending.nesting,
        }

    def record_unique(
        self, pending: Pending, refused: Callable[[str], Deduplicated]
    ) -> str | Deduplicated:
        """The row of a ``lease_unique`` job, unless a copy of its key stands: then
        nothing is written but what ``refused(its task id)`` writes, in the same
        transaction, and its result is returned (else the job's own task id).

        Decided by the database: the unique ``unique_key`` refuses a second row of the
        key (an insert waits for a concurrent one's transaction), and a row that no
        longer stands for a queued or running copy is taken over by one conditional
        ``UPDATE`` (see :meth:`ended_copies`). A re-publish of the same job (its retry)
        keeps its row; if another copy took the key meanwhile, it is recorded without
        the key rather than dropped (a retried job's caller waits on its task id).
        """
        rows = PendingJob._default_manager.using(self.alias)
        values = {
            **self._values(pending),
            "unique_until": pending.unique or "",
            "started_token": None,
        }
        key, task_id = pending.key, pending.task_id
        for _attempt in range(8):
            with transaction.atomic(using=self.alias):
                # the same job again (its retry, a re-sent step): its row keeps the key,
                # or takes it if free; a write first (SQLite: see Events.add_deduplicated)
                try:
                    with transaction.atomic(using=self.alias):
                        if rows.filter(task_id=task_id).update(**values, unique_key=key):
                            return task_id
                except IntegrityError:  # another copy holds the key
                    if pending.same_job:
                        rows.filter(task_id=task_id).update(**values, unique_key=None)
                        return task_id
                if self.ended_copies(rows.filter(unique_key=key), pending.unique).update(
                    task_id=task_id, unique_key=key, **values
                ):
                    return task_id
                try:
                    with transaction.atomic(using=self.alias):
                        rows.create(task_id=task_id, unique_key=key, **values)
                    return task_id
                except IntegrityError:
                    found = list(rows.filter(unique_key=key).values_list("task_id", flat=True)[:1])
                if found:
                    if not pending.same_job:
                        return refused(str(found[0]))
                    self.record(pending)  # a retry: recorded, without the key
                    return task_id
            # the standing copy ended between the refusal and the read: decide again
        raise IntegrityError(f"could not record the unique job of key {key!r}")

    def ended_copies(self, rows: Any, unique: str | None) -> Any:
        """Of ``rows``, those that no longer stand for a copy: abandoned, expired, or
        started (``until_done``) under a grant that has ended — released, expired, or
        followed by a newer grant of the key. Read with the statement's snapshot, the
        lease can only look older than it is: the grant that started the row stamped
        its token on it, and an older snapshot of the lease never shows that token or
        a newer one, so a copy that has just started is never taken for ended."""
        ended_grant = Lease._default_manager.using(self.alias).filter(
            Q(token__gt=OuterRef("started_token"))
            | Q(token=OuterRef("started_token"))
            & (Q(released_at__isnull=False) | Q(expires_at__lte=Now())),
            key=OuterRef("key"),
        )
        started: Any = Q(started_token__isnull=False)
        if unique == "until_done":
            started = started & Exists(ended_grant)
        expired = Q(expires_at__lte=Now(), started_token__isnull=True)  # started: it runs on
        return rows.filter(Q(abandoned_at__isnull=False) | expired | started)

    def delete_ended_copies(self) -> int:
        """Delete the ``until_done`` rows whose run has ended (see :meth:`ended_copies`).

        Rows locked by a transaction in progress are left for the next sweep, not waited
        for (InnoDB's ``DELETE`` locks every row it reads, matching or not): a process
        stopped inside its transaction must not stall the reclaimer."""
        rows = PendingJob._default_manager.using(self.alias).filter(started_token__isnull=False)
        ended = self.ended_copies(rows, "until_done")
        orphans = self._delete_orphans(rows)
        if not connections[self.alias].features.has_select_for_update_skip_locked:
            deleted: int = ended.delete()[0]
            return deleted + orphans
        with transaction.atomic(using=self.alias):
            ids = list(ended.select_for_update(skip_locked=True).values_list("id", flat=True))
            if not ids:
                return orphans
            pending = PendingJob._default_manager.using(self.alias)
            gone: int = pending.filter(id__in=ids).delete()[0]
            return gone + orphans

    def _delete_orphans(self, started: Any) -> int:
        """Delete the started rows whose key has no lease row at all: their grant is gone
        (lease rows are never deleted, and the grant that stamps a row writes its key's
        lease row in the same transaction) — a row left by a version that worked a job's
        key out twice, the row under one key and the grant under another, which nothing
        else would ever end.

        Read first, in a statement of its own (its snapshot shows a row's stamp only
        with the lease row written beside it), then deleted by id and stamp, the lease's
        absence checked again: a row stamped since is left alone."""
        leases = Lease._default_manager.using(self.alias)
        orphans = list(
            started.exclude(Exists(leases.filter(key=OuterRef("key")))).values_list(
                "id", "started_token"
            )[:100]
        )
        gone = 0
        for row_id, token in orphans:
            gone += (
                started.filter(id=row_id, started_token=token)
                .exclude(Exists(leases.filter(key=OuterRef("key"))))
                .delete()[0]
            )
        return gone

    def requeue_displaced(self, previous: Displaced, by_task_id: str) -> None:
        """The job of an expired, unfinished grant taken over by another job goes to the
        outbox, due at once (in the grant's transaction): its lease row's recorded job —
        what the reclaimer would send again — is replaced by the new grant's. Its reclaim
        count goes with it; a job already abandoned stays so; an ``until_done`` row
        stamped with that grant stands for it again (PostgreSQL: the ``displaced`` step of
        its grant statements)."""
        if (
            previous.job is None
            or previous.released
            or previous.task_id in ("", by_task_id)
            or previous.reclaim_state == ReclaimState.ABANDONED
        ):
            return
        rows = PendingJob._default_manager.using(self.alias)
        if rows.filter(task_id=previous.task_id).exists():
            rows.filter(task_id=previous.task_id, started_token__isnull=False).update(
                started_token=None, resend_at=Now()
            )
            return
        try:
            with transaction.atomic(using=self.alias):
                rows.create(
                    task_id=previous.task_id,
                    task_name=previous.task_name,
                    key=previous.key,
                    job=previous.job,
                    published_at=Now(),
                    resend_at=Now(),
                    sends=previous.reclaim_attempts,
                )
        except IntegrityError:  # recorded meanwhile by its own publish (a retry's)
            pass

    def before_grant(self, task_id: str, nesting: int, *, keep_until_done: bool) -> bool:
        """A delivery is granted, busy or a duplicate: its job is no longer pending —
        except, for a ``lease_unique="until_done"`` task (``keep_until_done``), its
        ``until_done`` row, which :meth:`after_grant` settles. Returns whether
        nothing is left to settle. A delivery ends no row of a later replacement of its
        task (``nesting``: :class:`~celery_fenced.store.types.Delivery`)."""
        rows = PendingJob._default_manager.using(self.alias).filter(
            task_id=task_id, nesting__lte=nesting
        )
        if not keep_until_done:
            rows.delete()
            return True
        deleted, _ = rows.exclude(unique_until="until_done").delete()
        return bool(deleted)

    def after_grant(self, task_id: str, nesting: int, token: int | None) -> None:
        """An ``until_done`` row stays while its grant (``token``) runs; without a grant
        (busy, a duplicate) it ends — unless it has started: then it stands for the
        execution that holds (or held) its grant, not for this delivery (a redelivery of
        the running copy's message finds the key busy)."""
        rows = PendingJob._default_manager.using(self.alias).filter(
            task_id=task_id, unique_until="until_done", nesting__lte=nesting
        )
        if token is None:
            rows.filter(started_token__isnull=True).delete()
        else:
            rows.update(started_token=token)

    def ending_with_grant(
        self, request: GrantRequest, grant: Callable[[GrantRequest], Outcome]
    ) -> Outcome:
        """``grant(request)`` and the end of the job's pending row, in one transaction."""
        with transaction.atomic(using=self.alias):
            settled = not request.ends_pending or self.before_grant(
                request.task_id, request.nesting, keep_until_done=request.stamps_started
            )
            outcome = grant(request)
            if not settled:
                granted = outcome.token if isinstance(outcome, Grant) else None
                self.after_grant(request.task_id, request.nesting, granted)
            return outcome
