"""How the ``fenced`` subcommands write: where (:class:`IO`), aligned tables with cut
cells, JSON, dates, and the prune's progress bar. Free of Django."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import IO as Stream
from typing import Any, TextIO, cast

import click

#: the ``fenced`` command's one-line help, for ``manage.py fenced`` and ``celery fenced``
HELP = (
    "Inspect and operate celery-fenced leases: list, show KEY, release KEY, "
    "prune --older-than DAYS, reclaim, beat."
)


@dataclass(frozen=True)
class IO:
    """Where a subcommand writes: lines of output, errors, and a progress TTY (or None)."""

    write: Callable[[str], None]
    error: Callable[[str], None]
    progress: Stream[str] | None = None


def written_as_json_or_empty(
    io: IO, options: dict[str, Any], records: list[dict[str, Any]], empty: str
) -> bool:
    """Write ``records`` as JSON (``--json``) or ``empty`` when there are none; whether
    that was all there is to write."""
    if options.get("json"):
        io.write(json.dumps(records, indent=2))
        return True
    if not records:
        io.write(empty)
        return True
    return False


def write_table(
    io: IO,
    header: tuple[str, ...],
    rows: Iterable[tuple[str, ...]],
    limit: int,
    count: int,
    whole: tuple[int, ...],
) -> None:
    """A listing's table, and a word when ``--limit`` cut it short."""
    for line in table(header, rows, whole=whole):
        io.write(line)
    if limit and count == limit:
        io.write(f"(first {limit}; --limit 0 lists all)")


def table(
    header: tuple[str, ...],
    rows: Iterable[tuple[str, ...]],
    limit: int = 48,
    whole: tuple[int, ...] = (),
) -> list[str]:
    """Aligned columns, each cell cut at ``limit`` characters but those of the columns
    ``whole`` (the keys and ids someone pastes into another command)."""
    cells = [
        tuple(
            cell.replace("\n", " ") if i in whole else cut(cell, limit)
            for i, cell in enumerate(row)
        )
        for row in rows
    ]
    widths = [
        max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(header)
    ]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip()]
    lines += [
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells
    ]
    return lines


def cut(text: str, limit: int) -> str:
    text = text.replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def iso(value: dt.datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def detail(detail: Any) -> str:
    return json.dumps(detail, sort_keys=True) if detail else ""


class Progress:
    """The prune's progress, as ``click.progressbar`` draws it on a TTY (in place)."""

    def __init__(self, stream: Stream[str]) -> None:
        self.stream = stream
        self.bar: Any = None
        self.done = 0

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            self.bar = click.progressbar(
                length=total,
                label="events",
                file=cast(TextIO, self.stream),
                show_pos=True,
                show_percent=True,
            )
        self.bar.length = max(self.bar.length, total)
        self.bar.update(done - self.done)
        self.done = done

    def close(self) -> None:
        if self.bar is not None:
            self.bar.render_finish()
