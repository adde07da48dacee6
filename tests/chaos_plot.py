"""A picture of a chaos run (``python -m tests.chaos --plot PATH``): an SVG drawn from the
lease events alone (the database's clock) — takeovers and stale writes rejected so far,
and leases held, over the run; PostgreSQL's restart shaded."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

GRANTS = ("acquired", "reclaimed")
ENDS = ("released", "force_released")
WIDTH, PANEL, MARGIN = 900, 150, 50


def timelines(events: Iterable[Any]) -> dict[str, list[tuple[dt.datetime, int]]]:
    """Step series, each ``[(moment, value after it)]``: takeovers and stale writes so far,
    and grants held (from each grant to its release or the key's next grant)."""
    ordered = sorted(events, key=lambda e: (e.at, e.id))
    takeovers: list[tuple[dt.datetime, int]] = []
    stale: list[tuple[dt.datetime, int]] = []
    held: list[tuple[dt.datetime, int]] = []
    current: dict[int, int] = {}  # lease row -> the token of its grant still held
    for e in ordered:
        if e.kind == "reclaimed":
            takeovers.append((e.at, len(takeovers) + 1))
        elif e.kind == "stale_write_rejected":
            stale.append((e.at, len(stale) + 1))
        if e.kind in GRANTS:
            current[e.lease_id] = e.token
        elif e.kind in ENDS and current.get(e.lease_id) == e.token:
            del current[e.lease_id]
        else:
            continue
        held.append((e.at, len(current)))
    return {"takeovers": takeovers, "stale writes rejected": stale, "leases held": held}


def svg(events: Iterable[Any], shaded: Sequence[tuple[dt.datetime, dt.datetime]] = ()) -> str:
    """The run as an SVG: counts so far above, leases held below."""
    lines = timelines(events)
    moments = [t for series in lines.values() for t, _ in series]
    if not moments:
        return f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="40"></svg>'
    start, end = min(moments), max(moments)
    span = max((end - start).total_seconds(), 1e-3)

    def x(moment: dt.datetime) -> float:
        return MARGIN + (WIDTH - 2 * MARGIN) * (moment - start).total_seconds() / span

    height = 2 * PANEL + 3 * MARGIN
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        'font-family="sans-serif" font-size="12">',
        '<rect width="100%" height="100%" fill="white"/>',
    ]
    for begin, finish in shaded:
        left, right = x(max(begin, start)), x(min(finish, end))
        if right > left:
            parts.append(
                f'<rect x="{left:.1f}" y="{MARGIN}" width="{right - left:.1f}" '
                f'height="{height - 2 * MARGIN}" fill="#fde2e2"/>'
                f'<text x="{left:.1f}" y="{MARGIN - 5}" fill="#b00">PostgreSQL restart</text>'
            )
    panels = [
        (MARGIN, ["takeovers", "stale writes rejected"], "so far"),
        (2 * MARGIN + PANEL, ["leases held"], "at the moment"),
    ]
    colours = {
        "takeovers": "#1f77b4",
        "stale writes rejected": "#d62728",
        "leases held": "#2ca02c",
    }
    for top, names, what in panels:
        peak = max([1, *(v for name in names for _, v in lines[name])])
        bottom = top + PANEL
        parts.append(
            f'<line x1="{MARGIN}" y1="{bottom}" x2="{WIDTH - MARGIN}" y2="{bottom}" '
            'stroke="#888"/>'
            f'<text x="5" y="{top + 10}">{peak}</text><text x="5" y="{bottom}">0</text>'
        )
        for n, name in enumerate(names):
            points = [(MARGIN, bottom)]
            level = 0
            for moment, value in lines[name]:
                points.append((x(moment), bottom - PANEL * level / peak))
                level = value
                points.append((x(moment), bottom - PANEL * level / peak))
            points.append((WIDTH - MARGIN, bottom - PANEL * level / peak))
            path = " ".join(f"{px:.1f},{py:.1f}" for px, py in points)
            parts.append(
                f'<polyline fill="none" stroke="{colours[name]}" stroke-width="1.5" '
                f'points="{path}"/>'
                f'<text x="{MARGIN + 10 + 260 * n}" y="{top + 14}" fill="{colours[name]}">'
                f"{name} {what} ({level})</text>"
            )
    parts.append(
        f'<text x="{MARGIN}" y="{height - 10}">0 s</text>'
        f'<text x="{WIDTH - MARGIN - 60}" y="{height - 10}">{span:.0f} s '
        "(database clock)</text></svg>"
    )
    return "\n".join(parts)


def write(path: Path, events: Iterable[Any], shaded: Sequence[Any] = ()) -> None:
    path.write_text(svg(events, shaded))
