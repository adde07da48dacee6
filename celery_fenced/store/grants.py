"""Grants of a key: acquire, force-release, and what the others ask of a key's grants."""

from __future__ import annotations

import datetime as dt
import logging
import time
from typing import Any

from django.db import transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import F

from celery_fenced import conf, permits, signals, validators
from celery_fenced.exceptions import AlreadyCompleted, FencedConfigurationError, LeaseBusy
from celery_fenced.models import Lease, LeaseEvent
from celery_fenced.store import dialects
from celery_fenced.store.held import HeldLease
from celery_fenced.store.outbox import forget_pending
from celery_fenced.store.types import Completed, Delivery, Grant, GrantRequest, Holder
from celery_fenced.store.validation import (
    database_alias,
    default_owner,
    validate_key,
    validate_lease_key,
    validate_owner,
    validate_ttl,
)
from celery_fenced.tables import tables_required

logger = logging.getLogger("celery_fenced.store")


def acquire(
    key: str,
    *,
    ttl: float,
    owner: str | None = None,
    task_id: str = "",
    task_name: str = "",
    using: str | None = None,
    renew_interval: float | None = None,
    limit: int | None = None,
) -> HeldLease:
    """Take the lease on ``key`` for ``ttl`` seconds, or raise :class:`LeaseBusy`.

    One atomic statement grants the lease when the key is free, released or expired
    (by the database's clock) and issues the next fencing token.

    ``owner``: who holds it (default: this process and thread); ``task_id`` and
    ``task_name``: what the grant is recorded for (the admin shows them); ``using``: the
    lease database's alias (default: ``fenced_database``); ``renew_interval``: how often
    :func:`celery_fenced.renewal.renewer` renews it, when registered there.

    ``limit`` (``lease_limit``): grant one of that many permits of ``key``; the lease
    held is the permit's row (its ``key`` names the permit: :mod:`celery_fenced.permits`).
    Busy when ``limit`` permits are held.
    """
    return grant(
        key,
        ttl=ttl,
        owner=owner,
        task_id=task_id,
        task_name=task_name,
        using=using,
        renew_interval=renew_interval,
        limit=limit,
    )


def grant(
    key: str,
    *,
    ttl: float,
    owner: str | None = None,
    task_id: str = "",
    task_name: str = "",
    using: str | None = None,
    renew_interval: float | None = None,
    limit: int | None = None,
    job: str | None = None,
    delivery: Delivery | None = None,
    connection: BaseDatabaseWrapper | None = None,
    ends_pending: bool = False,
    stamps_started: bool = False,
    settings: conf.FencedSettings | None = None,
) -> HeldLease:
    """:func:`acquire`, with what a task execution's grant carries besides (internal).

    ``job`` (the encoded job of a task execution, see :mod:`celery_fenced.reclaim`) is
    stored by the granting statement, so the reclaimer can send it again if the grant
    expires unfinished.

    ``delivery`` (a task delivery: task id, message digest, retry count) makes the same
    statement refuse a job that already completed under its lease within
    ``fenced_duplicate_window``, raising
    :class:`~celery_fenced.exceptions.AlreadyCompleted` (see
    :meth:`celery_fenced.store.dialects.Dialect.completed`); a release of this grant as
    SUCCESS, FAILURE (or REPLACED) marks it completed.

    ``connection``: the connection to send the grant on (default: Django's for the alias).
    ``ends_pending``: the grant, a busy key or a completed duplicate ends ``task_id``'s
    pending row (:mod:`celery_fenced.store.outbox`), in the granting statement;
    ``stamps_started`` (a ``lease_unique="until_done"`` task): the grant keeps the row,
    stamped with its token, instead. ``settings``: the settings already loaded by the
    caller (default: loaded here).
    """
    key = validate_key(key)
    limit = validators.validate_limit(limit, "limit")
    seconds = validate_ttl(ttl)
    owner = validate_owner(owner) if owner is not None else default_owner()
    settings = settings or conf.load()
    alias = database_alias(using, settings)
    window = settings.duplicate_window if delivery is not None else 0.0
    routine = settings.routine_events
    sent = time.monotonic()
    with tables_required(alias):
        outcome = dialects.for_alias(alias, connection=connection).acquire(
            GrantRequest(
                key,
                seconds,
                owner,
                task_id,
                task_name,
                job,
                delivery,
                window,
                routine,
                ends_pending and bool(task_id),
                stamps_started,
                limit,
            )
        )
    if isinstance(outcome, Completed):
        if ends_pending and task_id:
            forget_pending(alias, task_id, up_to=delivery.nesting if delivery else 0)
        raise AlreadyCompleted(key, task_id, outcome.retries)
    if isinstance(outcome, Holder):
        if limit is None and not outcome.owner:  # a head of permits has no owner
            _refuse_permits_key(alias, key)
        signals.send(
            signals.lease_busy,
            Lease,
            key=key,
            token=outcome.token,
            owner=owner,
            task_id=task_id,
            task_name=task_name,
            holder=outcome.owner,
        )
        raise LeaseBusy(
            key,
            holder=outcome.owner,
            token=outcome.token,
            expires_at=outcome.expires_at,
            remaining=outcome.remaining,
        )
    lease = HeldLease(
        key=outcome.key or key,
        token=outcome.token,
        owner=owner,
        expires_at=outcome.expires_at,
        ttl=seconds,
        alias=alias,
        task_id=task_id,
        task_name=task_name,
        reclaimed_from=outcome.reclaimed_from,
        renew_interval=renew_interval,
        delivery=delivery,
        confirmed_at=sent,
        routine_events=routine,
        row_marker=outcome.marker,
    )
    signals.send(
        signals.lease_acquired,
        Lease,
        key=lease.key,
        token=lease.token,
        owner=owner,
        task_id=task_id,
        task_name=task_name,
        reclaimed_from=outcome.reclaimed_from,
        takeover_delay=_takeover_delay(outcome, seconds),
    )
    logger.debug("lease acquired", extra=lease._log_extra())
    return lease


