"""Testing your own fenced tasks: take a key over, lose a lease, capture and assert events.

Each helper goes through the package's public API and its lease store (``acquire``,
``force_release``, :func:`celery_fenced.store.expire`, the signals, the result backend's
own reads): what a test sees is what a worker and an operator would.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from celery import current_app
from celery.result import AsyncResult, EagerResult
from django.dispatch import Signal

from celery_fenced import operations, signals, store
from celery_fenced.exceptions import StaleToken
from celery_fenced.models import Lease, LeaseEvent
from celery_fenced.renewal import renewer
from celery_fenced.store import HeldLease

Kind = LeaseEvent.Kind

#: the owner of the grants the helpers take: another worker, as the admin shows it
TAKER = "celery_fenced.testing:taker"

#: each signal and the kind of event it reports (``kind_of`` tells the two that share one)
SIGNAL_KINDS: tuple[tuple[Signal, str], ...] = (
    (signals.lease_acquired, Kind.ACQUIRED),
    (signals.lease_lost, Kind.LOST),
    (signals.lease_released, Kind.RELEASED),
    (signals.stale_write_rejected, Kind.STALE_WRITE_REJECTED),
    (signals.lease_busy, Kind.BUSY),
    (signals.lease_duplicate, Kind.DUPLICATE),
    (signals.lease_resent, Kind.RESENT),
    (signals.lease_abandoned, Kind.ABANDONED),
    (signals.lease_deduplicated, Kind.DEDUPLICATED),
)


@dataclass(frozen=True)
class CapturedEvent:
    """One lease event as its signal reported it in this process."""

    #: a :class:`~celery_fenced.models.LeaseEvent.Kind` value: ``"reclaimed"`` for a grant
    #: that took an expired one over, ``"force_released"`` for a forced release
    kind: str
    key: str
    token: int | None
    task_id: str
    owner: str
    #: the signal's other keyword arguments (``current``, ``reason``, ``reclaimed_from``...)
    detail: dict[str, Any] = field(default_factory=dict)


def kind_of(base: str, detail: dict[str, Any]) -> str:
    """The event kind of a signal of ``base`` kind sent with ``detail``."""
    if base == Kind.ACQUIRED and detail.get("reclaimed_from"):
        return str(Kind.RECLAIMED)
    if base == Kind.RELEASED and detail.get("forced"):
        return str(Kind.FORCE_RELEASED)
    return str(base)


def take_over(
    key: str,
    *,
    ttl: float = 30.0,
    task_id: str = "",
    owner: str = TAKER,
    using: str | None = None,
) -> HeldLease:
    """Play another worker taking ``key`` over: its grant expires and a new one is taken.

    The holder of the current grant (a task body running in the test) is now stale: its
    next fenced write is refused with :class:`~celery_fenced.StaleToken`, its result is
    fenced out, its renewal fails. The taker's grant, returned, has the next token and is
    not renewed: release it when done (the ``fenced`` fixture releases its own). With
    ``task_id`` the taker plays a redelivery of that task: the stale execution's outcome
    is then not stored at all.
    """
    store.expire(key, using=using)
    return store.acquire(key, ttl=ttl, owner=owner, task_id=task_id, using=using)


def lose(key: str, *, using: str | None = None) -> int | None:
    """Make the current grant of ``key`` lost: it expires by the database's clock.

    The fenced executions of this process holding it learn it at once, as their next
    renewal would tell them: marked lost (a ``lost`` event, the ``lease_lost`` signal),
    so ``self.lease.check()`` raises :class:`~celery_fenced.LeaseLost`; nobody has taken
    the key over, so a fenced task retries at once. A grant taken with ``acquire`` learns
    it at its next ``renew()``, ``check()`` or ``guard()``. Returns the token that was
    lost, or None when nothing held ``key``.
    """
    token = store.expire(key, using=using)
    if token is None:
        return None
    keeper = renewer()
    holders = [lease for lease in keeper.holding(token) if lease.key == key]
    if holders:
        keeper.renew(holders)  # refused: each is marked lost
    return token


@contextmanager
def taken_over_after_grant(
    key: str, *, ttl: float = 30.0, task_id: str = "", using: str | None = None
) -> Iterator[Takeover]:
    """Inside the block, the first grant of ``key`` is taken over right after it is issued.

    The execution that got it runs its body already stale: its first fenced write is
    refused and its result fenced out. Yields a :class:`Takeover` whose ``lease`` is the
    taker's grant once it happened; leaving the block without an error when no grant of
    ``key`` was issued fails the test (a mistyped key would prove nothing).
    """
    takeover = Takeover(key=key)

    def after_grant(sender: Any, *, key: str, owner: str, **kwargs: Any) -> None:
        if key != takeover.key or owner == TAKER:
            return
        with takeover.lock:
            if takeover.fired:
                return
            takeover.fired = True
        try:
            takeover.lease = take_over(key, ttl=ttl, task_id=task_id, using=using)
        except Exception as exc:  # the signal would only log it: raised at the block's end
            takeover.error = exc

    signals.lease_acquired.connect(after_grant, weak=False)
    try:
        yield takeover
    finally:
        signals.lease_acquired.disconnect(after_grant)
    if takeover.error is not None:
        raise takeover.error
    if takeover.lease is None:
        raise AssertionError(f"no grant of {key!r} was issued inside the block to take over")


@dataclass
class Takeover:
    """What :func:`taken_over_after_grant` did: the taker's grant, once it happened."""

    key: str
    lease: HeldLease | None = None
    fired: bool = False
    error: Exception | None = None
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


