"""Grants of permits (``lease_limit``) in one transaction, on every database.

The key's own row (its *head*) is written first: the transaction queues there behind any
other acquirer of the key on this path (on SQLite it holds the write lock from its first
statement). It records how many permit rows the key has and gives the permits their
tokens; it is never granted itself (a plain grant refuses a head). Then the permit rows
are locked and read: the grant takes a free one of the first ``limit`` (the same job's
own expired permit first, then the lowest free number, then a permit row not made yet),
unless ``limit`` permits are held already — counting the permits above the limit that
holders of a larger one still hold, so lowering it grants none above it. PostgreSQL
grants most permits in one statement first (:mod:`.postgresql`); this is its slow path.
:class:`PermitGranter` is the helper every dialect calls for it.
"""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
from collections.abc import Callable, Iterable

from django.db import IntegrityError, transaction
from django.db.models import F
from django.db.models.functions import Greatest

from celery_fenced import permits
from celery_fenced.models import Completion, Lease, LeaseEvent
from celery_fenced.store.dialects.bookkeeping import Clock, Events
from celery_fenced.store.dialects.pending import PendingRows
from celery_fenced.store.types import Completed, Delivery, Displaced, Grant, GrantRequest, Holder

Kind = LeaseEvent.Kind


class PermitGranter:
    """Grants permits of the database ``alias`` in the caller's transaction (see the module).

    ``locked_rows`` and ``next_token``: how the dialect locks permit rows and numbers a
    grant, where not the portable ways (:func:`lock_permit_rows`, :func:`next_permit_token`).
    """

    def __init__(
        self,
        alias: str,
        now: Clock,
        events: Events,
        pending: PendingRows,
        *,
        locked_rows: Callable[[list[str]], list[Lease]] | None = None,
        next_token: Callable[[Lease, Iterable[Lease]], int] | None = None,
    ) -> None:
        self.alias = alias
        self.now = now
        self.events = events
        self.pending = pending
        self.locked_rows = locked_rows or functools.partial(lock_permit_rows, alias)
        self.next_token = next_token or functools.partial(next_permit_token, alias)

    def grant(self, request: GrantRequest) -> Grant | Holder | Completed:
        """Grant one of ``request.limit`` permits of ``request.key`` (see the module)."""
        assert request.limit is not None
        limit, key = request.limit, request.key
        rows = Lease._default_manager.using(self.alias)
        head = self._head(request)
        if isinstance(head, Holder):
            return head
        names = [permits.permit_key(key, i) for i in range(max(head.permits, limit))]
        found = {row.key: row for row in self.locked_rows(names)}
        # the clock once the permit rows are locked: a release this transaction waited
        # for came before the grant, in the key's history too
        now = self.now()
        delivery = request.delivery
        # the key's own row too: a job completed there before the key had permits
        if delivery is not None and self._completed([key, *names], delivery, request.window):
            return Completed(request.task_id, delivery.retries)
        held = [row for row in found.values() if _live(row, now)]
        job = permit_job(key, request.task_id)
        mine = [row for row in held if job is not None and row.permit_job == job]
        if len(held) >= limit or mine:  # all taken, or this job runs under another one
            first = mine[0] if mine else min(held, key=lambda row: row.expires_at)
            self.events.add(
                head.pk,
                Kind.BUSY,
                first.token,
                request.task_id,
                request.owner,
                now,
                {"holder": first.owner, "permits": limit},
            )
            return Holder(
                first.token,
                first.owner,
                first.expires_at,
                (first.expires_at - now).total_seconds(),
            )
        for left in found.values():
            # this job's expired grant on a permit above a lowered limit: it moves to a
            # permit under it, and the grant it leaves ends (its stale holder fenced out)
            moved = left.key not in names[:limit] and left.released_at is None
            if moved and job is not None and left.permit_job == job:
                rows.filter(pk=left.pk).update(released_at=now, job=None, release_state="MOVED")
                left.released_at = now
        missing = [name for name in names[:limit] if name not in found]
        if missing:  # made once, never granted: later grants find them free
            rows.bulk_create([_free_row(name, request.task_name, now) for name in missing])
            found.update((row.key, row) for row in self.locked_rows(missing))
        row = _choose(found, names[:limit], job, now)
        assert row is not None  # fewer than limit held: one of the first limit is free
        try:  # a delivery of the same job granted another permit meanwhile (PostgreSQL)
            with transaction.atomic(using=self.alias):
                token = self.next_token(head, found.values())
                reclaimed_from = row.owner if row.released_at is None else ""
                same_job = row.released_at is None and row.task_id == request.task_id != ""
                if reclaimed_from:
                    self.pending.requeue_displaced(
                        Displaced(
                            row.key,
                            row.task_id,
                            row.task_name,
                            row.job,
                            False,
                            row.reclaim_state,
                            row.reclaim_attempts,
                        ),
                        request.task_id,
                    )
                previous_start = row.acquired_at
                rows.filter(pk=row.pk).update(
                    token=token,
                    owner=request.owner,
                    task_id=request.task_id,
                    task_name=request.task_name,
                    acquired_at=now,
                    renewed_at=now,
                    expires_at=now + dt.timedelta(seconds=request.ttl),
                    released_at=None,
                    release_state="",
                    reclaimed_from=reclaimed_from,
                    job=request.job,
                    reclaim_attempts=row.reclaim_attempts if same_job else 0,
                    reclaim_state="",
                    reclaim_claimed_at=row.reclaim_claimed_at if same_job else None,
                    permit_job=job,
                )
        except IntegrityError:
            # among the key's permits: read through the keys' index (on PostgreSQL the
            # permit job's index takes no plain ``released_at IS NULL``: migration 0018)
            other = rows.filter(key__in=names, permit_job=job, released_at__isnull=True).first()
            expires = other.expires_at if other is not None else now
            return Holder(
                other.token if other is not None else 0,
                other.owner if other is not None else "",
                expires,
                max((expires - now).total_seconds(), 0.0),
            )
        if reclaimed_from:
            detail = {
                "previous_owner": reclaimed_from,
                "previous_token": row.token,
                "previous_acquired_at": previous_start.isoformat(),
            }
            self.events.add(
                row.pk, Kind.RECLAIMED, token, request.task_id, request.owner, now, detail
            )
        if not reclaimed_from and request.routine_events:
            self.events.add(row.pk, Kind.ACQUIRED, token, request.task_id, request.owner, now, {})
        expires = now + dt.timedelta(seconds=request.ttl)
        previous = row.expires_at if reclaimed_from else None
        return Grant(row.pk, token, expires, reclaimed_from, None, row.key, previous)

    def _head(self, request: GrantRequest) -> Lease | Holder:
        """The key's own row, locked, marked as the head of ``request.limit`` permits (made
        if missing). A plain grant that still holds it keeps the key busy; one that
        expired unfinished ends, its job handed to the outbox."""
        assert request.limit is not None
        rows = Lease._default_manager.using(self.alias)
        key = request.key
        # a write first: SQLite's write lock from the first statement, a row lock elsewhere
        if not rows.filter(key=key).update(permits=Greatest(F("permits"), request.limit)):
            now = self.now()
            try:
                with transaction.atomic(using=self.alias):
                    _free_row(key, request.task_name, now, request.limit).save(
                        using=self.alias, force_insert=True
                    )
            except IntegrityError:  # made meanwhile by another acquirer
                rows.filter(key=key).update(permits=Greatest(F("permits"), request.limit))
        head = rows.select_for_update().get(key=key)
        if head.released_at is None:
            now = self.now()
            if head.expires_at > now:  # a plain grant made before the key had permits
                return Holder(
                    head.token,
                    head.owner,
                    head.expires_at,
                    (head.expires_at - now).total_seconds(),
                )
            self.pending.requeue_displaced(
                Displaced(
                    key,
                    head.task_id,
                    head.task_name,
                    head.job,
                    False,
                    head.reclaim_state,
                    head.reclaim_attempts,
                ),
                request.task_id,
            )
            rows.filter(pk=head.pk).update(released_at=now, job=None, owner="")
        elif head.owner:  # a plain lease's row becomes the head: no owner, ever
            rows.filter(pk=head.pk).update(owner="")
        return head

    def _completed(self, names: list[str], delivery: Delivery, window: float) -> bool:
        """Whether ``delivery``'s job completed within ``window`` seconds under any permit."""
        since = self.now() - dt.timedelta(seconds=window)
        marked = Lease._default_manager.using(self.alias).filter(
            key__in=names,
            completed_digest=delivery.digest,
            completed_retries__gte=delivery.retries,
            completed_at__gt=since,
        )
        moved = Completion._default_manager.using(self.alias).filter(
            digest=delivery.digest, retries__gte=delivery.retries, completed_at__gt=since
        )
        return marked.exists() or moved.exists()


