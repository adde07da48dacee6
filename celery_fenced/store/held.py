"""A granted lease as its holder sees it: renew, release, check, guard, and losing it."""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from celery_fenced import signals
from celery_fenced.exceptions import LeaseLost
from celery_fenced.models import Lease, LeaseEvent
from celery_fenced.store import dialects
from celery_fenced.store.fenced import fenced_transaction, time_limited
from celery_fenced.store.types import Delivery, Ending, Renewal

logger = logging.getLogger("celery_fenced.store")


#: why a lease is lost when no renewal confirmed it within its ttl (its local deadline):
#: what is known, nothing more (a paused process and a database outage look alike here)
UNRENEWED = "no renewal reached the database before the grant expired"
#: the longest error text a reason quotes (a driver's message can run to several lines)
ERROR_TEXT_LIMIT = 200


def unrenewed(error: str | None) -> str:
    """Why a lease is lost at its local deadline. When the last renewal attempt failed,
    its error; otherwise no attempt failed and none was confirmed in time (the process
    was paused, overloaded or cut off), and no database error is blamed."""
    if error is None:
        return f"{UNRENEWED}: the process was paused, overloaded or cut off (no renewal failed)"
    return f"{UNRENEWED}: the last renewal attempt failed with {error}"


def describe_error(exc: BaseException) -> str:
    """``exc`` as a reason quotes it: its type and first line, shortened."""
    lines = str(exc).strip().splitlines()
    text = " ".join(lines[0].split()) if lines else ""
    if len(text) > ERROR_TEXT_LIMIT:
        text = text[: ERROR_TEXT_LIMIT - 1] + "…"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


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
        task_name: str = "",
        reclaimed_from: str = "",
        renew_interval: float | None = None,
        delivery: Delivery | None = None,
        confirmed_at: float | None = None,
        routine_events: bool = False,
        row_marker: str | None = None,
    ) -> None:
        self.key = key
        self.token = token
        self.owner = owner
        self.expires_at = expires_at
        self.ttl = ttl
        self.alias = alias
        self.task_id = task_id
        self.task_name = task_name
        self.reclaimed_from = reclaimed_from
        #: the task delivery this grant is for: its completion is marked at release
        self.delivery = delivery
        #: its release is recorded as a ``released`` event (``fenced_events="all"``)
        self.routine_events = routine_events
        #: the lease row's completion marker when granted (None: not known); only this
        #: grant's release can change it while the grant is held
        self.row_marker = row_marker
        self.renew_interval = renew_interval if renew_interval is not None else ttl / 3
        self.released = False
        self._ended = False
        self._lost_reason: str | None = None
        # the error of the last renewal attempt, when it failed (cleared by a success)
        self._renewal_error: str | None = None
        # monotonic time when the last successful grant/renewal statement was *sent*:
        # the grant is known to run until at least this + ttl
        self._confirmed_at = confirmed_at if confirmed_at is not None else time.monotonic()
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
            return self.unrenewed_reason()
        return self._lost_reason

    def unrenewed_reason(self) -> str:
        """Why the grant is lost if its local deadline passed: see :func:`unrenewed`."""
        return unrenewed(self._renewal_error)

    def renewal_failed(self, exc: BaseException) -> None:
        """A renewal statement failed with ``exc`` (no answer about the grant)."""
        with self._lock:
            self._renewal_error = describe_error(exc)

    @property
    def local_deadline(self) -> float:
        """Monotonic time until which the grant is known to run: the last confirmed
        renewal (when its statement was sent) plus the ttl. Past it, it may have expired."""
        return self._confirmed_at + self.ttl

    def renew(self) -> dt.datetime:
        """Extend the grant by its ttl. Raises :class:`LeaseLost` if it is no longer held."""
        self._raise_if_lost()
        sent = time.monotonic()
        try:
            renewed = renew_many(self.alias, [self])
        except Exception as exc:
            self.renewal_failed(exc)
            raise
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
            self._renewal_error = None

    def ending(self, state: str) -> Ending:
        """The end of this grant in ``state``, as the store's release statements take it."""
        marker, delivery = self.row_marker, self.delivery
        return Ending(
            self.key,
            self.token,
            self.owner,
            self.task_id,
            state,
            delivery,
            self.routine_events,
            None if marker is None or delivery is None else marker not in ("", delivery.digest),
        )

    def release(self, *, state: str = "") -> bool:
        """End the grant. Returns False (and marks the lease lost) if it was already gone.

        ``state`` (the task's final state, when known) is recorded on the lease row (and
        on the ``released`` event with ``fenced_events="all"``).
        """
        if self.released:
            return True
        ok = dialects.for_alias(self.alias).release(self.ending(state))
        if ok:
            self.confirm_released()
        else:
            self._end()
            self.released = True
            self.mark_lost("release refused: the grant had already ended")
        return ok

    def confirm_released(self) -> None:
        """This grant's release has committed: mark it released and tell the receivers."""
        self._end()
        self.released = True
        signals.send(
            signals.lease_released,
            Lease,
            key=self.key,
            token=self.token,
            owner=self.owner,
            task_id=self.task_id,
            task_name=self.task_name,
            forced=False,
        )
        logger.debug("lease released", extra=self._log_extra())

    def _end(self) -> None:
        """This process holds the grant no more (released, lost, forgotten): once."""
        if not self._ended:
            self._ended = True
            signals.send(signals.grant_ended, Lease, task_name=self.task_name)

    def forget(self) -> None:
        """Stop holding this grant here without a statement: it expired with nobody taking
        over, and the retry that follows takes a new grant of the key."""
        self._end()
        self.released = True

    @property
    def confirmed_at(self) -> float:
        """Monotonic time the last confirmed grant or renewal statement was sent."""
        return self._confirmed_at

    @property
    def marked_lost(self) -> bool:
        """Whether :meth:`mark_lost` ran (the local deadline alone does not count)."""
        return self._lost_reason is not None

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
        self,
        reason: str,
        *,
        time_limit: float | None = None,
        record: bool = True,
        warn: bool = True,
    ) -> None:
        """Mark the grant lost, once: log, record a ``lost`` event, send ``lease_lost``.

        ``time_limit`` (seconds; the renewer's thread) bounds the event's write, which a
        lock on the lease row would otherwise hold up; ``record=False`` writes no event.
        ``warn=False``: a refused write revealed the loss, and its rejection is the
        warning that names key and tokens; the loss is logged at INFO.
        """
        with self._lock:
            if self._lost_reason is not None or self.released:
                if self._lost_reason is None:
                    self._lost_reason = reason
                return
            self._lost_reason = reason
        self._end()
        logger.log(
            logging.WARNING if warn else logging.INFO,
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
                        self.key,
                        LeaseEvent.Kind.LOST,
                        self.token,
                        self.task_id,
                        self.owner,
                        {"reason": reason},
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
            task_name=self.task_name,
            reason=reason,
        )

    def _raise_if_lost(self) -> None:
        if self._lost_reason is None and self.lost:  # the local deadline passed unrenewed
            # logged and signalled here; no statement: the database may be what hangs
            self.mark_lost(self.unrenewed_reason(), record=False)
        if self.lost:
            raise LeaseLost(self.key, self.token, self.lost_reason or self.unrenewed_reason())

    def _log_extra(self) -> dict[str, Any]:
        return {"lease_key": self.key, "fencing_token": self.token, "lease_owner": self.owner}


def renew_many(alias: str, leases: Sequence[HeldLease]) -> dict[tuple[str, int], dt.datetime]:
    """Extend every lease of ``leases`` (all on ``alias``) still held, in one statement;
    the new expiry of each renewed ``(key, token)``."""
    return dialects.for_alias(alias).renew(
        [Renewal(x.key, x.token, x.owner, x.ttl) for x in leases]
    )
