"""Each entry's last sent tick, in the lease database, advanced only under the leader's
proven token.

:func:`send_tick` opens the leader's ``guard()`` (one transaction that proves its token
current and holds the lease row until commit), advances the entry's row from the count
of sends the leader knows to the next, and publishes the tick's job inside that same
transaction: the outbox records it there and sends it when the transaction commits. A
stale leader's guard fails and nothing is written or sent; a leader whose view of the
entry is behind (another leader sent since) finds the count moved and sends nothing.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from celery_fenced import outbox, store
from celery_fenced.store import HeldLease

#: the namespace of tick task ids: one id per (beat key, entry, tick)
TICK_NAMESPACE = uuid.UUID("6f1d8f4e-0c39-4c55-9a43-5b0f6a3c2e71")


#: what the leader read of an entry: its sends so far and the last sent tick
Known = store.BeatState


class Moved(Exception):
    """The entry's row is not as the leader read it: another leader sent since."""

    def __init__(self, known: Known) -> None:
        self.known = known


def tick_task_id(key: str, name: str, tick: dt.datetime) -> str:
    """The task id of ``name``'s job for ``tick`` under beat ``key``: the same on every
    host, so a tick's job is known by its id."""
    return str(uuid.uuid5(TICK_NAMESPACE, f"{key}\0{name}\0{tick.isoformat()}"))


def read(alias: str, key: str, names: Iterable[str]) -> dict[str, Known]:
    """What the database holds of the entries ``names`` of beat ``key``."""
    return store.beat_entries(alias, key, names)


def send_tick(
    lease: HeldLease,
    name: str,
    known: Known,
    tick: dt.datetime,
    send: Callable[[str], Any],
) -> tuple[Known, Any]:
    """Record ``tick`` as ``name``'s last and send its job (``send(task_id)``), in one
    transaction that proves ``lease``'s token current; the entry as now known, and what
    ``send`` returned.

    Raises :class:`~celery_fenced.exceptions.StaleToken` when the token is no longer
    current and :class:`Moved` when the row moved past ``known``: nothing is written or
    sent. An exception from ``send`` rolls the tick back (it was not sent).
    """
    task_id = tick_task_id(lease.key, name, tick)
    with lease.guard():
        moved = store.advance_beat_entry(
            lease.alias,
            lease.key,
            name,
            known=known,
            tick=tick,
            token=lease.token,
            task_id=task_id,
        )
        if moved is not None:
            raise Moved(moved)
        with outbox.plain_sends_recorded(lease.alias):
            sent = send(task_id)
    return Known(known.sends + 1, tick), sent
