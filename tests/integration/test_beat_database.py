"""``FencedDatabaseScheduler``: django-celery-beat's entries, one leader, each tick once,
entries added while it runs — on SQLite and PostgreSQL (messages caught at publish)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from django_celery_beat.models import IntervalSchedule, PeriodicTask

from celery_fenced.beat import FencedDatabaseScheduler
from celery_fenced.beat.scheduler import TICK_HEADER
from celery_fenced.models import BeatEntry
from tests.integration.test_seams import Broker

pytestmark = [
    pytest.mark.django_db(transaction=True, databases="__all__"),
    pytest.mark.timeout(90),
]

KEY = "celery-beat:seams"


@pytest.fixture
def alias(alias_with_mariadb: str) -> str:
    """SQLite, PostgreSQL and MariaDB."""
    return alias_with_mariadb


@pytest.fixture
def beats(broker: Broker) -> Iterator[list[Any]]:
    made: list[Any] = []
    broker.app.conf.beat_schedule = {}
    broker.app.conf.result_expires = None  # no default cleanup entry
    yield made
    for scheduler in made:
        scheduler.leadership.release()


def periodic(name: str) -> PeriodicTask:
    every, _ = IntervalSchedule.objects.get_or_create(every=1, period=IntervalSchedule.SECONDS)
    return PeriodicTask.objects.create(name=name, task="seams.sink", interval=every)


def make(broker: Broker, beats: list[Any]) -> Any:
    scheduler = FencedDatabaseScheduler(app=broker.app, lazy=False)
    beats.append(scheduler)
    return scheduler


def sent(broker: Broker, name: str) -> list[str]:
    return [
        h[TICK_HEADER] for h, _ in broker.sent("seams.sink") if h.get("periodic_task_name") == name
    ]


def run(schedulers: list[Any], until: Any, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, "timed out"
        for scheduler in schedulers:
            scheduler.tick()
        time.sleep(0.05)


def test_fenced_database_scheduler__one_leader_each_tick_once(
    broker: Broker, beats: list[Any]
) -> None:
    periodic("p")
    leader, standby = make(broker, beats), make(broker, beats)
    run([leader, standby], lambda: len(sent(broker, "p")) >= 2)
    assert leader.leadership.leading()
    assert not standby.leadership.leading()
    ticks = sent(broker, "p")
    assert len(set(ticks)) == len(ticks)
    assert BeatEntry.objects.get(beat_key=KEY, name="p").sends == len(ticks)


def test_fenced_database_scheduler__entries_added_while_running(
    broker: Broker, beats: list[Any]
) -> None:
    periodic("p")
    leader = make(broker, beats)
    run([leader], lambda: len(sent(broker, "p")) >= 1)
    periodic("q")  # django-celery-beat marks its schedule changed
    run([leader], lambda: len(sent(broker, "q")) >= 1)
    PeriodicTask.objects.filter(name="q").update(enabled=False)
    from django_celery_beat.models import PeriodicTasks

    PeriodicTasks.update_changed()
    count = len(sent(broker, "q"))
    run([leader], lambda: len(sent(broker, "p")) >= 4)
    assert len(sent(broker, "q")) <= count + 1  # at most one already due at the change


def test_fenced_database_scheduler__new_leader_continues(broker: Broker, beats: list[Any]) -> None:
    periodic("p")
    first = make(broker, beats)
    run([first], lambda: len(sent(broker, "p")) >= 1)
    first.leadership.release()
    second = make(broker, beats)
    run([second], lambda: len(sent(broker, "p")) >= 3)
    ticks = sent(broker, "p")
    assert len(set(ticks)) == len(ticks)
    assert BeatEntry.objects.get(beat_key=KEY, name="p").sends == len(ticks)


def test_fenced_database_scheduler__first_tick_recorded(
    broker: Broker, beats: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """django-celery-beat's ``sync`` (which closes a connection left outside autocommit)
    runs outside the tick's transaction: the first tick is recorded at once."""
    periodic("p")
    leader = make(broker, beats)
    run([leader], lambda: len(sent(broker, "p")) >= 2)
    assert "was sent by another leader" not in caplog.text
    assert BeatEntry.objects.get(beat_key=KEY, name="p").sends == len(sent(broker, "p"))
    assert PeriodicTask.objects.get(name="p").total_run_count >= 1


def test_fenced_database_scheduler__one_off_sent_once_across_leaders(
    broker: Broker, beats: list[Any]
) -> None:
    from django.utils import timezone
    from django_celery_beat.models import ClockedSchedule

    periodic("p")
    first = make(broker, beats)
    run([first], lambda: len(sent(broker, "p")) >= 1)  # django-celery-beat saved here
    clock = ClockedSchedule.objects.create(clocked_time=timezone.now())
    PeriodicTask.objects.create(name="once", task="seams.sink", clocked=clock, one_off=True)
    run([first], lambda: len(sent(broker, "once")) >= 1)
    first.leadership.release()  # it stops before django-celery-beat's next save (3 min)
    second = make(broker, beats)
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        second.tick()
        time.sleep(0.05)
    assert second.leadership.leading()
    assert len(sent(broker, "once")) == 1
