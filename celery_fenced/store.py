"""The lease store: acquire, renew, release, force-release and guard.

Usable without Celery::

    lease = acquire("report:42", ttl=30)
    with lease.guard():
        Report.objects.filter(pk=42).update(...)
    lease.release()
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.db import connections, router, transaction

from celery_fenced import conf, dialects, signals
from celery_fenced.context import _guards
from celery_fenced.exceptions import (
    AlreadyCompleted,
    FencedError,
    LeaseBusy,
    LeaseLost,
    StaleToken,
)
from celery_fenced.models import KEY_MAX_LENGTH, OWNER_MAX_LENGTH, Lease
from celery_fenced.schema import tables_required

logger = logging.getLogger(__name__)


def database_alias(using: str | None = None) -> str:
    """The database alias of the lease table: ``using``, ``fenced_database`` or the router's."""
    if using is not None:
        return using
    configured = conf.load().database
    return configured or router.db_for_write(Lease)


def default_owner() -> str:
    """``host:pid:thread:random`` — unique per call, readable in the admin."""
    return (
        f"{socket.gethostname()}:{os.getpid()}:{threading.get_ident() % 100000}:"
        f"{uuid.uuid4().hex[:8]}"
    )


def validate_key(key: object) -> str:
    if not isinstance(key, str) or not key:
        raise ValueError(f"key must be a non-empty string, got {key!r}")
    if len(key) > KEY_MAX_LENGTH:
        raise ValueError(
            f"key must be at most {KEY_MAX_LENGTH} characters, got {len(key)}: {key[:40]!r}…"
        )
    if "\x00" in key:
        raise ValueError(
            f"key must not contain NUL characters ('\\x00'; PostgreSQL cannot store them), "
            f"got {key[:40]!r}"
        )
    return key


def validate_owner(owner: object) -> str:
    if not isinstance(owner, str) or not owner:
        raise ValueError(f"owner must be a non-empty string, got {owner!r}")
    if len(owner) > OWNER_MAX_LENGTH:
        raise ValueError(f"owner must be at most {OWNER_MAX_LENGTH} characters, got {len(owner)}")
    return owner


def validate_ttl(ttl: object) -> float:
    try:
        return conf.validate_ttl(ttl, "ttl")
    except FencedError as exc:
        raise ValueError(str(exc)) from None


#: why a lease is lost when no renewal confirmed it within its ttl (its local deadline)
UNRENEWED = "the database was unreachable until the grant expired (no renewal within the ttl)"


