"""The operations shared by the admin and the commands: state, counting, task names."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
import time_machine
from django.db import connections
from django.db.models import F

from celery_fenced import acquire, operations
from celery_fenced.models import Lease
from tests.conftest import DATABASE_ALIASES

pytestmark = pytest.mark.django_db(transaction=True, databases=DATABASE_ALIASES)


def states(alias: str) -> dict[str, str]:
    return {lease.key: lease.state for lease in operations.leases(using=alias)}  # type: ignore[attr-defined]


@pytest.mark.parametrize("shift_days", [0, 3, -3])
def test_state__uses_the_database_clock_not_this_process(alias: str, shift_days: int) -> None:
    acquire("held", ttl=600, using=alias)
    acquire("expired", ttl=600, using=alias)
    Lease.objects.using(alias).filter(key="expired").update(expires_at=F("acquired_at"))
    acquire("released", ttl=600, using=alias).release()
    expected = {"held": "held", "expired": "expired", "released": "released"}
    when = dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=shift_days)
    with time_machine.travel(when, tick=False):
        assert states(alias) == expected
        for state in operations.STATES:
            keys = operations.leases(state=state, using=alias).values_list("key", flat=True)
            assert list(keys) == [state]
        seconds = operations.expires_in(operations.find("held", using=alias))  # type: ignore[arg-type]
        assert seconds is not None
        assert 0 < seconds <= 600  # not days more or less


def test_state__unknown_state_is_refused() -> None:
    with pytest.raises(ValueError, match="state must be one of held, expired, released"):
        operations.state_condition("gone")


def test_task_names__distinct_in_order(alias: str) -> None:
    for i, name in enumerate(["b.task", "a.task", "b.task", "", "c.task"]):
        acquire(f"k{i}", ttl=30, task_name=name, using=alias)
    assert operations.task_names(using=alias) == ["a.task", "b.task", "c.task"]
    assert operations.task_names(using=alias, limit=2) == ["a.task", "b.task"]


def test_fast_count__exact_below_the_cap_capped_above(alias: str) -> None:
    for i in range(12):
        acquire(f"k{i}", ttl=30, using=alias)
    leases = operations.leases(using=alias)
    assert operations.fast_count(leases, cap=100) == operations.RowCount(12)
    assert operations.fast_count(leases, cap=5) == operations.RowCount(5, "at_least")
    assert str(operations.fast_count(leases, cap=5)) == "more than 5"
    held = operations.leases(state="held", using=alias)
    assert operations.fast_count(held, cap=100) == operations.RowCount(12)


def test_fast_count__postgres_estimates_a_whole_large_table() -> None:
    for i in range(30):
        acquire(f"k{i}", ttl=30, using="postgres")
    with connections["postgres"].cursor() as cursor:
        cursor.execute(f"ANALYZE {Lease._meta.db_table}")
    whole = operations.leases(using="postgres")
    assert operations.fast_count(whole, cap=10) == operations.RowCount(30, "about")
    assert str(operations.fast_count(whole, cap=10)) == "about 30"
    # a filtered query is counted (capped), never estimated
    held = operations.leases(state="held", using="postgres")
    assert operations.fast_count(held, cap=10) == operations.RowCount(10, "at_least")
    # a stale estimate of a table emptied since is not believed
    Lease.objects.using("postgres").all().delete()
    assert operations.fast_count(whole, cap=10) == operations.RowCount(0)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (None, "—"),
        (12.3, "in 12s"),
        (-4.25, "expired 4.2s ago"),
        (3725, "in 1h 02m"),
        (-200000, "expired 2d 07h ago"),
        (250, "in 4m 10s"),
    ],
)
def test_describe_expiry(seconds: float | None, text: str) -> None:
    assert operations.describe_expiry(seconds) == text


def test_fast_count__unfiltered_uses_the_planner_estimate_on_postgresql(alias: str) -> None:
    for i in range(12):
        acquire(f"k{i}", ttl=30, using=alias)
    with connections[alias].cursor() as cursor:
        cursor.execute(f"ANALYZE {Lease._meta.db_table}")
    everything = Lease.objects.using(alias).all()
    if alias == "postgres":
        assert operations.fast_count(everything, cap=5) == operations.RowCount(12, "about")
    else:  # no estimate: counted up to the cap
        assert operations.fast_count(everything, cap=5) == operations.RowCount(5, "at_least")
    # a filtered query is never estimated
    held = everything.filter(key__startswith="k1")
    assert operations.fast_count(held, cap=100) == operations.RowCount(3)


def test_prune_events__keeps_recent_events_between_old_ones(alias: str, settings: Any) -> None:
    from celery_fenced.models import LeaseEvent

    settings.CELERY_FENCED_EVENTS = "all"  # two events per grant
    for _ in range(4):  # old and recent events interleaved by id
        acquire("old", ttl=30, using=alias).release()
        acquire("recent", ttl=30, using=alias).release()
    events = LeaseEvent.objects.using(alias)
    events.filter(lease__key="old").update(at=F("at") - dt.timedelta(days=40))
    seen: list[tuple[int, int]] = []
    deleted = operations.prune_events(
        older_than_days=30, using=alias, batch_size=3, progress=lambda d, t: seen.append((d, t))
    )
    assert deleted == 8
    assert not events.filter(lease__key="old").exists()
    assert events.filter(lease__key="recent").count() == 8
    assert seen[-1] == (8, 8)
