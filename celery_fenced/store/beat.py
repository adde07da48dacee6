"""The fenced beat's rows: each entry's last sent tick, and who holds the beat's lease.

:func:`advance_beat_entry` runs inside the leader's ``guard()`` (its caller's
transaction, which proved the token and holds the lease row): it moves an entry's row
from the count of sends the leader read to the next, or reports the row as it is.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from dataclasses import dataclass

from celery_fenced.models import BeatEntry, Lease
from celery_fenced.store.grants import database_now


@dataclass(frozen=True)
class BeatState:
    """An entry as the database holds it: its sends so far and the last sent tick."""

    sends: int
    last_tick: dt.datetime | None


@dataclass(frozen=True)
class BeatHolder:
    """The current grant of a beat's lease: its owner, token and seconds left."""

    owner: str
    token: int
    remaining: float


def beat_entries(alias: str, key: str, names: Iterable[str]) -> dict[str, BeatState]:
    """What the database holds of the entries ``names`` of beat ``key``."""
    rows = BeatEntry._default_manager.using(alias).filter(beat_key=key, name__in=list(names))
    return {row.name: BeatState(row.sends, row.last_tick) for row in rows}


def advance_beat_entry(
    alias: str,
    key: str,
    name: str,
    *,
    known: BeatState,
    tick: dt.datetime,
    token: int,
    task_id: str,
) -> BeatState | None:
    """Record ``tick`` as entry ``name``'s last, if its row still holds ``known.sends``
    (None: done); otherwise the row as it is, unchanged. In the caller's transaction."""
    rows = BeatEntry._default_manager.using(alias).filter(beat_key=key, name=name)
    row = rows.first()
    now = BeatState(row.sends, row.last_tick) if row is not None else BeatState(0, None)
    if now.sends != known.sends:
        return now
    values = {"last_tick": tick, "token": token, "task_id": task_id, "sends": known.sends + 1}
    if row is None:
        BeatEntry._default_manager.using(alias).create(beat_key=key, name=name, **values)
    else:
        rows.filter(sends=known.sends).update(**values)
    return None


def beat_holder(alias: str, key: str) -> BeatHolder | None:
    """The unexpired grant of ``key`` by the database's clock, or None (free, released or
    expired): read only, so a standby's look records no ``busy`` event."""
    row = (
        Lease._default_manager.using(alias)
        .filter(key=key, released_at__isnull=True)
        .values_list("owner", "token", "expires_at")
        .first()
    )
    if row is None:
        return None
    remaining = (row[2] - database_now(alias)).total_seconds()
    return BeatHolder(row[0], row[1], remaining) if remaining > 0 else None


def beat_keys(alias: str) -> list[str]:
    """The beat keys that have entries."""
    rows = BeatEntry._default_manager.using(alias).values_list("beat_key", flat=True)
    return sorted(set(rows))


def all_beat_entries(alias: str, key: str) -> list[BeatEntry]:
    """The entries of beat ``key``, by name."""
    return list(BeatEntry._default_manager.using(alias).filter(beat_key=key).order_by("name"))