class HeldLease:
    """A granted lease: the key, its fencing token and the operations of its holder."""

    def __init__(
        self,
        *,
        key: str,
        token: int,
        owner: str,
        expires_at: dt.datetime,
        ttl: float,
        alias: str,
        task_id: str = "",
        reclaimed_from: str = "",
        renew_interval: float | None = None,
        delivery: dialects.Delivery | None = None,
    ) -> None:
        self.key = key
        self.token = token
        self.owner = owner
        self.expires_at = expires_at
        self.ttl = ttl
        self.alias = alias
        self.task_id = task_id
        self.reclaimed_from = reclaimed_from
        #: the task delivery this grant is for: its completion is marked at release
        self.delivery = delivery
        self.renew_interval = renew_interval if renew_interval is not None else ttl / 3
        self.released = False
        self._lost_reason: str | None = None
        # monotonic time when the last successful grant/renewal statement was *sent*:
        # the grant is known to run until at least this + ttl
        self._confirmed_at = time.monotonic()
        # when check() last found the grant current in the database (not a renewal)
        self._checked_at = self._confirmed_at
        self._deadline_passed = False
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        state = "lost" if self.lost else "released" if self.released else "held"
        return f"<HeldLease {self.key!r} token={self.token} {state}>"

    @property
    def lost(self) -> bool:
        """True once the grant is gone, or may be: its local deadline passed unrenewed.

        The deadline needs no answer from the database: a renewal that hangs (a locked
        row, a stalled connection) cannot keep a lease looking held. Once true it stays
        true; a lease released by its holder is not lost.
        """
        if self._lost_reason is not None or self._deadline_passed:
            return True
        if self.released or time.monotonic() < self.local_deadline:
            return False
        self._deadline_passed = True
        return True

    @property
    def lost_reason(self) -> str | None:
        if self._lost_reason is None and self.lost:
            return UNRENEWED
        return self._lost_reason

    @property
    def local_deadline(self) -> float:
        """Monotonic time until which the grant is known to run: the last confirmed
        renewal (when its statement was sent) plus the ttl. Past it, it may have expired."""
        return self._confirmed_at + self.ttl

    def renew(self) -> dt.datetime:
        """Extend the grant by its ttl. Raises :class:`LeaseLost` if it is no longer held."""
        self._raise_if_lost()
        sent = time.monotonic()
        renewed = dialects.for_alias(self.alias).renew(
            [dialects.Renewal(self.key, self.token, self.owner, self.ttl)]
        )
        self.confirm_renewal(sent, renewed.get((self.key, self.token)))
        self._raise_if_lost()
        return self.expires_at

    def confirm_renewal(
        self, sent: float, expires_at: dt.datetime | None, *, time_limit: float | None = None
    ) -> None:
        """Record the outcome of a renewal statement sent at monotonic time ``sent``."""
        if expires_at is None:
            self.mark_lost(
                "renewal refused: the grant expired, was released or taken over",
                time_limit=time_limit,
            )
            return
        with self._lock:
            self.expires_at = expires_at
            self._confirmed_at = max(self._confirmed_at, sent)

    def release(self, *, state: str = "") -> bool:
        """End the grant. Returns False (and marks the lease lost) if it was already gone.

        ``state`` (the task's final state, when known) is recorded on the event.
        """
        if self.released:
            return True
        ok = dialects.for_alias(self.alias).release(
            self.key, self.token, self.owner, self.task_id, state, self.delivery
        )
        if ok:
            self.ended()
        else:
            self.released = True
            self.mark_lost("release refused: the grant had already ended")
        return ok

    def ended(self) -> None:
        """This grant's release has committed: mark it released and tell the receivers."""
        self.released = True
        signals.send(
            signals.lease_released,
            Lease,
            key=self.key,
            token=self.token,
            owner=self.owner,
            task_id=self.task_id,
            forced=False,
        )
        logger.debug("lease released", extra=self._log_extra())

    def check(self) -> None:
        """Raise :class:`LeaseLost` if the grant was taken away.

        Cheap while renewals keep confirming the grant; when none has for a renewal
        interval (a paused process, a stalled renewer) it asks the database.
        """
        self._raise_if_lost()
        if self.released:
            raise LeaseLost(self.key, self.token, "released")
        if time.monotonic() - max(self._confirmed_at, self._checked_at) > self.renew_interval:
            sent = time.monotonic()
            if dialects.for_alias(self.alias).is_current(self.key, self.token, self.owner):
                # current now, which says nothing of later: the local deadline stays
                with self._lock:
                    self._checked_at = max(self._checked_at, sent)
            else:
                self.mark_lost("the grant expired, was released or taken over")
        self._raise_if_lost()

    @contextmanager
    def guard(self) -> Iterator[HeldLease]:
        """A transaction whose writes commit only if this token is still current.

        Locks the lease row (PostgreSQL) or the database (SQLite) first, so no newer
        grant can be issued before the writes commit. Raises :class:`StaleToken` and
        rolls back when the token is no longer current.
        """
        with fenced_transaction(self.key, self.token, using=self.alias, lease=self):
            yield self

    def mark_lost(
        self, reason: str, *, time_limit: float | None = None, record: bool = True
    ) -> None:
        """Mark the grant lost, once: log, record a ``lost`` event, send ``lease_lost``.

        ``time_limit`` (seconds; the renewer's thread) bounds the event's write, which a
        lock on the lease row would otherwise hold up; ``record=False`` writes no event.
        """
        with self._lock:
            if self._lost_reason is not None or self.released:
                if self._lost_reason is None:
                    self._lost_reason = reason
                return
            self._lost_reason = reason
        logger.warning(
            "lease %r lost under token %s: %s",
            self.key,
            self.token,
            reason,
            extra=self._log_extra(),
        )
        try:
            if record:
                with time_limited(self.alias, time_limit):
                    dialects.for_alias(self.alias).record_event(
                        self.key, "lost", self.token, self.task_id, self.owner, {"reason": reason}
                    )
        except Exception:  # the database may be what failed; the event is best effort
            logger.info("could not record the lost event for %r", self.key, exc_info=True)
        signals.send(
            signals.lease_lost,
            Lease,
            key=self.key,
            token=self.token,
            owner=self.owner,
            task_id=self.task_id,
            reason=reason,
        )

    def _raise_if_lost(self) -> None:
        if self._lost_reason is None and self.lost:  # the local deadline passed unrenewed
            # logged and signalled here; no statement: the database may be what hangs
            self.mark_lost(UNRENEWED, record=False)
        if self.lost:
            raise LeaseLost(self.key, self.token, self.lost_reason or UNRENEWED)

    def _log_extra(self) -> dict[str, Any]:
        return {"lease_key": self.key, "fencing_token": self.token, "lease_owner": self.owner}