def _takeover_delay(grant: Grant, ttl: float) -> float | None:
    """Seconds from the expiry of the grant a takeover took over to the takeover, by the
    database's clock (the new grant began ``ttl`` before its expiry)."""
    if not grant.reclaimed_from or grant.previous_expires_at is None:
        return None
    began = grant.expires_at - dt.timedelta(seconds=ttl)
    return max((began - grant.previous_expires_at).total_seconds(), 0.0)


def _refuse_permits_key(alias: str, key: str) -> None:
    """A grant of one holder on a key that has permits would sit beside their holders."""
    head = Lease._default_manager.using(alias).filter(key=key, permits__gt=0)
    permits = head.values_list("permits", flat=True).first()
    if permits:
        raise FencedConfigurationError(
            f"lease {key!r} has permits (lease_limit={permits}): a grant without a limit "
            "cannot take it; give the task (or the acquire call) lease_limit / limit too"
        )


def force_release(key: str, *, by: str | None = None, using: str | None = None) -> int | None:
    """End the current grant on ``key`` and fence its holder out.

    The holder's next renew, guard or result write fails. Returns the token that was
    ended, or None when nothing was held. The next grant gets a higher token.
    """
    key = validate_lease_key(key)  # a permit's too
    alias = database_alias(using)
    ended = dialects.for_alias(alias).force_release(key, by or "")
    if ended is None:
        return None
    token, owner = ended
    logger.warning(
        "lease %r force-released (token %s, holder %s) by %s",
        key,
        token,
        owner,
        by or "-",
        extra={"lease_key": key, "fencing_token": token, "lease_owner": owner},
    )
    signals.send(
        signals.lease_released, Lease, key=key, token=token, owner=owner, task_id="", forced=True
    )
    return token


def expire(key: str, *, using: str | None = None) -> int | None:
    """End the current grant on ``key`` by expiry, as when its holder stops renewing.

    Its expiry becomes its grant time, which the database's clock has passed: the next
    grant takes the key over (a ``reclaimed`` event), the holder's next renewal, guard or
    check fails, and a result written under it is refused once another grant holds the key.
    Returns the token that expired, or None when nothing was held. For tests
    (:mod:`celery_fenced.testing`); an operator ends a grant with :func:`force_release`.
    """
    key = validate_lease_key(key)
    alias = database_alias(using)
    unreleased = Lease._default_manager.using(alias).filter(key=key, released_at__isnull=True)
    with transaction.atomic(using=alias):
        token = unreleased.select_for_update().values_list("token", flat=True).first()
        if token is None:
            return None
        unreleased.filter(token=token).update(expires_at=F("acquired_at"))
    logger.info(
        "lease %r expired under token %s",
        key,
        token,
        extra={"lease_key": key, "fencing_token": token},
    )
    return int(token)


