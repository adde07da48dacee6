"""Operations every dialect shares: one-row bookkeeping no database does better in SQL."""

from __future__ import annotations

import datetime as dt
from typing import Any

from django.db import transaction
from django.db.models import F, Q
from django.db.models.functions import Greatest, Now

from celery_fenced.models import Lease, LeaseEvent, PendingJob, ReclaimState
from celery_fenced.store.dialects.base import Dialect
from celery_fenced.store.dialects.records import (
    Claim,
    Pending,
)

Kind = LeaseEvent.Kind


class PortableOperations(Dialect):
    """Operations every dialect takes from here: small reads and one-row updates of the
    reclaimer's bookkeeping, where a database's own SQL would gain nothing."""

    def record_pending(self, pending: Pending) -> None:
        """The outbox's row of a published job, written or replaced (same task id)."""
        countdown = dt.timedelta(seconds=pending.countdown or 0.0)
        eta = pending.eta if pending.eta is not None else Now() + countdown
        expires = pending.expires
        values = {
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
        }
        rows = PendingJob._default_manager.using(self.alias)
        with transaction.atomic(using=self.alias):
            if not rows.filter(task_id=pending.task_id).update(**values):
                rows.create(task_id=pending.task_id, **values)

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

    def task_grants(self, task_id: str) -> list[tuple[str, int, str, bool]]:
        now = self.now()
        return [
            (key, token, owner, expires_at > now)
            for key, token, owner, expires_at in Lease._default_manager.using(self.alias)
            .filter(task_id=task_id, released_at__isnull=True)
            .values_list("key", "token", "owner", "expires_at")
        ]

    def expired_unclaimed(self, key: str, token: int) -> bool:
        return (
            Lease._default_manager.using(self.alias)
            .filter(key=key, token=token, released_at__isnull=True, expires_at__lte=self.now())
            .exists()
        )

    def expired_unfinished(
        self, *, grace: float, resend_after: float, max_attempts: int, limit: int
    ) -> list[Claim]:
        now = self.now()
        rows = (
            Lease._default_manager.using(self.alias)
            .filter(self._eligible(now, grace, resend_after))
            .order_by("expires_at")[:limit]
        )
        return [
            Claim.of_lease(
                row,
                min(row.reclaim_attempts + 1, max_attempts),
                ReclaimState.RESENT
                if row.reclaim_attempts < max_attempts
                else ReclaimState.ABANDONED,
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
                reclaim_state=ReclaimState.RESENT,
                reclaim_claimed_at__lt=now - dt.timedelta(seconds=resend_after),
            )
        )

    def unclaim(self, claim: Claim) -> bool:
        return bool(
            Lease._default_manager.using(self.alias)
            .filter(pk=claim.lease_id, token=claim.token, reclaim_state=ReclaimState.RESENT)
            .update(reclaim_state="", reclaim_attempts=Greatest(F("reclaim_attempts") - 1, 0))
        )

    def abandon(self, claim: Claim, reason: str) -> bool:
        with transaction.atomic(using=self.alias):
            updated = (
                Lease._default_manager.using(self.alias)
                .filter(pk=claim.lease_id, token=claim.token, reclaim_state=ReclaimState.RESENT)
                .update(reclaim_state=ReclaimState.ABANDONED)
            )
            if updated:
                detail = {"task": claim.task_name, "attempts": claim.attempts, "reason": reason}
                self._event(
                    claim.lease_id,
                    Kind.ABANDONED,
                    claim.token,
                    claim.task_id,
                    claim.owner,
                    None,
                    detail,
                )
        return bool(updated)

    def record_resent(self, claim: Claim, detail: dict[str, Any]) -> None:
        self._event(
            claim.lease_id, Kind.RESENT, claim.token, claim.task_id, claim.owner, None, detail
        )
