"""What every dialect records the same way: events, the reclaimer's claims, grant reads.

Small reads and one-row writes through the ORM, where a database's own SQL would gain
nothing; the dialects call these helpers (composition), each on its own alias.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import Case, F, Q, When
from django.db.models.functions import Greatest, Now

from celery_fenced.models import Lease, LeaseEvent, ReclaimState
from celery_fenced.store.types import Claim

Kind = LeaseEvent.Kind
#: the database's clock, read by the dialect
Clock = Callable[[], dt.datetime]


class Events:
    """The lease events of the database ``alias``, written through the ORM."""

    def __init__(self, alias: str, now: Clock) -> None:
        self.alias = alias
        self.now = now

    def add(
        self,
        lease_id: int,
        kind: str,
        token: int | None,
        task_id: str,
        owner: str,
        at: dt.datetime | None,
        detail: dict[str, Any],
    ) -> None:
        """Add an event to the lease row ``lease_id`` (``at``: its time; None: now)."""
        LeaseEvent._default_manager.using(self.alias).create(
            lease_id=lease_id,
            kind=kind,
            token=token,
            task_id=task_id,
            owner=owner,
            at=at or self.now(),
            detail=detail,
        )

    def record(
        self,
        key: str,
        kind: str,
        token: int | None,
        task_id: str,
        owner: str,
        detail: dict[str, Any],
    ) -> None:
        """Add an event of ``kind`` to ``key``'s history (nothing if the key has no row)."""
        lease_id = (
            Lease._default_manager.using(self.alias)
            .filter(key=key)
            .values_list("pk", flat=True)
            .first()
        )
        if lease_id is not None:
            self.add(lease_id, kind, token, task_id, owner, None, detail)

    def record_deduplicated(
        self, key: str, task_name: str, standing: str, refused: str
    ) -> tuple[int | None, str]:
        """The ``deduplicated`` event of a refused call: on the key's lease row, which
        is created (token 0, released: never granted) if the standing copy has not
        started yet. Returns the key's current token (None before any grant) and owner."""
        leases = Lease._default_manager.using(self.alias)
        with transaction.atomic(using=self.alias):
            # the insert first: on SQLite a transaction that reads before it writes
            # cannot always take the write lock ("database is locked" at once)
            try:
                with transaction.atomic(using=self.alias):
                    lease = leases.create(
                        key=key,
                        token=0,
                        owner="",
                        task_name=task_name[:255],
                        acquired_at=Now(),
                        renewed_at=Now(),
                        expires_at=Now(),
                        released_at=Now(),
                    )
            except IntegrityError:
                lease = leases.get(key=key)
            self.add(
                lease.pk,
                Kind.DEDUPLICATED,
                lease.token or None,
                standing,
                "",
                None,
                {"refused_task_id": refused, "task_name": task_name},
            )
        return lease.token or None, lease.owner

    def add_deduplicated(
        self, key: str, task_name: str, standing: str, refused: str
    ) -> tuple[int | None, str]:
        """:meth:`record_deduplicated` inside a transaction that has written already (on
        SQLite, a transaction that reads before it writes cannot always take the write
        lock): the key's lease row read first, created only when missing; the event's
        time the database's, in the insert."""
        leases = Lease._default_manager.using(self.alias)
        found = leases.filter(key=key).values_list("pk", "token", "owner").first()
        if found is None:
            return self.record_deduplicated(key, task_name, standing, refused)
        lease_id, token, owner = found
        LeaseEvent._default_manager.using(self.alias).create(
            lease_id=lease_id,
            kind=Kind.DEDUPLICATED,
            token=token or None,
            task_id=standing,
            owner="",
            at=Now(),
            detail={"refused_task_id": refused, "task_name": task_name},
        )
        return token or None, owner


