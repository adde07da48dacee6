"""The beat workload's invariant, "each tick sent once", on the runs of a fenced beat's
entry: ``demo.beat_tick`` (testproject/demo/beat_tasks.py) writes one ledger row per
run, with its tick and the leader's token; the entry's ``BeatEntry`` row counts the
ticks sent.
"""

from __future__ import annotations

import datetime as dt
import itertools
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class TickRun:
    """One run of a tick's task: the tick, and the token of the leader that sent it."""

    tick: dt.datetime
    token: int


def check_ticks(runs: Iterable[TickRun], sends: int, interval: float) -> list[str]:
    """What breaks "each tick sent once" in ``runs`` of an entry that recorded ``sends``
    ticks every ``interval`` seconds: a tick run twice, a tick sent and never run (or
    run unsent), two ticks closer than the interval (two leaders sent one due time),
    a later tick sent under an older token (a stale leader was heard)."""
    runs = list(runs)
    counts = Counter(run.tick for run in runs)
    problems = [
        f"tick {tick.isoformat()} ran {n} times" for tick, n in sorted(counts.items()) if n > 1
    ]
    if len(counts) != sends:
        problems.append(f"{sends} ticks sent, {len(counts)} ran")
    for a, b in itertools.pairwise(sorted(counts)):
        if (b - a).total_seconds() < interval - 0.01:
            problems.append(f"ticks {a.isoformat()} and {b.isoformat()} closer than {interval}s")
    tokens = sorted({(run.tick, run.token) for run in runs})
    for (a, older), (b, token) in itertools.pairwise(tokens):
        if token < older:
            problems.append(
                f"tick {b.isoformat()} sent under token {token} after tick "
                f"{a.isoformat()} under {older}"
            )
    return problems


def read_runs(alias: str) -> list[TickRun]:
    """The beat ticks' runs in the ledger of database ``alias``."""
    from testproject.demo.models import ChaosEntry

    rows = ChaosEntry.objects.using(alias).filter(via="beat").values_list("job", "token")
    return [
        TickRun(dt.datetime.fromisoformat(job.removeprefix("beat:")), token) for job, token in rows
    ]
