"""The timeline picture of a key's grants, laid out for a server-rendered SVG.

One lane per fencing token, time running left to right: a bar for each grant from its
grant to its end (released, force-released, taken over after expiry, expired, or still
held), with marks for takeovers (``reclaimed``, ``force_released``), rejected stale
writes (``stale_write_rejected``) and holders that learned of their loss (``lost``).
This module only computes shapes and their texts; the template draws them, and Django's
autoescaping escapes every text (keys and owners are user data).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from django.utils.dateparse import parse_datetime

from celery_fenced.models import Lease, LeaseEvent

MAX_EVENTS = 2000  # the newest events of the key that the picture looks at
MAX_LANES = 30  # the newest tokens drawn

WIDTH = 960
LEFT = 96
RIGHT = 40  # room for a mark or a label at the right-hand end
TOP = 12
LANE = 24
BAR = 14
AXIS = 34
LEGEND = 26

#: colours of the bars' ends (by how the grant ended) and of the marks (by event kind)
COLOURS = {
    "held": "#2e7d32",
    "released": "#5c7f9e",
    "expired": "#ef8f00",
    "taken_over": "#c62828",
    LeaseEvent.Kind.FORCE_RELEASED.value: "#c62828",
    LeaseEvent.Kind.RECLAIMED.value: "#c62828",
    LeaseEvent.Kind.STALE_WRITE_REJECTED.value: "#ef6c00",
    LeaseEvent.Kind.LOST.value: "#616161",
}

END_TEXT = {
    "held": "still held",
    "released": "released",
    "expired": "expired (not yet taken over)",
    "taken_over": "expired and taken over by the next token",
    "force_released": "force-released",
}


@dataclass
class GrantSpan:
    """One grant of the key on the picture: from its start to its end (or now)."""

    token: int
    owner: str
    task_id: str
    start: dt.datetime
    end: dt.datetime | None = None
    end_kind: str = ""
    reclaimed: bool = False
    detail: str = ""


@dataclass(frozen=True)
class Mark:
    """An event on a token's lane: what happened (``kind``) and when."""

    token: int
    at: dt.datetime
    kind: str
    text: str


@dataclass(frozen=True)
class Bar:
    """One grant drawn as a bar on its token's lane, with its label and tooltip."""

    x: float
    y: float
    width: float
    colour: str
    dashed: bool
    title: str
    label: str
    label_x: float
    label_inside: bool
    label_anchor: str


@dataclass(frozen=True)
class Shape:
    """A marker drawn on a lane for an anomaly (a takeover, a refusal, a loss)."""

    kind: str  # reclaimed / force_released / stale_write_rejected / lost
    x: float
    y: float
    points: str
    colour: str
    title: str


@dataclass(frozen=True)
class Tick:
    """A time label under the picture's axis, at ``x``."""

    x: float
    label: str
    anchor: str = "middle"  # the last label ends at its tick: never past the picture


@dataclass
class Picture:
    """The whole timeline of one key, laid out for the lease page's SVG."""

    key: str
    width: int
    height: int
    plot_left: int
    plot_right: int
    axis_y: float
    lanes: list[tuple[float, str]] = field(default_factory=list)
    bars: list[Bar] = field(default_factory=list)
    shapes: list[Shape] = field(default_factory=list)
    ticks: list[Tick] = field(default_factory=list)
    legend_y: float = 0.0
    span: str = ""
    empty: bool = False


