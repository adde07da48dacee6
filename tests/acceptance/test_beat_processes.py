"""Three real `celery beat` processes with the fenced scheduler and a real worker: the
leader paused past its ttl and resumed, the next one killed, a standby started late —
every tick of a 1-second entry runs once (on Redis, and on RabbitMQ with PostgreSQL), and
an every-minute crontab entry's ticks once each, for the minutes the test crosses (at
most one: a test waiting for several minutes would be too slow); and two beats with
``FencedDatabaseScheduler`` on a django-celery-beat interval entry."""

from __future__ import annotations

import datetime as dt
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from celery_fenced.models import BeatEntry, Lease
from devtools.beats import Beat
from devtools.workers import wait_for
from testproject.demo.models import ChaosEntry
from tests.chaos_beat import check_ticks, read_runs

pytestmark = [
    pytest.mark.django_db(transaction=True, databases="__all__"),
    pytest.mark.workers,
    pytest.mark.timeout(180),
]

KEY = "celery-beat:testproject"
TTL = 2.0


@pytest.fixture
def start_beat(
    alias: str, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Callable[[str, dict[str, Any]], Beat]]:
    started: list[Beat] = []

    def start(name: str, schedule: dict[str, Any], scheduler: str = "default") -> Beat:
        beat = Beat(
            name,
            database=alias,
            schedule=schedule,
            ttl=TTL,
            log_dir=tmp_path,
            scheduler=scheduler,
        )
        started.append(beat)
        return beat

    yield start
    for beat in started:
        beat.stop()
    if getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed:
        for beat in started:
            print(f"--- log of {beat.name}\n{beat.output()[-4000:]}")


def leader_pid(alias: str) -> int | None:
    """The pid in the owner of the beat lease's current grant (None: nobody leads)."""
    from celery_fenced import store

    row = Lease.objects.using(alias).filter(key=KEY).first()
    if row is None or row.released_at is not None or row.expires_at <= store.database_now(alias):
        return None
    return int(row.owner.split(":")[1])


