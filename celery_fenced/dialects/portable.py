"""The portable fallback: transactions with row locks through the ORM, any database."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

from django.db import connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import F, Q
from django.db.models.functions import Greatest
from django_celery_results.models import TaskResult

from celery_fenced.dialects.records import (
    COMPLETED_STATES,
    Claim,
    Completed,
    Delivery,
    Grant,
    Holder,
    Renewal,
    abandoned_detail,
    aware,
    completes,
    released_detail,
)
from celery_fenced.models import Lease, LeaseEvent


class Dialect:
    """Portable fallback: transactions with row locks through the ORM."""

    def __init__(self, alias: str) -> None:
        self.alias = alias

    @property
    def connection(self) -> BaseDatabaseWrapper:
        return connections[self.alias]

    # -- acquire ---------------------------------------------------------------------
    def acquire(
        self,
        key: str,
        ttl: float,
        owner: str,
        task_id: str,
        task_name: str,
        job: str | None = None,
        delivery: Delivery | None = None,
        window: float = 0.0,
    ) -> Grant | Holder | Completed:
        """Grant ``key``, or tell who holds it.

        With a ``delivery`` whose job already completed within ``window`` seconds (see
        :meth:`completed`) nothing is granted: :class:`Completed`. The lease row is
        locked before that is read, so a completion committing meanwhile is seen.
        """
        with transaction.atomic(using=self.alias):
            manager = Lease._default_manager.using(self.alias)
            row = manager.select_for_update().filter(key=key).first()
            if delivery is not None and delivery.task_id and self.completed(key, delivery, window):
                return Completed(task_id, delivery.retries)
            now = self.now()
            expires = now + dt.timedelta(seconds=ttl)
            if row is None:
                row = manager.create(
                    key=key,
                    token=1,
                    owner=owner,
                    task_id=task_id,
                    task_name=task_name,
                    acquired_at=now,
                    renewed_at=now,
                    expires_at=expires,
                    job=job,
                )
                reclaimed_from = ""
            elif row.released_at is None and row.expires_at > now:
                self._event(row.pk, "busy", row.token, task_id, owner, now, {"holder": row.owner})
                return Holder(
                    row.token, row.owner, row.expires_at, (row.expires_at - now).total_seconds()
                )
            else:
                reclaimed_from = row.owner if row.released_at is None else ""
                # a re-delivery of the same unfinished task keeps its reclaim count
                same_job = row.released_at is None and task_id != "" and row.task_id == task_id
                manager.filter(pk=row.pk).update(
                    token=F("token") + 1,
                    owner=owner,
                    task_id=task_id,
                    task_name=task_name,
                    acquired_at=now,
                    renewed_at=now,
                    expires_at=expires,
                    released_at=None,
                    reclaimed_from=reclaimed_from,
                    job=job,
                    reclaim_attempts=row.reclaim_attempts if same_job else 0,
                    reclaim_state="",
                    reclaim_claimed_at=row.reclaim_claimed_at if same_job else None,
                )
                row.refresh_from_db(fields=["token"])
            self._grant_event(row.pk, row.token, task_id, owner, now, reclaimed_from)
            return Grant(row.pk, row.token, expires, reclaimed_from)

    def now(self) -> dt.datetime:
        with self.connection.cursor() as cursor:
            cursor.execute("SELECT CURRENT_TIMESTAMP")
            row = cursor.fetchone()
        return aware(row[0])

    def _grant_event(
        self,
        lease_id: int,
        token: int,
        task_id: str,
        owner: str,
        now: dt.datetime,
        reclaimed_from: str,
    ) -> None:
        if reclaimed_from:
            self._event(
                lease_id,
                "reclaimed",
                token,
                task_id,
                owner,
                now,
                {"previous_owner": reclaimed_from, "previous_token": token - 1},
            )
        else:
            self._event(lease_id, "acquired", token, task_id, owner, now, {})

    def _event(
        self,
        lease_id: int,
        kind: str,
        token: int | None,
        task_id: str,
        owner: str,
        at: dt.datetime | None,
        detail: dict[str, Any],
    ) -> None:
        LeaseEvent._default_manager.using(self.alias).create(
            lease_id=lease_id,
            kind=kind,
            token=token,
            task_id=task_id,
            owner=owner,
            at=at or self.now(),
            detail=detail,
        )

    # -- renew -----------------------------------------------------------------------
    def renew(self, leases: Sequence[Renewal]) -> dict[tuple[str, int], dt.datetime]:
        """Extend every lease in ``leases`` still held; return the new expiry of each."""
        renewed: dict[tuple[str, int], dt.datetime] = {}
        with transaction.atomic(using=self.alias):
            now = self.now()
            for lease in leases:
                expires = now + dt.timedelta(seconds=lease.ttl)
                count = (
                    Lease._default_manager.using(self.alias)
                    .filter(
                        key=lease.key,
                        token=lease.token,
                        owner=lease.owner,
                        released_at__isnull=True,
                        expires_at__gt=now,
                    )
                    .update(renewed_at=now, expires_at=expires)
                )
                if count:
                    renewed[(lease.key, lease.token)] = expires
        return renewed

    # -- release ---------------------------------------------------------------------
    def release(
        self,
        key: str,
        token: int,
        owner: str,
        task_id: str,
        state: str = "",
        delivery: Delivery | None = None,
    ) -> bool:
        with transaction.atomic(using=self.alias):
            now = self.now()
            manager = Lease._default_manager.using(self.alias)
            row = (
                manager.select_for_update()
                .filter(key=key, token=token, owner=owner, released_at__isnull=True)
                .first()
            )
            if row is None:
                return False
            self._end(row.pk, token, task_id, owner, now, state, delivery)
            return True

    def _end(
        self,
        lease_id: int,
        token: int,
        task_id: str,
        owner: str,
        now: dt.datetime,
        state: str,
        delivery: Delivery | None,
    ) -> None:
        """Release a locked grant, mark its job completed if it is, record the event."""
        values: dict[str, Any] = {"released_at": now, "job": None}
        if delivery is not None and completes(state, delivery):
            values.update(
                completed_digest=delivery.digest,
                completed_retries=delivery.retries,
                completed_at=now,
            )
        Lease._default_manager.using(self.alias).filter(pk=lease_id).update(**values)
        self._event(
            lease_id, "released", token, task_id, owner, now, released_detail(state, delivery)
        )

    def force_release(
        self, key: str, by: str, task_id: str | None = None, token: int | None = None
    ) -> tuple[int, str] | None:
        """End the key's grant (only if it is ``task_id``'s, or ``token``, when given)."""
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
            self._event(
                row.pk, "force_released", row.token, row.task_id, row.owner, now, {"by": by}
            )
            return row.token, row.owner

    # -- reclaim ---------------------------------------------------------------------
    def claim_expired(
        self, *, grace: float, resend_after: float, max_attempts: int, limit: int
    ) -> list[Claim]:
        """Claim the expired, unfinished grants that have a job to re-send.

        A grant is claimed once per expiry: the claim sets ``reclaim_state``, which only
        the next grant clears (or ``resend_after`` seconds, when the re-sent job never
        started). A claim below ``max_attempts`` counts an attempt and is to be re-sent;
        one at the maximum abandons the lease with an ``abandoned`` event.
        """
        claims: list[Claim] = []
        with transaction.atomic(using=self.alias):
            now = self.now()
            manager = Lease._default_manager.using(self.alias)
            eligible = self._eligible(now, grace, resend_after)
            skip = self.connection.features.has_select_for_update_skip_locked
            rows = list(
                manager.select_for_update(skip_locked=skip)
                .filter(eligible)
                .order_by("expires_at")[:limit]
            )
            for row in rows:
                resend = row.reclaim_attempts < max_attempts
                attempts = row.reclaim_attempts + 1 if resend else row.reclaim_attempts
                state = "resent" if resend else "abandoned"
                if not manager.filter(eligible, pk=row.pk).update(
                    reclaim_attempts=attempts, reclaim_state=state, reclaim_claimed_at=now
                ):
                    continue
                claim = Claim(
                    row.pk,
                    row.key,
                    row.token,
                    row.owner,
                    row.task_id,
                    row.task_name,
                    row.job or "",
                    attempts,
                    state,
                )
                if not resend:
                    detail = abandoned_detail(claim, max_attempts)
                    self._event(
                        row.pk, "abandoned", row.token, row.task_id, row.owner, now, detail
                    )
                claims.append(claim)
        return claims

    def expired_unfinished(
        self, *, grace: float, resend_after: float, max_attempts: int, limit: int
    ) -> list[Claim]:
        """What :meth:`claim_expired` would claim now, claiming nothing (a dry run)."""
        now = self.now()
        rows = (
            Lease._default_manager.using(self.alias)
            .filter(self._eligible(now, grace, resend_after))
            .order_by("expires_at")[:limit]
        )
        return [
            Claim(
                row.pk,
                row.key,
                row.token,
                row.owner,
                row.task_id,
                row.task_name,
                row.job or "",
                min(row.reclaim_attempts + 1, max_attempts),
                "resent" if row.reclaim_attempts < max_attempts else "abandoned",
            )
            for row in rows
        ]

    @staticmethod
    def _eligible(now: dt.datetime, grace: float, resend_after: float) -> Q:
        return Q(
            released_at__isnull=True,
            job__isnull=False,
            expires_at__lt=now - dt.timedelta(seconds=grace),
        ) & (
            Q(reclaim_state="")
            | Q(
                reclaim_state="resent",
                reclaim_claimed_at__lt=now - dt.timedelta(seconds=resend_after),
            )
        )

    def unclaim(self, claim: Claim) -> bool:
        """Undo a claim whose job could not be sent, so that the next sweep tries again."""
        return bool(
            Lease._default_manager.using(self.alias)
            .filter(pk=claim.lease_id, token=claim.token, reclaim_state="resent")
            .update(reclaim_state="", reclaim_attempts=Greatest(F("reclaim_attempts") - 1, 0))
        )

    def abandon(self, claim: Claim, reason: str) -> bool:
        """Abandon a claimed lease whose job cannot be sent again (e.g. unreadable)."""
        with transaction.atomic(using=self.alias):
            updated = (
                Lease._default_manager.using(self.alias)
                .filter(pk=claim.lease_id, token=claim.token, reclaim_state="resent")
                .update(reclaim_state="abandoned")
            )
            if updated:
                detail = {"task": claim.task_name, "attempts": claim.attempts, "reason": reason}
                self._event(
                    claim.lease_id,
                    "abandoned",
                    claim.token,
                    claim.task_id,
                    claim.owner,
                    None,
                    detail,
                )
        return bool(updated)

    def record_resent(self, claim: Claim, detail: dict[str, Any]) -> None:
        """The ``resent`` event of a claim whose job was sent again."""
        self._event(
            claim.lease_id, "resent", claim.token, claim.task_id, claim.owner, None, detail
        )

    # -- completed duplicates ----------------------------------------------------------
    def completed(self, key: str, delivery: Delivery, window: float) -> bool:
        """Whether ``delivery``'s job completed within the last ``window`` seconds.

        Completed: released as SUCCESS or FAILURE under its lease, by a delivery of the
        same task id and message (``digest``) retried at least as often. A delivery
        whose ``retries`` is above the completed one's is a retry the body asked for
        before that execution ended: it is not a duplicate. Read from the lease row's
        marker (the key's last completed job) and from the ``released`` events (jobs
        completed under the key before another job used it), as far back as ``prune``
        keeps them.
        """
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
            LeaseEvent._default_manager.using(self.alias)
            .filter(
                task_id=delivery.task_id,
                kind=LeaseEvent.Kind.RELEASED,
                detail__state__in=COMPLETED_STATES,
                detail__retries__gte=delivery.retries,
                detail__digest=delivery.digest,
                at__gt=since,
            )
            .exists()
        )

    # -- fencing ---------------------------------------------------------------------
    def prove_current(self, key: str, token: int) -> tuple[bool, int | None]:
        """Lock the lease row and tell whether ``token`` is its current, unexpired grant.

        Must run inside a transaction: the lock is held until it ends, so no newer grant
        can be issued before the caller's writes commit. Returns ``(ok, current_token)``.
        """
        lease_id, current = self._lock_if_current(key, token, self.now())
        return lease_id is not None, current

    def _lock_if_current(
        self, key: str, token: int, now: dt.datetime, *, expired_ok: bool = False
    ) -> tuple[int | None, int | None]:
        """Lock ``key``'s row; its id if ``token`` is its unreleased, unexpired grant.

        With ``expired_ok`` an expired grant with no successor counts too. Returns
        ``(lease id or None, the key's current token or None)``.
        """
        row = (
            Lease._default_manager.using(self.alias)
            .select_for_update()
            .filter(key=key)
            .values_list("pk", "token", "released_at", "expires_at")
            .first()
        )
        if row is None:
            return None, None
        lease_id, current, released_at, expires_at = row
        is_current = current == token and released_at is None and (expired_ok or expires_at > now)
        return (lease_id if is_current else None), current

    def release_current(
        self,
        key: str,
        token: int,
        owner: str,
        task_id: str,
        state: str = "",
        delivery: Delivery | None = None,
    ) -> tuple[bool, int | None]:
        """Prove ``token`` current and end its grant, in one step; ``(ok, current_token)``.

        The key's token, not released — a grant that expired with no successor is still
        this execution's (nobody holds a newer token). When it holds, the grant is
        released and its ``released`` event recorded, and the lease row stays locked
        until the caller's transaction ends: a write that fails after it rolls the
        release back too. Must run inside a transaction. The result write of a final
        state opens with it, and it takes ``task_id``'s result lock (:meth:`lock_for_result`).
        """
        now = self.now()
        lease_id, current = self._lock_if_current(key, token, now, expired_ok=True)
        if lease_id is None:
            return False, current
        self._end(lease_id, token, task_id, owner, now, state, delivery)
        self.lock_for_result(task_id)
        return True, current

    def task_grants(self, task_id: str) -> list[tuple[str, int, str]]:
        """``(key, token, owner)`` of every unreleased grant held for ``task_id``."""
        return list(
            Lease._default_manager.using(self.alias)
            .filter(task_id=task_id, released_at__isnull=True)
            .values_list("key", "token", "owner")
        )

    def expired_unclaimed(self, key: str, token: int) -> bool:
        """Whether ``token`` is ``key``'s grant, unreleased and expired by the DB clock."""
        return (
            Lease._default_manager.using(self.alias)
            .filter(key=key, token=token, released_at__isnull=True, expires_at__lte=self.now())
            .exists()
        )

    def lock_for_result(self, task_id: str) -> None:
        """Serialize the result writes of ``task_id`` until the transaction ends.

        The fenced write takes it after proving its token; an untokened write takes it
        before deciding whether it may write, so the decision and the write are atomic.
        Here: the result row's lock, where the database has row locks.
        """
        list(
            TaskResult._default_manager.using(self.alias)
            .select_for_update()
            .filter(task_id=task_id)
            .values_list("pk", flat=True)
        )

    def record_event(
        self,
        key: str,
        kind: str,
        token: int | None,
        task_id: str,
        owner: str,
        detail: dict[str, Any],
    ) -> None:
        lease_id = (
            Lease._default_manager.using(self.alias)
            .filter(key=key)
            .values_list("pk", flat=True)
            .first()
        )
        if lease_id is not None:
            self._event(lease_id, kind, token, task_id, owner, None, detail)

    def estimated_rows(self, table: str) -> int | None:
        """The planner's estimate of ``table``'s size, where the database keeps one."""
        return None

    def is_current(self, key: str, token: int, owner: str) -> bool:
        now = self.now()
        return (
            Lease._default_manager.using(self.alias)
            .filter(
                key=key, token=token, owner=owner, released_at__isnull=True, expires_at__gt=now
            )
            .exists()
        )
