"""The reclaimer's bookkeeping on the lease rows: claim, abandon, un-claim, record."""

from __future__ import annotations

from typing import Any

from celery_fenced.store import dialects
from celery_fenced.store.types import Claim


def claim_expired(
    alias: str, *, grace: float, resend_after: float, max_attempts: int, limit: int
) -> list[Claim]:
    """Claim up to ``limit`` expired, unfinished grants that have a job to re-send.

    See :meth:`celery_fenced.store.dialects.Dialect.claim_expired`.
    """
    return dialects.for_alias(alias).claim_expired(
        grace=grace, resend_after=resend_after, max_attempts=max_attempts, limit=limit
    )


def expired_unfinished(
    alias: str, *, grace: float, resend_after: float, max_attempts: int, limit: int
) -> list[Claim]:
    """What :func:`claim_expired` would claim now, claiming nothing (a dry run)."""
    return dialects.for_alias(alias).expired_unfinished(
        grace=grace, resend_after=resend_after, max_attempts=max_attempts, limit=limit
    )


def abandon(alias: str, claim: Claim, reason: str) -> bool:
    """Abandon a claimed lease whose job cannot be sent again (e.g. unreadable)."""
    return dialects.for_alias(alias).abandon(claim, reason)


def unclaim(alias: str, claim: Claim) -> bool:
    """Undo a claim whose job could not be sent, so that the next sweep tries again."""
    return dialects.for_alias(alias).unclaim(claim)


def record_resent(alias: str, claim: Claim, detail: dict[str, Any]) -> None:
    """The ``resent`` event of a claim whose job was sent again."""
    dialects.for_alias(alias).record_resent(claim, detail)


def end_claimed(alias: str, claim: Claim, by: str) -> bool:
    """End a claimed grant that will not be sent again (its job expired): force-released
    if it is still the key's, unreleased, under the claimed token (its ``force_released``
    event says ``by``); False when it ended meanwhile."""
    ended = dialects.for_alias(alias).force_release(
        claim.key, by, task_id=claim.task_id, token=claim.token
    )
    return ended is not None
