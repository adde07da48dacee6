"""Every kind of lease event has its colour, its timeline drawing, its signal, its docs row."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from celery_fenced import kinds, signals, timeline
from celery_fenced.models import LeaseEvent

DOCS = Path(__file__).resolve().parents[2] / "docs" / "admin.md"


def docs_rows() -> dict[str, list[str]]:
    """The rows of the kinds table in docs/admin.md: kind → its cells."""
    rows = {}
    for line in DOCS.read_text().splitlines():
        match = re.match(r"\| `(\w+)` \|(.*)\|$", line)
        if match:
            rows[match.group(1)] = [cell.strip() for cell in match.group(2).split("|")]
    return rows


def test_kinds__one_row_per_kind_of_the_model() -> None:
    assert set(kinds.KINDS) == set(LeaseEvent.Kind)


@pytest.mark.parametrize("kind", list(LeaseEvent.Kind))
def test_kind__has_its_colour_timeline_signal_and_docs_row(kind: LeaseEvent.Kind) -> None:
    style = kinds.KINDS[kind]
    assert re.fullmatch(r"#[0-9a-f]{6}", style.colour)
    assert kinds.colour(kind.value) == style.colour != kinds.UNKNOWN_COLOUR
    if "mark" in style.timeline:
        assert kind.value in timeline.COLOURS
        assert kind.value in timeline.DRAW_ORDER
    assert isinstance(getattr(signals, style.signal), signals.Signal)  # every kind has one
    assert style.signal in signals.__all__
    row = docs_rows().get(kind.value)
    assert row is not None, f"docs/admin.md has no row for {kind.value!r}"
    _, drawn, signal = row
    assert drawn == style.timeline
    assert signal == f"`{style.signal}`"


def test_timeline__draws_a_mark_for_each_kind_that_has_one() -> None:
    """Replay one event of each kind on a lease: exactly the "mark" kinds become marks."""
    import datetime as dt

    from celery_fenced.models import Lease

    now = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    lease = Lease(key="k", token=1, owner="o", acquired_at=now, renewed_at=now, expires_at=now)
    events = [
        LeaseEvent(kind=kind, token=1, owner="o", at=now, detail={}) for kind in LeaseEvent.Kind
    ]
    _, marks = timeline.grants_and_marks(lease, events, now)
    marked = {str(mark.kind) for mark in marks}
    assert marked == {k.value for k, s in kinds.KINDS.items() if "mark" in s.timeline}