def grants_and_marks(
    lease: Lease, events: Iterable[LeaseEvent], now: dt.datetime
) -> tuple[list[GrantSpan], list[Mark]]:
    """Replay ``events`` (oldest first) into the grants of ``lease`` and the marks on them."""
    grants: dict[int, GrantSpan] = {}
    marks: list[Mark] = []
    previous: GrantSpan | None = None
    for event in events:
        token = event.token
        if token is None:
            continue
        kind = event.kind
        if kind in (LeaseEvent.Kind.ACQUIRED, LeaseEvent.Kind.RECLAIMED):
            if kind == LeaseEvent.Kind.RECLAIMED and token - 1 not in grants:
                # no event of the grant taken over (fenced_events="anomalies", or pruned):
                # the takeover's event tells whose it was and when it began
                previous = _taken_over(event, token)
                grants[previous.token] = previous
            if previous is not None and previous.end is None and previous.token == token - 1:
                previous.end, previous.end_kind = event.at, "taken_over"
            grant = GrantSpan(token, event.owner, event.task_id, event.at)
            if kind == LeaseEvent.Kind.RECLAIMED:
                grant.reclaimed = True
                was = event.detail.get("previous_owner", "") if event.detail else ""
                text = f"takeover: token {token} reclaimed the expired grant of {was or '?'}"
                marks.append(Mark(token, event.at, kind, text))
            grants[token] = previous = grant
        elif kind in (LeaseEvent.Kind.RELEASED, LeaseEvent.Kind.FORCE_RELEASED):
            if kind == LeaseEvent.Kind.FORCE_RELEASED and token not in grants:
                # a grant with no event of its start (fenced_events="anomalies", pruned)
                grants[token] = GrantSpan(
                    token, event.owner, event.task_id, _started(event, "acquired_at")
                )
            grant_or_none = grants.get(token)
            if grant_or_none is not None and grant_or_none.end is None:
                grant_or_none.end, grant_or_none.end_kind = event.at, str(kind)
            if kind == LeaseEvent.Kind.FORCE_RELEASED:
                by = event.detail.get("by", "") if event.detail else ""
                marks.append(
                    Mark(token, event.at, kind, f"token {token} force-released by {by or '?'}")
                )
        elif kind == LeaseEvent.Kind.STALE_WRITE_REJECTED:
            current = event.detail.get("current_token") if event.detail else None
            text = f"stale write rejected: token {token}, current token {current}"
            marks.append(Mark(token, event.at, kind, text))
        elif kind == LeaseEvent.Kind.LOST:
            reason = event.detail.get("reason", "") if event.detail else ""
            marks.append(Mark(token, event.at, kind, f"token {token} lost: {reason}"))
    if lease.token not in grants:  # its grant event was pruned: the row still tells
        grants[lease.token] = GrantSpan(lease.token, lease.owner, lease.task_id, lease.acquired_at)
    current = grants[lease.token]
    if current.end is None:
        if lease.released_at is not None:
            current.end, current.end_kind = lease.released_at, "released"
        elif lease.expires_at > now:
            current.end, current.end_kind = now, "held"
        else:
            current.end, current.end_kind = lease.expires_at, "expired"
    # a grant with no event of its end (fenced_events="anomalies", or pruned) was released
    # by its holder before the next grant began: it is drawn up to there
    ordered = sorted(grants.values(), key=lambda g: g.token)
    for grant, following in zip(ordered, [*ordered[1:], None], strict=True):
        if grant.end is None:
            upto = following.start if following is not None else grant.start
            grant.end, grant.end_kind = max(upto, grant.start), "released"
    return ordered, marks


def _taken_over(reclaimed: LeaseEvent, token: int) -> GrantSpan:
    """The grant a ``reclaimed`` event (of ``token``) took over, from the event's detail."""
    owner = str((reclaimed.detail or {}).get("previous_owner", ""))
    return GrantSpan(token - 1, owner, "", _started(reclaimed, "previous_acquired_at"))


def _started(event: LeaseEvent, name: str) -> dt.datetime:
    """The start of a grant that ``event`` names in its detail (at the latest, the event)."""
    text = (event.detail or {}).get(name)
    start = parse_datetime(text) if isinstance(text, str) else None
    if start is not None and start.tzinfo is None:  # SQLite's text: UTC, as Django writes
        start = start.replace(tzinfo=dt.timezone.utc)
    return min(start or event.at, event.at)


