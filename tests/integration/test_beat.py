"""The fenced beat's scheduler in this process: leader election, tick bookkeeping and a
stale leader's send refused, on SQLite and PostgreSQL (messages caught at publish)."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery.schedules import crontab, solar
from django.utils import timezone

from celery_fenced import force_release
from celery_fenced.beat import FencedScheduler
from celery_fenced.beat.scheduler import KEY_HEADER, TICK_HEADER, TOKEN_HEADER
from celery_fenced.beat.ticks import tick_task_id
from celery_fenced.models import BeatEntry, LeaseEvent, PendingJob
from tests.integration.test_seams import Broker

pytestmark = [
    pytest.mark.django_db(transaction=True, databases="__all__"),
    pytest.mark.timeout(60),
]

KEY = "celery-beat:seams"


@pytest.fixture
def alias(alias_with_mariadb: str) -> str:
    """SQLite, PostgreSQL and MariaDB."""
    return alias_with_mariadb


@pytest.fixture
def beats(broker: Broker) -> Iterator[list[FencedScheduler]]:
    """Schedulers made by ``make(schedule)``; their leases released afterwards."""
    made: list[FencedScheduler] = []
    yield made
    for scheduler in made:
        scheduler.leadership.release()


def make(broker: Broker, beats: list[FencedScheduler], schedule: Any) -> FencedScheduler:
    broker.app.conf.beat_schedule = {"every": {"task": "seams.sink", "schedule": schedule}}
    scheduler = FencedScheduler(broker.app, lazy=False)
    beats.append(scheduler)
    return scheduler


def sent_ticks(broker: Broker) -> list[str]:
    return [headers[TICK_HEADER] for headers, _ in broker.sent("seams.sink")]


def tick_until_sent(scheduler: FencedScheduler, broker: Broker, count: int) -> None:
    deadline = time.monotonic() + 20
    while len(sent_ticks(broker)) < count:
        assert time.monotonic() < deadline, f"{count} ticks not sent: {sent_ticks(broker)}"
        time.sleep(max(0.0, min(scheduler.tick(), 0.05)))


def test_beat__one_leader_sends_each_tick_once(broker: Broker, beats: list[Any]) -> None:
    leader = make(broker, beats, dt.timedelta(seconds=0.2))
    standby = make(broker, beats, dt.timedelta(seconds=0.2))
    leader.tick()
    assert standby.tick() > 0
    assert leader.leadership.leading()
    assert not standby.leadership.leading()
    deadline = time.monotonic() + 20
    while len(sent_ticks(broker)) < 3:
        assert time.monotonic() < deadline
        leader.tick()
        standby.tick()
        time.sleep(0.02)
    sent = broker.sent("seams.sink")
    ticks = sent_ticks(broker)
    assert len(set(ticks)) == len(ticks)
    row = BeatEntry.objects.get(beat_key=KEY, name="every")
    assert row.sends == len(ticks)
    assert row.last_tick == dt.datetime.fromisoformat(ticks[-1])
    assert row.token == leader.leadership.lease.token
    headers = sent[-1][0]
    assert headers[KEY_HEADER] == KEY
    assert headers[TOKEN_HEADER] == leader.leadership.lease.token
    assert headers["id"] == tick_task_id(KEY, "every", row.last_tick)
    # recorded by the outbox, in the transaction that advanced the entry
    assert PendingJob.objects.filter(task_id=headers["id"], plain=True).exists()
    assert not LeaseEvent.objects.filter(lease__key=KEY, kind=LeaseEvent.Kind.BUSY).exists()


def test_beat__stale_leader_sends_nothing(broker: Broker, beats: list[Any]) -> None:
    stale = make(broker, beats, dt.timedelta(seconds=0.2))
    stale.tick()
    old_token = stale.leadership.lease.token
    force_release(KEY)  # as when its grant expired while it was paused
    successor = make(broker, beats, dt.timedelta(seconds=0.2))
    successor.tick()
    assert successor.leadership.leading()
    # the stale leader, unaware, sends its due entry
    entry = stale.schedule["every"]
    stale.apply_entry(entry)
    assert sent_ticks(broker) == []
    assert not stale.leadership.leading()
    assert not BeatEntry.objects.filter(beat_key=KEY).exists()
    assert LeaseEvent.objects.filter(
        lease__key=KEY, kind=LeaseEvent.Kind.STALE_WRITE_REJECTED, token=old_token
    ).exists()


def test_beat__new_leader_continues_after_the_last_tick(broker: Broker, beats: list[Any]) -> None:
    first = make(broker, beats, dt.timedelta(seconds=0.3))
    tick_until_sent(first, broker, 1)
    first.leadership.release()
    second = make(broker, beats, dt.timedelta(seconds=0.3))
    second.tick()
    assert second.leadership.leading()
    row = BeatEntry.objects.get(beat_key=KEY, name="every")
    assert second.schedule["every"].last_run_at == row.last_tick
    tick_until_sent(second, broker, 2)
    first_tick, second_tick = (dt.datetime.fromisoformat(x) for x in sent_ticks(broker))
    assert second_tick - first_tick >= dt.timedelta(seconds=0.3)
    assert BeatEntry.objects.get(beat_key=KEY, name="every").sends == 2


def test_beat__a_tick_sent_by_another_leader_is_not_sent_again(
    broker: Broker, beats: list[Any]
) -> None:
    leader = make(broker, beats, dt.timedelta(seconds=0.2))
    tick_until_sent(leader, broker, 1)
    # the row moved past what this leader knows (another term's leader sent a tick)
    BeatEntry.objects.filter(beat_key=KEY).update(sends=5, last_tick=timezone.now())
    deadline = time.monotonic() + 5
    while leader._known["every"].sends != 5:
        assert time.monotonic() < deadline
        leader.tick()
        time.sleep(0.02)
    assert len(sent_ticks(broker)) == 1
    tick_until_sent(leader, broker, 2)
    assert BeatEntry.objects.get(beat_key=KEY).sends == 6


@pytest.mark.parametrize("expires", [None, 3600, 60])
def test_beat__tick_missed_during_takeover(
    broker: Broker, beats: list[Any], expires: int | None
) -> None:
    """Missed for 10 minutes: sent once at takeover, or skipped when its ``expires`` (in
    seconds) is shorter than how late it is; then on schedule again."""
    BeatEntry.objects.create(
        beat_key=KEY, name="every", sends=1, last_tick=timezone.now() - dt.timedelta(minutes=11)
    )
    broker.app.conf.beat_schedule = {
        "every": {
            "task": "seams.sink",
            "schedule": dt.timedelta(minutes=1),
            "options": {} if expires is None else {"expires": expires},
        }
    }
    leader = FencedScheduler(broker.app, lazy=False)
    beats.append(leader)
    for _ in range(5):
        leader.tick()
    assert len(sent_ticks(broker)) == (0 if expires == 60 else 1)
    row = BeatEntry.objects.get(beat_key=KEY)
    assert row.sends == 2
    assert timezone.now() - row.last_tick < dt.timedelta(seconds=30)


@pytest.mark.parametrize(
    "schedule",
    [crontab(minute="*"), solar("sunrise", 0, 0)],
    ids=["crontab", "solar"],
)
def test_beat__schedules_continue_from_the_database(
    broker: Broker, beats: list[Any], schedule: Any
) -> None:
    BeatEntry.objects.create(
        beat_key=KEY, name="every", sends=3, last_tick=timezone.now() - dt.timedelta(days=3)
    )
    leader = make(broker, beats, schedule)
    for _ in range(5):
        leader.tick()
    assert len(sent_ticks(broker)) == 1  # due long ago: sent once, not once per missed tick
    assert BeatEntry.objects.get(beat_key=KEY).sends == 4


def test_beat__command_says_who_leads(broker: Broker, beats: list[Any]) -> None:
    from io import StringIO

    from django.core.management import call_command

    leader = make(broker, beats, dt.timedelta(seconds=0.2))
    tick_until_sent(leader, broker, 1)
    out = StringIO()
    call_command("fenced", "beat", stdout=out)
    text = out.getvalue()
    assert (
        f"{KEY}: led by {leader.leadership.owner} (token {leader.leadership.lease.token}" in text
    )
    assert "every: last tick" in text
    leader.leadership.release()
    out = StringIO()
    call_command("fenced", "beat", stdout=out)
    assert f"{KEY}: no leader" in out.getvalue()


def test_beat__admin_lists_entries_read_only(admin_client: Any) -> None:
    BeatEntry.objects.create(beat_key=KEY, name="nightly", sends=2, last_tick=timezone.now())
    page = admin_client.get("/admin/celery_fenced/beatentry/")
    assert page.status_code == 200
    assert b"nightly" in page.content
    assert admin_client.get("/admin/celery_fenced/beatentry/add/").status_code == 403


@pytest.mark.parametrize(("one", "other"), [("Report", "report"), ("pad", "pad ")])
def test_beat__entry_names_compare_byte_for_byte(
    broker: Broker, beats: list[Any], one: str, other: str
) -> None:
    """Two entries whose names differ only in case or trailing spaces are two rows, each
    with its own ticks (MariaDB's default collation made them one)."""
    every = dt.timedelta(seconds=0.2)
    broker.app.conf.beat_schedule = {
        one: {"task": "seams.sink", "schedule": every},
        other: {"task": "seams.sink", "schedule": every},
    }
    scheduler = FencedScheduler(broker.app, lazy=False)
    beats.append(scheduler)
    tick_until_sent(scheduler, broker, 6)
    rows = {row.name: row.sends for row in BeatEntry.objects.filter(beat_key=KEY)}
    assert set(rows) == {one, other}
    assert min(rows.values()) >= 2
    assert sum(rows.values()) == len(sent_ticks(broker))


def test_standby_whose_session_the_server_ended__leads_once_the_key_is_free(
    broker: Broker, beats: list[Any], lease_db: str
) -> None:
    """A restart or a failover ends every session: a standby's look at the leader then
    fails once, and the standby opens a new session for the next one, so it still takes
    over when the leader is gone (it kept failing on the dead session before)."""
    from django.db import connections

    from tests.conftest import side_connection
    from tests.integration.test_kept_connection import backend_pid, eventually, session_ended

    if lease_db != "postgres":
        pytest.skip("ends a PostgreSQL session")
    leader = make(broker, beats, dt.timedelta(seconds=60))
    standby = make(broker, beats, dt.timedelta(seconds=60))
    leader.tick()
    assert standby.tick() > 0
    leader.leadership.release()  # the leader gone: its key free
    pid = backend_pid(connections[lease_db])
    with side_connection(lease_db) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", [pid])
    assert eventually(lambda: session_ended(lease_db, pid))
    standby.tick()  # fails on the ended session
    assert not standby.leadership.leading()
    standby.tick()
    assert standby.leadership.leading()