def recorded_events(
    key: str | None = None,
    *,
    kind: str | None = None,
    task_id: str | None = None,
    using: str | None = None,
) -> list[LeaseEvent]:
    """The :class:`~celery_fenced.models.LeaseEvent` rows recorded (oldest first), those of
    ``key``, ``kind`` and ``task_id`` when given. Which kinds are recorded depends on
    ``fenced_events``; a worker's events are here too."""
    rows = LeaseEvent._default_manager.using(store.database_alias(using)).all()
    if key is not None:
        rows = rows.filter(lease__key=key)
    if kind is not None:
        rows = rows.filter(kind=kind)
    if task_id is not None:
        rows = rows.filter(task_id=task_id)
    return list(rows.select_related("lease").order_by("at", "id"))


def assert_lease(
    key: str, *, token: int | None = None, state: str | None = None, using: str | None = None
) -> Lease:
    """Assert that ``key``'s lease row has ``token`` and ``state`` (``"held"``,
    ``"expired"`` or ``"released"``, by the database's clock); returns the row."""
    if state is not None and state not in operations.STATES:
        raise ValueError(f"state must be one of {', '.join(operations.STATES)}, got {state!r}")
    lease = operations.find(key, using=using)
    assert lease is not None, f"lease {key!r} has no row: it was never granted"
    found = getattr(lease, "state")  # noqa: B009 - an annotation
    assert token is None or lease.token == token, (
        f"lease {key!r} has token {lease.token} ({found}), expected {token}"
    )
    assert state is None or found == state, (
        f"lease {key!r} is {found} (token {lease.token}), expected {state}"
    )
    return lease


def assert_fenced_out(result: AsyncResult[Any] | str, *, using: str | None = None) -> None:
    """Assert that the execution of ``result`` (or task id) was fenced out.

    A write of that task was refused as stale (a ``stale_write_rejected`` event of its
    task id), and its outcome is not the task's: the stored result is the
    :class:`~celery_fenced.StaleToken` FAILURE, or nothing, or a newer execution's of the
    same task id (a redelivery). An eager or ``.apply()`` result, which Celery does not
    store, must itself be that FAILURE.
    """
    task_id = result if isinstance(result, str) else str(result.id)
    refused = recorded_events(kind=Kind.STALE_WRITE_REJECTED, task_id=task_id, using=using)
    assert refused, (
        f"task {task_id} was not fenced out: no write of it was refused as stale "
        "(no stale_write_rejected event of that task id)"
    )
    stale = min(event.token or 0 for event in refused)
    if isinstance(result, EagerResult):
        ended = f"task {task_id} ended {result.state} with {result.result!r}"
        assert result.state == "FAILURE", f"{ended}, not a FAILURE with StaleToken"
        assert isinstance(result.result, StaleToken), f"{ended}, not with StaleToken"
    stored = None if isinstance(result, (str, EagerResult)) else result
    app = current_app if stored is None else stored.app
    if app.conf.task_always_eager and not app.conf.task_store_eager_result:
        return  # Celery stores no result of an eager run (and warns when asked for one)
    backend = app.backend if stored is None else stored.backend
    meta = backend.get_task_meta(task_id)
    status, outcome = meta.get("status"), meta.get("result")
    newer = (meta.get("fencing_token") or 0) > stale
    assert status == "PENDING" or newer or isinstance(outcome, StaleToken), (
        f"task {task_id}'s stored outcome is {status} with {outcome!r}, written under "
        f"token {meta.get('fencing_token')}: not fenced out (its stale token is {stale})"
    )


