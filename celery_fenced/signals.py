"""Django signals sent by celery-fenced.

Every signal is sent with ``sender`` the :class:`celery_fenced.models.Lease` model and
keyword arguments ``key``, ``token``, ``owner`` (and ``task_id`` and ``task_name`` where
known; a permit's ``key`` is its row's, :mod:`celery_fenced.permits`):

- ``lease_acquired`` — a grant was issued (``reclaimed_from`` names the expired holder;
  a takeover's ``takeover_delay``: seconds from that grant's expiry, by the database's
  clock, else None);
- ``lease_lost`` — a holder learned its grant is gone (``reason``);
- ``lease_released`` — a holder ended its grant (``forced`` is True for force_release);
- ``stale_write_rejected`` — a write under an old token was refused (``current``,
  ``what``);
- ``lease_busy`` — a grant was refused: another holds the key (``token`` and ``holder``
  are the holder's, ``owner`` the requester's);
- ``lease_duplicate`` — a delivery of a job that already completed was skipped
  (``token`` None, ``retries``);
- ``lease_resent`` — the reclaimer sent an expired, unfinished job again (``attempt``);
- ``lease_abandoned`` — the reclaimer gave up on a job (``reason``);
- ``lease_deduplicated`` — a publish of a ``lease_unique`` job was refused: a copy of
  its key stands (``task_id`` is that copy's, ``refused_task_id`` the call's; ``token``
  None while that copy has not started).

Every kind of lease event has its signal (``celery_fenced.kinds``), sent whatever
``fenced_events`` records.

A receiver that raises is logged (a warning naming the receiver, with its traceback) and
ignored: it never stops the renewal of a lease nor changes a task's result.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from django.dispatch import Signal

__all__ = [
    "Signal",
    "lease_abandoned",
    "lease_acquired",
    "lease_busy",
    "lease_deduplicated",
    "lease_duplicate",
    "lease_lost",
    "lease_released",
    "lease_resent",
    "send",
    "stale_write_rejected",
]

logger = logging.getLogger(__name__)

lease_acquired = Signal()
lease_lost = Signal()
lease_released = Signal()
stale_write_rejected = Signal()
lease_busy = Signal()
lease_duplicate = Signal()
lease_resent = Signal()
lease_abandoned = Signal()
lease_deduplicated = Signal()
#: not a lease event (nothing recorded, nothing logged): this process holds a grant no
#: more (released, lost or forgotten), sent once per grant with ``task_name``; the
#: metrics' live gauge of held leases listens
grant_ended = Signal()

_NAMES = {
    id(lease_acquired): "lease_acquired",
    id(lease_lost): "lease_lost",
    id(lease_released): "lease_released",
    id(stale_write_rejected): "stale_write_rejected",
    id(lease_busy): "lease_busy",
    id(lease_duplicate): "lease_duplicate",
    id(lease_resent): "lease_resent",
    id(lease_abandoned): "lease_abandoned",
    id(lease_deduplicated): "lease_deduplicated",
}


#: one structured record per signal sent: ``extra`` names the key, token, task and kind
event_logger = logging.getLogger("celery_fenced.events")
#: the routine kinds are logged at DEBUG, every other at INFO
ROUTINE = ("acquired", "released")


def send(signal: Signal, sender: Any, **kwargs: Any) -> None:
    """Send ``signal`` to every receiver; log, never raise, what a receiver raises.

    Every signal of the package is sent through here: the senders are the renewer
    thread and the result backend, which a receiver's error must not break. Each is also
    one log record of ``celery_fenced.events`` whose ``extra`` carries ``lease_key``,
    ``fencing_token``, ``task_id``, ``task_name`` and ``lease_event`` (the event's kind).
    """
    _log_event(signal, kwargs)
    for listener in _listeners.get(id(signal), {}).values():
        try:
            listener(signal=signal, sender=sender, **kwargs)
        except Exception as exc:
            _ignored(listener, signal, exc, kwargs)
    if not signal.receivers:
        return  # nobody listens
    for receiver, response in signal.send_robust(sender=sender, **kwargs):
        if isinstance(response, Exception):
            _ignored(receiver, signal, response, kwargs)


def listen(signal: Signal, listener: Callable[..., object], uid: str | None = None) -> None:
    """Call ``listener`` at every :func:`send` of ``signal``, as a receiver is called,
    without Django's dispatch (which costs more per send than the package's own
    listeners, the metrics, do); once however often it is added. ``uid``: as Django's
    ``dispatch_uid``, one listener by that name (a module reloaded makes new functions)."""
    _listeners.setdefault(id(signal), {}).setdefault(uid or listener, listener)


#: the package's own listeners per signal (:func:`listen`), by their ``uid`` (or by
#: themselves when they have none)
_listeners: dict[int, dict[object, Callable[..., object]]] = {}


def _ignored(receiver: Any, signal: Signal, error: Exception, kwargs: dict[str, Any]) -> None:
    """Log what a receiver raised; the sender goes on."""
    name = getattr(receiver, "__qualname__", None) or repr(receiver)
    module = getattr(receiver, "__module__", None)
    logger.warning(
        "receiver %s of celery_fenced signal %s raised %r; ignored",
        f"{module}.{name}" if module else name,
        _NAMES.get(id(signal), repr(signal)),
        error,
        exc_info=(type(error), error, error.__traceback__),
        extra={"lease_key": kwargs.get("key"), "fencing_token": kwargs.get("token")},
    )


def _log_event(signal: Signal, kwargs: dict[str, Any]) -> None:
    name = _NAMES.get(id(signal), "")
    if not name:
        return  # not an event (grant_ended)
    kind = name.removeprefix("lease_")
    if kind == "acquired" and kwargs.get("reclaimed_from"):
        kind = "reclaimed"
    elif kind == "released" and kwargs.get("forced"):
        kind = "force_released"
    level = logging.DEBUG if kind in ROUTINE else logging.INFO
    if not event_logger.isEnabledFor(level):
        return
    event_logger.log(
        level,
        "lease event %s: key %r, token %s, task %s",
        kind,
        kwargs.get("key"),
        kwargs.get("token"),
        kwargs.get("task_id") or "-",
        extra={
            "lease_key": kwargs.get("key"),
            "fencing_token": kwargs.get("token"),
            "task_id": kwargs.get("task_id") or "",
            "task_name": kwargs.get("task_name") or "",
            "lease_event": kind,
        },
    )