def picture(lease: Lease, events_newest_first: Sequence[LeaseEvent], now: dt.datetime) -> Picture:
    """Lay out the timeline of ``lease`` from its newest events."""
    grants, marks = grants_and_marks(lease, reversed(events_newest_first), now)
    tokens = sorted({g.token for g in grants} | {m.token for m in marks})[-MAX_LANES:]
    shown = set(tokens)
    grants = [g for g in grants if g.token in shown]
    marks = [m for m in marks if m.token in shown]
    times = [g.start for g in grants] + [g.end for g in grants if g.end] + [m.at for m in marks]
    start, end = min(times), max(times)
    if end <= start:
        end = start + dt.timedelta(seconds=1)
    span = (end - start).total_seconds()
    plot_right = WIDTH - RIGHT
    plot_width = plot_right - LEFT

    def x(at: dt.datetime) -> float:
        return round(LEFT + (at - start).total_seconds() / span * plot_width, 1)

    # the newest token on top
    lane_y = {token: TOP + i * LANE for i, token in enumerate(reversed(tokens))}
    axis_y = TOP + len(tokens) * LANE + 4
    pic = Picture(
        key=lease.key,
        width=WIDTH,
        height=int(axis_y + AXIS + LEGEND),
        plot_left=LEFT,
        plot_right=plot_right,
        axis_y=axis_y,
        legend_y=axis_y + AXIS,
    )
    pic.lanes = [(lane_y[t] + LANE / 2 + 4, f"token {t}") for t in tokens]
    for grant in grants:
        assert grant.end is not None
        left, right = x(grant.start), x(grant.end)
        inside = right - left >= 160
        room_right = right + 130 <= plot_right
        colour = COLOURS[grant.end_kind]
        title = (
            f"token {grant.token} — {grant.owner or '?'}"
            f"{f' (task {grant.task_id})' if grant.task_id else ''}: "
            f"{_clock(grant.start)} → {_clock(grant.end)}, {END_TEXT[grant.end_kind]}"
        )
        pic.bars.append(
            Bar(
                x=left,
                y=lane_y[grant.token] + (LANE - BAR) / 2,
                width=max(right - left, 2.0),
                colour=colour,
                dashed=grant.end_kind in ("taken_over", "expired"),
                title=title,
                label=_short(grant.owner, 40),
                label_x=left + 5 if inside else right + 5 if room_right else left - 5,
                label_inside=inside,
                label_anchor="start" if inside or room_right else "end",
            )
        )
    placed = _apart([(mark, x(mark.at)) for mark in marks])
    # the small marks last, on top: a "lost" square is never hidden under a diamond
    for mark, at_x in sorted(placed, key=lambda p: DRAW_ORDER.get(p[0].kind, 0)):
        pic.shapes.append(_shape(mark, at_x, lane_y[mark.token] + LANE / 2))
    pic.ticks = [
        Tick(
            round(LEFT + i * plot_width / 4, 1),
            _tick(start + (end - start) * i / 4, span),
            "end" if i == 4 else "middle",
        )
        for i in range(5)
    ]
    pic.span = f"{_clock(start)} → {_clock(end)} UTC"
    return pic


#: Marks drawn later are drawn on top.
DRAW_ORDER = {
    LeaseEvent.Kind.FORCE_RELEASED.value: 0,
    LeaseEvent.Kind.RECLAIMED.value: 1,
    LeaseEvent.Kind.STALE_WRITE_REJECTED.value: 2,
    LeaseEvent.Kind.LOST.value: 3,
}
MARK_GAP = 12.0  # px between the centres of two marks on one lane


def _apart(marks: list[tuple[Mark, float]]) -> list[tuple[Mark, float]]:
    """Marks of one lane closer than :data:`MARK_GAP` moved apart, in time order (a
    refused write and the holder learning of its loss often share a millisecond)."""
    placed: list[tuple[Mark, float]] = []
    last: dict[int, float] = {}
    for mark, at_x in sorted(marks, key=lambda p: (p[0].at, DRAW_ORDER.get(p[0].kind, 0))):
        previous = last.get(mark.token)
        if previous is not None and at_x - previous < MARK_GAP:
            at_x = round(previous + MARK_GAP, 1)
        last[mark.token] = at_x
        placed.append((mark, at_x))
    return placed


def _shape(mark: Mark, x: float, y: float) -> Shape:
    colour = COLOURS[mark.kind]
    if mark.kind == LeaseEvent.Kind.RECLAIMED:  # a triangle pointing up at the new grant
        points = f"{x},{y - 9} {x - 6},{y + 4} {x + 6},{y + 4}"
    elif mark.kind == LeaseEvent.Kind.STALE_WRITE_REJECTED:  # a diamond
        points = f"{x},{y - 8} {x + 7},{y} {x},{y + 8} {x - 7},{y}"
    elif mark.kind == LeaseEvent.Kind.FORCE_RELEASED:  # a bar across the lane
        points = f"{x - 2},{y - 10} {x + 2},{y - 10} {x + 2},{y + 10} {x - 2},{y + 10}"
    else:  # lost: a small square
        points = f"{x - 4},{y - 4} {x + 4},{y - 4} {x + 4},{y + 4} {x - 4},{y + 4}"
    return Shape(
        kind=mark.kind,
        x=x,
        y=y,
        points=points,
        colour=colour,
        title=f"{_clock(mark.at)}: {mark.text}",
    )


def _clock(at: dt.datetime) -> str:
    return at.astimezone(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def _tick(at: dt.datetime, span: float) -> str:
    utc = at.astimezone(dt.timezone.utc)
    if span >= 2 * 86400:
        return utc.strftime("%m-%d %H:%M")
    if span >= 120:
        return utc.strftime("%H:%M")
    return utc.strftime("%H:%M:%S.%f")[:-4] if span < 10 else utc.strftime("%H:%M:%S")


def _short(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"