class Fenced:
    """The ``fenced`` fixture: the helpers, and the lease events signalled during a test.

    Grants it takes (:meth:`take_over`, :meth:`taken_over_after_grant`) are released when
    the test ends.
    """

    def __init__(self, *, using: str | None = None) -> None:
        self.using = using
        self._captured: list[CapturedEvent] = []
        self._takers: list[HeldLease] = []
        self._lock = threading.Lock()
        self._receivers: list[tuple[Signal, Any]] = []

    def start(self) -> None:
        """Capture every lease signal sent in this process from now on."""
        for sent, base in SIGNAL_KINDS:

            def receive(sender: Any, *, signal: Signal, base: str = base, **kwargs: Any) -> None:
                self._capture(base, kwargs)

            sent.connect(receive, weak=False)
            self._receivers.append((sent, receive))

    def stop(self) -> None:
        """Release the grants taken by the helpers that are still held; stop capturing."""
        try:
            for lease in self._takers:
                if not lease.released and not lease.lost:
                    lease.release()
        finally:
            for signal, receive in self._receivers:
                signal.disconnect(receive)
            self._receivers.clear()

    def _capture(self, base: str, kwargs: dict[str, Any]) -> None:
        detail = {
            name: value
            for name, value in kwargs.items()
            if name not in ("key", "token", "task_id", "owner")
        }
        event = CapturedEvent(
            kind=kind_of(base, detail),
            key=str(kwargs.get("key", "")),
            token=kwargs.get("token"),
            task_id=str(kwargs.get("task_id") or ""),
            owner=str(kwargs.get("owner") or ""),
            detail=detail,
        )
        with self._lock:
            self._captured.append(event)

    def events(self, key: str | None = None, *, kind: str | None = None) -> list[CapturedEvent]:
        """The lease events signalled in this process since the test began, in order
        (every kind, whatever ``fenced_events`` records); of ``key`` and ``kind`` if given."""
        with self._lock:
            captured = list(self._captured)
        return [
            event
            for event in captured
            if (key is None or event.key == key) and (kind is None or event.kind == kind)
        ]

    def kinds(self, key: str | None = None) -> list[str]:
        """The kinds of :meth:`events`, in order."""
        return [event.kind for event in self.events(key)]

    def recorded(
        self, key: str | None = None, *, kind: str | None = None, task_id: str | None = None
    ) -> list[LeaseEvent]:
        """:func:`recorded_events` on the fixture's database."""
        return recorded_events(key, kind=kind, task_id=task_id, using=self.using)

    def take_over(self, key: str, *, ttl: float = 30.0, task_id: str = "") -> HeldLease:
        """:func:`take_over`; the taker's grant is released when the test ends."""
        lease = take_over(key, ttl=ttl, task_id=task_id, using=self.using)
        self._takers.append(lease)
        return lease

    @contextmanager
    def taken_over_after_grant(
        self, key: str, *, ttl: float = 30.0, task_id: str = ""
    ) -> Iterator[Takeover]:
        """:func:`taken_over_after_grant`; the taker's grant is released when the test ends."""
        with taken_over_after_grant(key, ttl=ttl, task_id=task_id, using=self.using) as taken:
            try:
                yield taken
            finally:
                if taken.lease is not None:
                    self._takers.append(taken.lease)

    def lose(self, key: str) -> int | None:
        """:func:`lose`."""
        return lose(key, using=self.using)

    def force_release(self, key: str) -> int | None:
        """End ``key``'s grant as an operator does (:func:`celery_fenced.force_release`)."""
        return store.force_release(key, by=TAKER, using=self.using)

    def assert_lease(
        self, key: str, *, token: int | None = None, state: str | None = None
    ) -> Lease:
        """:func:`assert_lease`."""
        return assert_lease(key, token=token, state=state, using=self.using)

    def assert_fenced_out(self, result: AsyncResult[Any] | str) -> None:
        """:func:`assert_fenced_out`."""
        assert_fenced_out(result, using=self.using)