def expired_unclaimed(lease: HeldLease) -> bool:
    """True when ``lease``'s grant expired (by the database's clock) and nobody took over.

    Its token is still the key's, it was never released: the job can be retried at once
    under the same task id without anyone's work being lost.
    """
    return dialects.for_alias(lease.alias).expired_unclaimed(lease.key, lease.token)


def end_unclaimed(lease: HeldLease) -> bool:
    """True when ``lease``'s token is still its key's and was never released: nobody took
    over and nobody ended it. Its expiry goes back to its last renewal (unreleased: its
    job is not done), so that a retry of its job can take the key at once with a higher
    token, and a renewal already on its way renews nothing.

    For a holder that learned its grant is gone while the row says it still runs: its
    local deadline came a moment before the database's, or a renewal sent before the
    expiry reached the row after a proof had refused the token.
    """
    return dialects.for_alias(lease.alias).end_unclaimed(lease.key, lease.token)


def grant_of(key: str, *, using: str | None = None) -> tuple[str, bool] | None:
    """``(task_id, ended)`` of ``key``'s current or last grant, or None."""
    row = (
        Lease._default_manager.using(database_alias(using))
        .filter(key=key)
        .values_list("task_id", "released_at")
        .first()
    )
    return None if row is None else (row[0], row[1] is not None)


def token_of(key: str, *, using: str | None = None) -> int | None:
    """The token of ``key``'s current or last grant, or None (no row)."""
    return (
        Lease._default_manager.using(database_alias(using))
        .filter(key=key)
        .values_list("token", flat=True)
        .first()
    )


def granted_again(lease_key: str, task_id: str, token: int, *, using: str | None = None) -> bool:
    """Whether ``task_id``'s job was granted another permit of the key since its grant
    ``token`` on permit row ``lease_key`` (a redelivery that found another permit free):
    that execution, not this one, records the job's outcome. False for a plain lease."""
    rows = Lease._default_manager.using(database_alias(using))
    names = _permits_of(rows, lease_key)
    if names is None or not task_id:
        return False
    return rows.filter(key__in=names, task_id=task_id, token__gt=token).exists()


def _permits_of(rows: Any, lease_key: str) -> list[str] | None:
    """The row keys of every permit of a permit row's key (``lease_key``'s included);
    None for a plain lease's key."""
    key, index = permits.split(lease_key)
    if index is None:
        return None
    head = rows.filter(key=key).values_list("permits", flat=True).first() or 0
    return [permits.permit_key(key, i) for i in range(max(head, index + 1))]


def grant_live_since(key: str, token: int, task_id: str, *, using: str | None = None) -> bool:
    """Whether ``key`` is granted to ``task_id``, unreleased, under ``token`` or a newer one.

    Another job's grant of the key does not count: it will never record ``task_id``'s
    outcome.
    """
    rows = Lease._default_manager.using(database_alias(using))
    keys = _permits_of(rows, key) or [key]  # a permit's: the job on any permit of the key
    return rows.filter(
        key__in=keys, token__gte=token, task_id=task_id, released_at__isnull=True
    ).exists()


def record_duplicate(
    key: str, task_id: str, owner: str, detail: dict[str, Any], *, using: str | None = None
) -> None:
    """The ``duplicate`` event (and signal) of a delivery skipped because its job
    already completed."""
    dialects.for_alias(database_alias(using)).record_event(
        key, LeaseEvent.Kind.DUPLICATE, None, task_id, owner, detail
    )
    signals.send(
        signals.lease_duplicate,
        Lease,
        key=key,
        token=None,
        owner=owner,
        task_id=task_id,
        task_name=detail.get("task", ""),
        retries=detail.get("retries"),
    )


def database_now(using: str | None = None) -> dt.datetime:
    """The lease database's clock."""
    return dialects.for_alias(database_alias(using)).now()


def estimated_rows(alias: str, table: str) -> int | None:
    """The planner's estimate of ``table``'s size on ``alias``, where it keeps one."""
    return dialects.for_alias(alias).estimated_rows(table)