def permit_job(key: str, task_id: str) -> str | None:
    """What a permit's row records of its grant's job (``Lease.permit_job``): unique among
    a database's unreleased permits, so one job holds one permit of a key at a time."""
    if not task_id:
        return None
    return hashlib.md5(f"{key}{permits.SEPARATOR}{task_id}".encode()).hexdigest()


def _free_row(key: str, task_name: str, now: dt.datetime, permits: int = 0) -> Lease:
    """A lease row made free and never granted (token 0): a permit's, or (``permits``)
    the key's head."""
    return Lease(
        key=key,
        token=0,
        owner="",
        task_id="",
        task_name=task_name,
        acquired_at=now,
        renewed_at=now,
        expires_at=now,
        released_at=now,
        permits=permits,
    )


def _live(row: Lease, now: dt.datetime) -> bool:
    return row.released_at is None and row.expires_at > now


def _choose(
    found: dict[str, Lease], names: list[str], job: str | None, now: dt.datetime
) -> Lease | None:
    """The permit row to grant: the same job's own expired one, else the lowest free one."""
    free = [found[name] for name in names if name in found and not _live(found[name], now)]
    own = [row for row in free if row.released_at is None and job and row.permit_job == job]
    # a released permit before an expired one: a paused holder is not displaced while
    # another permit is free
    free.sort(key=lambda row: row.released_at is None)
    if own or free:
        return (own or free)[0]
    return None


def lock_permit_rows(alias: str, keys: list[str]) -> list[Lease]:
    """The lease rows of ``keys`` that exist, locked until the transaction ends."""
    return list(Lease._default_manager.using(alias).select_for_update().filter(key__in=keys))


def next_permit_token(alias: str, head: Lease, rows: Iterable[Lease]) -> int:
    """The next token of the key's permits: above every one issued (the head keeps the
    last). PostgreSQL: the head's floor plus the next value of a sequence."""
    token = int(max([head.token, *(row.token for row in rows)])) + 1
    Lease._default_manager.using(alias).filter(pk=head.pk).update(token=token)
    return token
