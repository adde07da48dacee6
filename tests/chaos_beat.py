"""The beat workload's invariant, "each tick sent once", on the runs of a fenced beat's
entry: ``demo.beat_tick`` (testproject/demo/beat_tasks.py) writes one ledger row per
run, with its tick and the leader's token; the entry's ``BeatEntry`` row counts the
ticks sent. :class:`BeatChaos` is the chaos runner's beat workload (tests/chaos.py):
real beat processes paused and killed while the jobs run, checked by :func:`check_ticks`.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import itertools
import random
import time
import uuid
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from devtools.beats import Beat
from devtools.workers import Worker, wait_for


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


def read_runs(alias: str, key: str | None = None, name: str | None = None) -> list[TickRun]:
    """The beat ticks' runs in the ledger of database ``alias``; with ``key`` and ``name``,
    only those of that entry (its ticks' task ids)."""
    from celery_fenced.beat.ticks import tick_task_id
    from testproject.demo.models import ChaosEntry

    rows = (
        ChaosEntry.objects.using(alias).filter(via="beat").values_list("job", "token", "task_id")
    )
    runs = []
    for job, token, task_id in rows.values_list("job", "token", "task_id"):
        tick = dt.datetime.fromisoformat(job.removeprefix("beat:"))
        if key is None or name is None or task_id == tick_task_id(key, name, tick):
            runs.append(TickRun(tick, token))
    return runs


# -- the chaos runner's beat workload ----------------------------------------------------
#: the invariant's row in the chaos runner's summary (after the seams' (a) to (h))
SEAM = ("beat-ticks", "beat ticks not sent exactly once across leaders (l)")
#: the beat key of the testproject app (``fenced_beat_key`` unset)
KEY = "celery-beat:testproject"
ENTRY = "chaos-tick"
INTERVAL = 1.0


@dataclass
class BeatSlot:
    """A beat position: its current process, paused until (monotonic) or running."""

    beat: Beat
    paused_until: float | None = None


@dataclass
class BeatChaos:
    """``count`` real `celery beat` processes (``FencedScheduler``, ttl ``ttl``) sending
    entry ``chaos-tick`` every second to their own worker, which the chaos leaves alone;
    every few seconds a beat (the leader, mostly) is paused for about its ttl or killed
    and started again."""

    env: dict[str, str]
    log_dir: Path
    ttl: float
    rng: random.Random
    count: int = 3
    queue: str = field(default_factory=lambda: f"beat-{uuid.uuid4().hex[:8]}")
    slots: list[BeatSlot] = field(default_factory=list)
    worker: Worker | None = None
    pauses: int = 0
    kills: int = 0
    restarts: int = 0  # of the tick worker, after it exited on its own
    next_chaos: float = 0.0
    log: list[str] = field(default_factory=list)

    def schedule(self) -> dict[str, Any]:
        return {
            ENTRY: {
                "task": "demo.beat_tick",
                "schedule": INTERVAL,
                "options": {"queue": self.queue},
            }
        }

    def _beat(self, index: int) -> Beat:
        return Beat(
            f"beat{index}",
            database="postgres",
            schedule=self.schedule(),
            ttl=self.ttl,
            log_dir=self.log_dir,
            env=self.env,
        )

    def _worker(self) -> Worker:
        return Worker(
            "beatw",
            database="postgres",
            queue=self.queue,
            pool="threads",
            concurrency=2,
            env=self.env,
            log_dir=self.log_dir,
            extra_args=["--include", "testproject.demo.beat_tasks"],
        )

    def start(self) -> None:
        """Start the worker and the beats (:meth:`wait_ready` waits for them)."""
        self.worker = self._worker()
        self.slots = [BeatSlot(self._beat(i)) for i in range(self.count)]

    def wait_ready(self) -> None:
        assert self.worker is not None
        self.worker.wait_ready(timeout=180)
        for slot in self.slots:
            slot.beat.wait_started()
        self.next_chaos = time.monotonic() + self.rng.uniform(2, 5)

    def leader(self) -> BeatSlot | None:
        """The slot whose process holds the beat lease's current grant (DB clock)."""
        from celery_fenced import store
        from celery_fenced.models import Lease

        try:
            row = Lease.objects.filter(key=KEY).first()
            if (
                row is None
                or row.released_at is not None
                or row.expires_at <= store.database_now()
            ):
                return None
        except Exception:
            return None
        pid = int(row.owner.split(":")[1])
        return next((s for s in self.slots if s.beat.pid == pid), None)

    def step(self, now: float, note: Any) -> None:
        """Resume the beats due; revive the tick worker; now and then a pause or a kill."""
        for slot in self.slots:
            if slot.paused_until is not None and now >= slot.paused_until:
                slot.beat.resume()
                slot.paused_until = None
        if self.worker is not None and self.worker.process.poll() is not None:
            self.restarts += 1
            note(f"{self.worker.name} exited on its own; starting it again")
            self.worker.stop()
            self.worker = self._worker()
        if now < self.next_chaos:
            return
        self.next_chaos = now + self.rng.uniform(2, 5)
        running = [s for s in self.slots if s.paused_until is None]
        if len(running) <= 1:
            return  # one beat always runs
        leader = self.leader()
        slot = leader if leader in running and self.rng.random() < 0.75 else None
        slot = slot or self.rng.choice(running)
        if self.rng.random() < 0.3:
            index = self.slots.index(slot)
            slot.beat.stop()
            self.slots[index] = BeatSlot(self._beat(index))
            self.kills += 1
            mark = " (leader)" if slot is leader else ""
            note(f"kill beat {slot.beat.name}{mark}; started {self.slots[index].beat.name}")
            return
        seconds = self.rng.uniform(0.5, 3.0) * self.ttl
        slot.beat.pause()
        slot.paused_until = now + seconds
        self.pauses += 1
        note(f"pause beat {slot.beat.name}{' (leader)' if slot is leader else ''} {seconds:.1f}s")

    def heal(self) -> None:
        for slot in self.slots:
            if slot.paused_until is not None:
                slot.beat.resume()
                slot.paused_until = None

    def stop(self, timeout: float = 30) -> None:
        """Stop the beats, let the worker run every tick sent, then stop it."""
        from celery_fenced.models import BeatEntry

        for slot in self.slots:
            slot.beat.stop()
        row = BeatEntry.objects.filter(beat_key=KEY, name=ENTRY).first()
        sends = row.sends if row is not None else 0
        with contextlib.suppress(AssertionError):
            wait_for(
                lambda: len({r.tick for r in read_runs("default")}) >= sends, timeout, "ticks"
            )
        if self.worker is not None:
            self.worker.stop()

    def check(self) -> tuple[list[tuple[str, Any]], list[str]]:
        """The summary's rows of the beat workload, and what breaks "each tick sent once"."""
        from celery_fenced.models import BeatEntry

        row = BeatEntry.objects.filter(beat_key=KEY, name=ENTRY).first()
        runs = read_runs("default")
        sends = row.sends if row is not None else 0
        tokens = sorted({run.token for run in runs})
        rows: list[tuple[str, Any]] = [
            (f"beat processes ({self.count}), pauses / kills", f"{self.pauses} / {self.kills}"),
            ("beat tick worker: exited on its own (started again)", self.restarts),
            (
                "beat ticks sent / run / leaders' tokens",
                f"{sends} / {len(runs)} / {len(tokens)}",
            ),
        ]
        problems = check_ticks(runs, sends, INTERVAL)
        if sends == 0:
            problems.append("no beat tick was sent")
        return rows, problems