class GrantReads:
    """Reads of the grants held on the database ``alias``, by its clock."""

    def __init__(self, alias: str, now: Clock) -> None:
        self.alias = alias
        self.now = now

    def task_grants(self, task_id: str) -> list[tuple[str, int, str, bool]]:
        """``(key, token, owner, live)`` of every unreleased grant held for ``task_id``."""
        now = self.now()
        return [
            (key, token, owner, expires_at > now)
            for key, token, owner, expires_at in Lease._default_manager.using(self.alias)
            .filter(task_id=task_id, released_at__isnull=True)
            .values_list("key", "token", "owner", "expires_at")
        ]

    def expired_unclaimed(self, key: str, token: int) -> bool:
        """Whether ``token`` is ``key``'s grant, unreleased and expired by the DB clock."""
        return (
            Lease._default_manager.using(self.alias)
            .filter(key=key, token=token, released_at__isnull=True, expires_at__lte=self.now())
            .exists()
        )

    def end_unclaimed(self, key: str, token: int) -> bool:
        """Whether ``token`` is still ``key``'s unreleased grant; its expiry is moved back
        to its last renewal (nothing else changes: the key is free for a grant with a
        higher token).

        Back to the last renewal, not to now: a renewal already on its way was sent after
        that one, so its statement's time is later, and it finds the grant expired — set
        to now, a renewal whose statement began a moment earlier but reached the row
        after this would move the expiry forward again.
        """
        rows = Lease._default_manager.using(self.alias).filter(
            key=key, token=token, released_at__isnull=True
        )
        with transaction.atomic(using=self.alias):
            # the write first: it takes SQLite's write lock, PostgreSQL's and MariaDB's
            # row lock; the read then locks a row the write did not change
            rows.filter(expires_at__gt=F("renewed_at")).update(expires_at=F("renewed_at"))
            return rows.select_for_update().values_list("pk", flat=True).first() is not None


class Claims:
    """The reclaimer's bookkeeping on the lease rows of ``alias``: dry runs, undone claims,
    abandons and re-sends (each dialect claims in its own way)."""

    def __init__(self, alias: str, now: Clock, events: Events) -> None:
        self.alias = alias
        self.now = now
        self.events = events

    def expired_unfinished(
        self, *, grace: float, resend_after: float, max_attempts: int, limit: int
    ) -> list[Claim]:
        """What a claim would take now (:func:`claimable`), claiming nothing."""
        now = self.now()
        rows = (
            Lease._default_manager.using(self.alias)
            .filter(claimable(now, grace, resend_after))
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

    def unclaim(self, claim: Claim) -> bool:
        """Undo a claim whose job was not sent (or was revoked): the next sweep tries again."""
        # an abandoned claim too (an expired job's, whose REVOKED could not be recorded:
        # it is revoked, not abandoned); its re-send count was not raised
        resent = Q(reclaim_state=ReclaimState.RESENT)
        return bool(
            Lease._default_manager.using(self.alias)
            .filter(resent | Q(reclaim_state=ReclaimState.ABANDONED))
            .filter(pk=claim.lease_id, token=claim.token)
            .update(
                # first: MySQL assigns in order, and the condition reads reclaim_state
                reclaim_attempts=Case(
                    When(resent, then=Greatest(F("reclaim_attempts") - 1, 0)),
                    default=F("reclaim_attempts"),
                    output_field=Lease._meta.get_field("reclaim_attempts"),
                ),
                reclaim_state="",
            )
        )

    def abandon(self, claim: Claim, reason: str) -> bool:
        """Abandon a claimed lease whose job cannot be sent again, with its event."""
        with transaction.atomic(using=self.alias):
            updated = (
                Lease._default_manager.using(self.alias)
                .filter(pk=claim.lease_id, token=claim.token, reclaim_state=ReclaimState.RESENT)
                .update(reclaim_state=ReclaimState.ABANDONED)
            )
            if updated:
                detail = {"task": claim.task_name, "attempts": claim.attempts, "reason": reason}
                self.events.add(
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
        """The ``resent`` event of a claim whose job was sent again."""
        self.events.add(
            claim.lease_id, Kind.RESENT, claim.token, claim.task_id, claim.owner, None, detail
        )


def claimable(now: dt.datetime, grace: float, resend_after: float) -> Q:
    """The lease rows a reclaimer may claim now: expired unfinished grants with a job."""
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
