"""Helpers of the dialects: reading the database's timestamps, the details of events."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

from django.utils.dateparse import parse_datetime

from celery_fenced.store.types import COMPLETED_STATES, Claim, Delivery, Holder


def aware(value: Any) -> dt.datetime:
    """A timestamp the database returned, as an aware datetime (naive ones are UTC)."""
    if isinstance(value, str):
        parsed = parse_datetime(value)
        if parsed is None:  # pragma: no cover - the database wrote it
            raise ValueError(f"unparseable timestamp {value!r}")
        value = parsed
    if not isinstance(value, dt.datetime):  # pragma: no cover - the database wrote it
        raise TypeError(f"expected a timestamp, got {value!r}")
    if value.tzinfo is None:
        return value.replace(tzinfo=dt.timezone.utc)
    return value


#: the reason of an abandon at the maximum number of re-sends
TOO_MANY = "the job expired unfinished after the maximum number of re-sends"


def abandoned_detail(claim: Claim, max_attempts: int) -> dict[str, Any]:
    """The detail of the ``abandoned`` event of a claim at ``max_attempts``."""
    return {
        "task": claim.task_name,
        "attempts": claim.attempts,
        "max": max_attempts,
        "reason": TOO_MANY,
    }


def released_detail(state: str, delivery: Delivery | None = None) -> dict[str, Any]:
    """The detail of a ``released`` event: the final state and the delivery it ended."""
    detail: dict[str, Any] = {"state": state} if state else {}
    if delivery is not None:
        detail["retries"] = delivery.retries
        detail["digest"] = delivery.digest
    return detail


def completes(state: str, delivery: Delivery | None) -> bool:
    """Whether a release in ``state`` marks ``delivery``'s job completed."""
    return delivery is not None and state in COMPLETED_STATES


def holder_of(rows: Sequence[Sequence[Any]]) -> Holder:
    """The holder of a busy key from its ``(token, owner, expires_at, remaining)`` row."""
    if not rows:
        # The row was released between the two statements: report a zero wait.
        return Holder(0, "", dt.datetime.now(dt.timezone.utc), 0.0)
    token, owner, expires_at, remaining = rows[0]
    return Holder(token, owner, aware(expires_at), float(remaining))
