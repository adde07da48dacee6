"""What each kind of lease event means to the admin, the timeline and the signals.

One table, keyed by the model's enum (:class:`celery_fenced.models.LeaseEvent.Kind`); a
test checks that every kind has its row here, its mark on the timeline where it has one,
its signal, and its row in the docs (docs/admin.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from celery_fenced.models import LeaseEvent

Kind = LeaseEvent.Kind


@dataclass(frozen=True)
class KindStyle:
    """How one kind of event is shown and reported."""

    #: the colour of its badge in the admin
    colour: str
    #: how the timeline draws it: the start or end of a grant's bar, a mark, or nothing
    timeline: str
    #: the name of the signal (:mod:`celery_fenced.signals`) sent when it happens
    signal: str


KINDS: dict[LeaseEvent.Kind, KindStyle] = {
    Kind.ACQUIRED: KindStyle("#2e7d32", "bar start", "lease_acquired"),
    Kind.RECLAIMED: KindStyle("#c62828", "bar start, mark", "lease_acquired"),
    Kind.RELEASED: KindStyle("#6c7a89", "bar end", "lease_released"),
    Kind.LOST: KindStyle("#616161", "mark", "lease_lost"),
    Kind.BUSY: KindStyle("#8d8d8d", "none", "lease_busy"),
    Kind.STALE_WRITE_REJECTED: KindStyle("#ef6c00", "mark", "stale_write_rejected"),
    Kind.FORCE_RELEASED: KindStyle("#c62828", "bar end, mark", "lease_released"),
    Kind.DUPLICATE: KindStyle("#6a4c93", "none", "lease_duplicate"),
    Kind.RESENT: KindStyle("#1565c0", "none", "lease_resent"),
    Kind.ABANDONED: KindStyle("#4e342e", "none", "lease_abandoned"),
    Kind.DEDUPLICATED: KindStyle("#00838f", "none", "lease_deduplicated"),
}

#: the colour of a kind this version does not know (an event written by a newer one)
UNKNOWN_COLOUR = "#999"


def colour(kind: str) -> str:
    """The admin's badge colour of ``kind``."""
    style = KINDS.get(kind)  # type: ignore[call-overload]
    return style.colour if style is not None else UNKNOWN_COLOUR
