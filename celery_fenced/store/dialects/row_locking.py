"""The grants, releases and proofs of the dialects that lock a key's row through the ORM."""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import Callable
from typing import Any

from django.db import IntegrityError, connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import F

from celery_fenced.models import Completion, Lease, LeaseEvent, ReclaimState
from celery_fenced.store.dialects.bookkeeping import Clock, Events, claimable
from celery_fenced.store.dialects.pending import PendingRows
from celery_fenced.store.dialects.permits import PermitGranter
from celery_fenced.store.dialects.rows import abandoned_detail, completes, released_detail
from celery_fenced.store.types import (
    Claim,
    Completed,
    Delivery,
    Displaced,
    Ending,
    Grant,
    GrantRequest,
    Holder,
)

Kind = LeaseEvent.Kind

#: a key's row locked: its id, token, release and expiry times, and the database's time
#: (read after the lock); None when the key has no row
LockedRow = Callable[[str], "tuple[Any, ...] | None"]


class RowLocking:
    """Grants, releases and proofs on the database ``alias``, each in a transaction that
    locks the key's lease row through the ORM: the portable dialect's, and MariaDB and
    MySQL's (:mod:`.orm`, :mod:`.mysql`).

    ``connection``: one to use instead of Django's; ``now``: the database's clock;
    ``locked_row``: locks a key's row (:data:`LockedRow`); ``lock_for_result``: takes a
    task id's result lock (:meth:`.Dialect.lock_for_result`).
    """

    def __init__(
        self,
        alias: str,
        connection: BaseDatabaseWrapper | None,
        now: Clock,
        events: Events,
        pending: PendingRows,
        permits: PermitGranter,
        *,
        locked_row: LockedRow,
        lock_for_result: Callable[[str], None],
    ) -> None:
        self.alias = alias
        self._connection = connection
        self.now = now
        self.events = events
        self.pending = pending
        self.permits = permits
        self.locked_row = locked_row
        self.lock_for_result = lock_for_result

    @property
    def connection(self) -> BaseDatabaseWrapper:
        """The connection the transactions run on."""
        return self._connection if self._connection is not None else connections[self.alias]

    def acquire(self, request: GrantRequest) -> Grant | Holder | Completed:
        """A key's first grant finds its row there: made beforehand, in a statement of
        its own (see :meth:`_placeholder`), unless a transaction of the caller's is open.
        With permits too: that row is their head, which the grant's transaction locks
        first (first grants inserting it at once deadlocked on MariaDB, error 1213)."""
        if not self.connection.in_atomic_block:
            self._placeholder(request.key, request.task_name)
        grant = self.permits.grant if request.limit is not None else self._grant
        return self.pending.ending_with_grant(request, grant)

    def _placeholder(self, key: str, task_name: str = "") -> None:
        """The key's row, if missing: released, never granted (token 0), so the grant's
        transaction always locks an existing row. Two first grants of a key would
        otherwise both insert it: on InnoDB the loser's duplicate-key error leaves it a
        shared lock on the row, and two such losers deadlock upgrading it (MariaDB and
        MySQL's 1213). In autocommit, a duplicate's lock ends with its statement."""
        rows = Lease._default_manager.using(self.alias)
        if rows.filter(key=key).exists():
            return
        now = self.now()
        row = Lease(
            key=key,
            token=0,
            task_name=task_name[:255],  # a permits' head keeps it, as when made by the grant
            acquired_at=now,
            renewed_at=now,
            expires_at=now,
            released_at=now,
        )
        if self.connection.features.supports_ignore_conflicts:
            # one statement whichever first grant comes first (MySQL's INSERT IGNORE)
            rows.bulk_create([row], ignore_conflicts=True)
            return
        with contextlib.suppress(IntegrityError):  # made meanwhile by another first grant
            row.save(using=self.alias, force_insert=True)

    def _created(self, request: GrantRequest, now: dt.datetime, expires: dt.datetime) -> Any:
        """The key's first row, granted to ``request``; None when another acquirer's insert
        came first (in a savepoint: the unique key's error leaves the transaction usable,
        and the caller locks the row that now exists)."""
        try:
            with transaction.atomic(using=self.alias):
                return Lease._default_manager.using(self.alias).create(
                    key=request.key,
                    token=1,
                    owner=request.owner,
                    task_id=request.task_id,
                    task_name=request.task_name,
                    acquired_at=now,
                    renewed_at=now,
                    expires_at=expires,
                    job=request.job,
                )
        except IntegrityError:
            return None

    def _grant(self, request: GrantRequest) -> Grant | Holder | Completed:
        """The grant of a key (not a permit), in :meth:`acquire`'s transaction."""
        with transaction.atomic(using=self.alias, savepoint=False):  # acquire's
            manager = Lease._default_manager.using(self.alias)
            row = manager.select_for_update().filter(key=request.key).first()
            if (
                request.delivery is not None
                and request.delivery.task_id
                and self.completed(request.key, request.delivery, request.window)
            ):
                return Completed(request.task_id, request.delivery.retries)
            now = self.now()
            expires = now + dt.timedelta(seconds=request.ttl)
            created = None
            if row is None:
                created = self._created(request, now, expires)
                # None: another acquirer created the key's row first; it is locked now
                row = created or manager.select_for_update().filter(key=request.key).first()
                if row is None:  # pragma: no cover - created, then deleted meanwhile
                    raise IntegrityError(f"the lease row of {request.key!r} vanished")
            if created is not None:
                reclaimed_from, previous_start = "", None
            elif row.permits:  # the head of the key's permits: never granted itself
                return Holder(row.token, "", row.expires_at, 0.0)
            elif row.released_at is None and row.expires_at > now:
                self.events.add(
                    row.pk,
                    Kind.BUSY,
                    row.token,
                    request.task_id,
                    request.owner,
                    now,
                    {"holder": row.owner},
                )
                return Holder(
                    row.token, row.owner, row.expires_at, (row.expires_at - now).total_seconds()
                )
            else:
                reclaimed_from = row.owner if row.released_at is None else ""
                previous_start, previous_end = row.acquired_at, row.expires_at
                displaced = Displaced(
                    row.key,
                    row.task_id,
                    row.task_name,
                    row.job,
                    row.released_at is not None,
                    row.reclaim_state,
                    row.reclaim_attempts,
                )
                # a re-delivery of the same unfinished task keeps its reclaim count
                same_job = (
                    row.released_at is None
                    and request.task_id != ""
                    and row.task_id == request.task_id
                )
                manager.filter(pk=row.pk).update(
                    token=F("token") + 1,
                    owner=request.owner,
                    task_id=request.task_id,
                    task_name=request.task_name,
                    acquired_at=now,
                    renewed_at=now,
                    expires_at=expires,
                    released_at=None,
                    release_state="",
                    reclaimed_from=reclaimed_from,
                    job=request.job,
                    reclaim_attempts=row.reclaim_attempts if same_job else 0,
                    reclaim_state="",
                    reclaim_claimed_at=row.reclaim_claimed_at if same_job else None,
                )
                row.refresh_from_db(fields=["token"])
            if reclaimed_from:
                self.pending.requeue_displaced(displaced, request.task_id)
                detail = {
                    "previous_owner": reclaimed_from,
                    "previous_token": row.token - 1,
                    "previous_acquired_at": previous_start and previous_start.isoformat(),
                }
                self.events.add(
                    row.pk, Kind.RECLAIMED, row.token, request.task_id, request.owner, now, detail
                )
            elif request.routine_events:
                self.events.add(
                    row.pk, Kind.ACQUIRED, row.token, request.task_id, request.owner, now, {}
                )
            return Grant(
                row.pk,
                row.token,
                expires,
                reclaimed_from,
                previous_expires_at=previous_end if reclaimed_from else None,
            )

    def release(self, ending: Ending) -> bool:
        """See :meth:`.Dialect.release`: the grant locked, then ended (:meth:`_end`)."""
        with transaction.atomic(using=self.alias):
            now = self.now()
            manager = Lease._default_manager.using(self.alias)
            row = (
                manager.select_for_update()
                .filter(
                    key=ending.key,
                    token=ending.token,
                    owner=ending.owner,
                    released_at__isnull=True,
                )
                .first()
            )
            if row is None:
                return False
            self._end(row.pk, ending, now)
            return True

    def _end(self, lease_id: int, ending: Ending, now: dt.datetime) -> None:
        """Release a locked grant; mark its job completed if it is (moving a displaced
        marker to the ``Completion`` table); the ``released`` event with routine events."""
        state, delivery = ending.state, ending.delivery
        values: dict[str, Any] = {"released_at": now, "job": None, "release_state": state[:16]}
        manager = Lease._default_manager.using(self.alias)
        if delivery is not None and completes(state, delivery):
            old = manager.filter(pk=lease_id).values_list(
                "completed_digest", "completed_retries", "completed_at"
            )[0]
            digest, retries, completed_at = old
            if digest not in ("", delivery.digest) and retries is not None and completed_at:
                Completion._default_manager.using(self.alias).create(
                    digest=digest, retries=retries, completed_at=completed_at
                )
            values.update(
                completed_digest=delivery.digest,
                completed_retries=delivery.retries,
                completed_at=now,
            )
        manager.filter(pk=lease_id).update(**values)
        if ending.routine_events:
            detail = released_detail(state, delivery)
            self.events.add(
                lease_id, Kind.RELEASED, ending.token, ending.task_id, ending.owner, now, detail
            )

    def force_release(
        self, key: str, by: str, task_id: str | None = None, token: int | None = None
    ) -> tuple[int, str] | None:
        """See :meth:`.Dialect.force_release`: the unreleased grant locked, then ended."""
        with transaction.atomic(using=self.alias):
            now = self.now()
            manager = Lease._default_manager.using(self.alias)
            rows = manager.select_for_update().filter(key=key, released_at__isnull=True)
            if task_id is not None:
                rows = rows.filter(task_id=task_id)
            if token is not None:
                rows = rows.filter(token=token)
            row = rows.first()
            if row is None:
                return None
            manager.filter(pk=row.pk).update(released_at=now, job=None)
            detail = {"by": by, "acquired_at": row.acquired_at.isoformat()}
            self.events.add(
                row.pk, Kind.FORCE_RELEASED, row.token, row.task_id, row.owner, now, detail
            )
            return row.token, row.owner

    def prove_current(self, key: str, token: int) -> tuple[bool, int | None]:
        """See :meth:`.Dialect.prove_current`: the key's row locked (:meth:`_lock_if_current`)."""
        lease_id, current, _ = self._lock_if_current(key, token)
        return lease_id is not None, current

    def _lock_if_current(
        self, key: str, token: int, *, expired_ok: bool = False
    ) -> tuple[int | None, int | None, dt.datetime | None]:
        """Lock ``key``'s row; its id if ``token`` is its unreleased, unexpired grant.

        With ``expired_ok`` an expired grant with no successor counts too. Returns
        ``(lease id or None, the key's current token or None, the database's time)``.
        """
        row = self.locked_row(key)
        if row is None:
            return None, None, None
        lease_id, current, released_at, expires_at, now = row
        is_current = current == token and released_at is None and (expired_ok or expires_at > now)
        return (lease_id if is_current else None), current, now

    def release_current(self, ending: Ending) -> tuple[bool, int | None]:
        """See :meth:`.Dialect.release_current`: the row locked, the grant ended, the result
        lock taken."""
        lease_id, current, now = self._lock_if_current(ending.key, ending.token, expired_ok=True)
        if lease_id is None or now is None:
            return False, current
        self._end(lease_id, ending, now)
        self.lock_for_result(ending.task_id)
        return True, current

    def is_current(self, key: str, token: int, owner: str) -> bool:
        """See :meth:`.Dialect.is_current`."""
        now = self.now()
        return (
            Lease._default_manager.using(self.alias)
            .filter(
                key=key, token=token, owner=owner, released_at__isnull=True, expires_at__gt=now
            )
            .exists()
        )

    def completed(self, key: str, delivery: Delivery, window: float) -> bool:
        """See :meth:`.Dialect.completed`: the key's marker, or a ``Completion`` row."""
        since = self.now() - dt.timedelta(seconds=window)
        if (
            Lease._default_manager.using(self.alias)
            .filter(
                key=key,
                completed_digest=delivery.digest,
                completed_retries__gte=delivery.retries,
                completed_at__gt=since,
            )
            .exists()
        ):
            return True
        return (
            Completion._default_manager.using(self.alias)
            .filter(digest=delivery.digest, retries__gte=delivery.retries, completed_at__gt=since)
            .exists()
        )

    def claim_expired(
        self, *, grace: float, resend_after: float, max_attempts: int, limit: int
    ) -> list[Claim]:
        """See :meth:`.Dialect.claim_expired`: the eligible rows locked (skipping locked ones
        where the database can), each claimed by a conditional ``UPDATE``."""
        claims: list[Claim] = []
        with transaction.atomic(using=self.alias):
            now = self.now()
            manager = Lease._default_manager.using(self.alias)
            eligible = claimable(now, grace, resend_after)
            skip = self.connection.features.has_select_for_update_skip_locked
            rows = list(
                manager.select_for_update(skip_locked=skip)
                .filter(eligible)
                .order_by("expires_at")[:limit]
            )
            for row in rows:
                resend = row.reclaim_attempts < max_attempts
                attempts = row.reclaim_attempts + 1 if resend else row.reclaim_attempts
                state = ReclaimState.RESENT if resend else ReclaimState.ABANDONED
                if not manager.filter(eligible, pk=row.pk).update(
                    reclaim_attempts=attempts, reclaim_state=state, reclaim_claimed_at=now
                ):
                    continue
                claim = Claim.of_lease(row, attempts, state)
                if not resend:
                    detail = abandoned_detail(claim, max_attempts)
                    self.events.add(
                        row.pk, Kind.ABANDONED, row.token, row.task_id, row.owner, now, detail
                    )
                claims.append(claim)
        return claims