def acquire(
    key: str,
    *,
    ttl: float,
    owner: str | None = None,
    task_id: str = "",
    task_name: str = "",
    using: str | None = None,
    renew_interval: float | None = None,
    job: str | None = None,
    delivery: dialects.Delivery | None = None,
) -> HeldLease:
    """Take the lease on ``key`` for ``ttl`` seconds, or raise :class:`LeaseBusy`.

    One atomic statement grants the lease when the key is free, released or expired
    (by the database's clock) and issues the next fencing token. ``job`` (the encoded
    job of a task execution, see :mod:`celery_fenced.reclaim`) is stored by that same
    statement, so the reclaimer can send it again if the grant expires unfinished.

    ``delivery`` (a task delivery: task id, message digest, retry count) makes the same
    statement refuse a job that already completed under its lease within
    ``fenced_duplicate_window``, raising
    :class:`~celery_fenced.exceptions.AlreadyCompleted` (see
    :meth:`celery_fenced.dialects.Dialect.completed`); a release of this grant as
    SUCCESS or FAILURE marks it completed.
    """
    key = validate_key(key)
    seconds = validate_ttl(ttl)
    owner = validate_owner(owner) if owner is not None else default_owner()
    alias = database_alias(using)
    window = conf.load().duplicate_window if delivery is not None else 0.0
    sent = time.monotonic()
    with tables_required(alias):
        outcome = dialects.for_alias(alias).acquire(
            key, seconds, owner, task_id, task_name, job, delivery, window
        )
    if isinstance(outcome, dialects.Completed):
        raise AlreadyCompleted(key, task_id, outcome.retries)
    if isinstance(outcome, dialects.Holder):
        raise LeaseBusy(
            key,
            holder=outcome.owner,
            token=outcome.token,
            expires_at=outcome.expires_at,
            remaining=outcome.remaining,
        )
    lease = HeldLease(
        key=key,
        token=outcome.token,
        owner=owner,
        expires_at=outcome.expires_at,
        ttl=seconds,
        alias=alias,
        task_id=task_id,
        reclaimed_from=outcome.reclaimed_from,
        renew_interval=renew_interval,
        delivery=delivery,
    )
    lease._confirmed_at = sent
    signals.send(
        signals.lease_acquired,
        Lease,
        key=key,
        token=lease.token,
        owner=owner,
        task_id=task_id,
        reclaimed_from=outcome.reclaimed_from,
    )
    logger.debug("lease acquired", extra=lease._log_extra())
    return lease


def force_release(key: str, *, by: str | None = None, using: str | None = None) -> int | None:
    """End the current grant on ``key`` and fence its holder out.

    The holder's next renew, guard or result write fails. Returns the token that was
    ended, or None when nothing was held. The next grant gets a higher token.
    """
    key = validate_key(key)
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


def settle_elsewhere(
    task_id: str, *, process: str | None, by: str, using: str | None = None
) -> bool:
    """Whether an outcome of ``task_id`` reported outside its grant may be recorded.

    For writes that carry no lease: the worker's main process reporting that the process
    ``process`` (an owner prefix, ``host:pid:``; None for a delivery that never started)
    ended — a hard time limit, a lost pool child, a revoke — or a delivery that failed
    before its grant. That process's own live grant of ``task_id`` is ended (force-released:
    the next grant comes at once, and the old holder stays fenced out); no other grant is.
    Returns False while another execution holds a grant of ``task_id`` (live, or expired
    and not yet taken over): that execution owns the job's outcome, and this report must
    change nothing.
    """
    alias = database_alias(using)
    dialect = dialects.for_alias(alias)
    others = False
    for key, token, owner in dialect.task_grants(task_id):
        if process is not None and owner.startswith(process):
            ended = dialect.force_release(key, by, task_id=task_id, token=token)
            if ended is not None:
                logger.info(
                    "task %s ended (%s): released its grant of %r (token %s)",
                    task_id,
                    by,
                    key,
                    token,
                    extra={"task_id": task_id, "lease_key": key, "fencing_token": token},
                )
                signals.send(
                    signals.lease_released,
                    Lease,
                    key=key,
                    token=token,
                    owner=owner,
                    task_id=task_id,
                    forced=True,
                )
        else:
            others = True
    return not others


def reject_stale(
    key: str,
    token: int,
    current: int | None,
    *,
    using: str,
    task_id: str = "",
    owner: str = "",
    what: str = "write",
) -> StaleToken:
    """Record, signal and log a refused write; return the :class:`StaleToken` to raise."""
    logger.warning(
        "stale %s rejected for %r: token %s, current token %s",
        what,
        key,
        token,
        current,
        extra={"lease_key": key, "fencing_token": token, "current_token": current},
    )
    try:
        with transaction.atomic(using=using):
            dialects.for_alias(using).record_event(
                key,
                "stale_write_rejected",
                token,
                task_id,
                owner,
                {"current_token": current, "what": what},
            )
    except Exception:
        logger.info("could not record the stale_write_rejected event", exc_info=True)
    signals.send(
        signals.stale_write_rejected,
        Lease,
        key=key,
        token=token,
        owner=owner,
        task_id=task_id,
        current=current,
    )
    return StaleToken(key, token, current)