def minutes(since: dt.datetime, until: dt.datetime) -> int:
    """How many minute boundaries lie in (``since``, ``until``]."""
    return max(0, int(until.timestamp() // 60) - int(since.timestamp() // 60))


def runs(alias: str) -> Counter[str]:
    """How many times each tick's task ran."""
    return Counter(
        ChaosEntry.objects.using(alias).filter(via="beat").values_list("job", flat=True)
    )


def test_beat__each_tick_runs_once_across_pauses_kills_and_late_standbys(
    alias: str, start_worker: Any, start_beat: Callable[[str, dict[str, Any]], Beat]
) -> None:
    start_worker("w", extra_args=["--include", "testproject.demo.beat_tasks"])
    options = {"queue": start_worker.queue}
    schedule = {
        "tick": {"task": "demo.beat_tick", "schedule": 1.0, "options": options},
        # every minute: the test sees at most one of its ticks (see the end)
        "cron": {"task": "demo.beat_tick", "schedule": {"crontab": {}}, "options": options},
    }
    starting = timezone.now()
    beats = {b.pid: b for b in (start_beat(name, schedule) for name in ("a", "b", "c"))}
    for beat in beats.values():
        beat.wait_started()
    started = timezone.now()

    def ticks_ran(count: int) -> Callable[[], bool]:
        return lambda: len(runs(alias)) >= count

    wait_for(ticks_ran(3), 30, "three ticks to run")
    first = wait_for(lambda: leader_pid(alias), 10, "a leader")

    # paused for 3x its ttl: another takes over; resumed, it sends nothing
    paused = beats[first]
    paused.pause()
    paused_at = time.monotonic()
    second = wait_for(lambda: (p := leader_pid(alias)) not in (None, first) and p, 10, "takeover")
    before = len(runs(alias))
    wait_for(ticks_ran(before + 3), 15, "ticks under the second leader")
    wait_for(lambda: time.monotonic() - paused_at >= 3 * TTL, 10, "three ttls of the pause")
    paused.resume()
    wait_for(
        lambda: "beat no longer leads" in paused.output(), 15, "the resumed leader to step down"
    )

    # the second leader killed: the third (or the resumed one) takes over
    beats[second].kill()
    third = wait_for(lambda: (p := leader_pid(alias)) not in (None, second) and p, 15, "takeover")
    before = len(runs(alias))
    wait_for(ticks_ran(before + 2), 15, "ticks under the third leader")

    # a standby started late joins; the leader killed again, a survivor takes over
    late = start_beat("late", schedule)
    beats[late.pid] = late
    late.wait_started()
    beats[third].kill()
    wait_for(lambda: leader_pid(alias) not in (None, third), 15, "a last takeover")
    before = len(runs(alias))
    wait_for(ticks_ran(before + 2), 15, "ticks under the last leader")

    for beat in beats.values():
        beat.stop()
    ended = timezone.now()
    row = BeatEntry.objects.using(alias).get(beat_key=KEY, name="tick")
    cron = BeatEntry.objects.using(alias).filter(beat_key=KEY, name="cron").first()
    cron_sends = cron.sends if cron is not None else 0
    sends = row.sends + cron_sends
    wait_for(lambda: len(runs(alias)) >= sends, 15, "every sent tick to run")
    counts = runs(alias)
    print(f"ticks sent {row.sends} + {cron_sends}, ran {len(counts)}, runs {sum(counts.values())}")
    assert check_ticks(read_runs(alias, KEY, "tick"), row.sends, interval=1.0) == []
    tokens = {run.token for run in read_runs(alias, KEY, "tick")}
    assert len(tokens) >= 4  # four leaders sent: one token each
    # the crontab entry: a minute's tick sent once when the run crossed a minute, by
    # whichever beat led then (one that fell due in a takeover: by the next leader)
    assert check_ticks(read_runs(alias, KEY, "cron"), cron_sends, interval=60.0) == []
    assert minutes(started, ended - dt.timedelta(seconds=3)) <= cron_sends
    assert cron_sends <= minutes(starting, ended)


@pytest.mark.parametrize("alias", ["postgres"], indirect=True)
@pytest.mark.parametrize("broker", ["redis"], indirect=True)
def test_database_beat__each_tick_runs_once_when_the_paused_leader_resumes(
    alias: str, start_worker: Any, start_beat: Callable[..., Beat]
) -> None:
    """django-celery-beat's ``IntervalSchedule`` entry, two beats: the leader paused for
    three ttls and resumed sends nothing; each tick runs once, and the ``PeriodicTask``
    counts the ticks the ``BeatEntry`` does (saved in each tick's transaction)."""
    from django_celery_beat.models import IntervalSchedule, PeriodicTask

    start_worker("w", extra_args=["--include", "testproject.demo.beat_tasks"])
    every = IntervalSchedule.objects.using(alias).create(every=1, period=IntervalSchedule.SECONDS)
    PeriodicTask.objects.using(alias).create(
        name="db-tick", task="demo.beat_tick", interval=every, queue=start_worker.queue
    )
    beats = {b.pid: b for b in (start_beat(n, {}, "database") for n in ("a", "b"))}
    for beat in beats.values():
        beat.wait_started()
    wait_for(lambda: len(runs(alias)) >= 3, 30, "three ticks to run")
    first = wait_for(lambda: leader_pid(alias), 10, "a leader")

    paused = beats[first]
    paused.pause()
    paused_at = time.monotonic()
    wait_for(lambda: leader_pid(alias) not in (None, first), 10, "the takeover")
    before = len(runs(alias))
    wait_for(lambda: len(runs(alias)) >= before + 3, 15, "ticks under the second leader")
    wait_for(lambda: time.monotonic() - paused_at >= 3 * TTL, 10, "three ttls of the pause")
    paused.resume()
    wait_for(
        lambda: "beat no longer leads" in paused.output(), 15, "the resumed leader to step down"
    )
    before = len(runs(alias))
    wait_for(lambda: len(runs(alias)) >= before + 2, 15, "ticks after the resume")

    for beat in beats.values():
        beat.stop()
    row = BeatEntry.objects.using(alias).get(beat_key=KEY, name="db-tick")
    wait_for(lambda: len(runs(alias)) >= row.sends, 15, "every sent tick to run")
    counts = runs(alias)
    print(f"ticks sent {row.sends}, ran {len(counts)}, runs {sum(counts.values())}")
    assert check_ticks(read_runs(alias), row.sends, interval=1.0) == []
    assert PeriodicTask.objects.using(alias).get(name="db-tick").total_run_count == row.sends
    assert len({run.token for run in read_runs(alias)}) >= 2