class _Refused(Exception):
    def __init__(self, current: int | None) -> None:
        self.current = current


@contextmanager
def fenced_transaction(
    key: str,
    token: int,
    *,
    using: str | None = None,
    lease: HeldLease | None = None,
    what: str = "write",
) -> Iterator[None]:
    """Open a transaction on the lease database that proves ``token`` current first.

    The refusal is recorded after the transaction has rolled back, so the event stands
    (unless an outer transaction of the caller's rolls back too).
    """
    alias = database_alias(using)
    try:
        with transaction.atomic(using=alias):
            ok, current = dialects.for_alias(alias).prove_current(key, token)
            if not ok:
                raise _Refused(current)
            marker = _guards.set((*_guards.get(), (alias, key, token)))
            try:
                yield
            finally:
                _guards.reset(marker)
    except _Refused as refused:
        current = refused.current
        if lease is not None:
            lease.mark_lost(f"write refused: current token is {current}")
        raise reject_stale(
            key,
            token,
            current if current != token else None,
            using=alias,
            task_id=lease.task_id if lease else "",
            owner=lease.owner if lease else "",
            what=what,
        ) from None


def expired_unclaimed(lease: HeldLease) -> bool:
    """True when ``lease``'s grant expired (by the database's clock) and nobody took over.

    Its token is still the key's, it was never released: the job can be retried at once
    under the same task id without anyone's work being lost.
    """
    return dialects.for_alias(lease.alias).expired_unclaimed(lease.key, lease.token)


def grant_of(key: str, *, using: str | None = None) -> tuple[str, bool] | None:
    """``(task_id, ended)`` of ``key``'s current or last grant, or None."""
    row = (
        Lease._default_manager.using(database_alias(using))
        .filter(key=key)
        .values_list("task_id", "released_at")
        .first()
    )
    return None if row is None else (row[0], row[1] is not None)


def grant_live_since(key: str, token: int, *, using: str | None = None) -> bool:
    """Whether ``key`` is granted, unreleased, under ``token`` or a newer one."""
    return (
        Lease._default_manager.using(database_alias(using))
        .filter(key=key, token__gte=token, released_at__isnull=True)
        .exists()
    )


def in_guard(key: str, token: int) -> bool:
    """True inside a guard() of ``key``/``token`` (its transaction holds the lock)."""
    return any(k == key and t == token for _, k, t in _guards.get())


def in_guard_of_token(token: int) -> bool:
    """True inside a guard() holding ``token``, whatever its key."""
    return any(t == token for _, _, t in _guards.get())


@contextmanager
def time_limited(alias: str, seconds: float | None) -> Iterator[None]:
    """Statements on ``alias`` in this block fail after about ``seconds`` (None: no limit)
    instead of waiting on a lock held by another connection.

    For the renewer's thread. PostgreSQL: a transaction of its own with a local
    ``statement_timeout`` (nothing stays on the session, so a transaction pooler is safe;
    inside a transaction already open there is no limit). SQLite: the busy timeout of this
    thread's connection (how long a statement waits for another connection's write lock),
    the longest fixed step within ``seconds``; it stays on that connection, which only
    the renewer's thread uses. Other databases: no limit.
    """
    connection = connections[alias]
    if seconds is None or connection.vendor not in ("postgresql", "sqlite"):
        yield
        return
    milliseconds = max(1, int(seconds * 1000))
    if connection.vendor == "sqlite":
        # a PRAGMA takes no parameters: fixed texts, never a spliced value
        busy = (
            "PRAGMA busy_timeout = 10000"
            if milliseconds >= 10000
            else "PRAGMA busy_timeout = 5000"
            if milliseconds >= 5000
            else "PRAGMA busy_timeout = 2000"
            if milliseconds >= 2000
            else "PRAGMA busy_timeout = 1000"
            if milliseconds >= 1000
            else "PRAGMA busy_timeout = 500"
            if milliseconds >= 500
            else "PRAGMA busy_timeout = 200"
            if milliseconds >= 200
            else "PRAGMA busy_timeout = 100"
        )
        with connection.cursor() as cursor:
            cursor.execute(busy)
        yield
        return
    if connection.in_atomic_block:
        yield
        return
    with transaction.atomic(using=alias):
        with connection.cursor() as cursor:
            cursor.execute("SELECT set_config('statement_timeout', %s, true)", [str(milliseconds)])
        yield
