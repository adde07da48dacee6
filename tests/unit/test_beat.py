"""The fenced beat's settings and the pieces of its bookkeeping that need no server."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from celery import Celery
from celery.beat import ScheduleEntry
from celery.schedules import crontab

from celery_fenced import conf
from celery_fenced.beat.scheduler import _lateness, beat_key
from celery_fenced.beat.ticks import tick_task_id
from celery_fenced.exceptions import FencedConfigurationError

UTC = dt.UTC


def fresh_app(**values: Any) -> Celery:
    app = Celery("fresh", set_as_current=False)
    app.conf.update(values)
    return app


def test_beat_settings__defaults() -> None:
    app = fresh_app()
    assert conf.load(app).beat_ttl == 30.0
    assert beat_key(app) == "celery-beat:fresh"


@pytest.mark.parametrize("source", ["celery", "django"])
def test_beat_settings__read_from_celery_and_django(settings: Any, source: str) -> None:
    values = {"fenced_beat_key": "beat:prod", "fenced_beat_ttl": 5}
    if source == "celery":
        app = fresh_app(**values)
    else:
        settings.CELERY_FENCED_BEAT_KEY = "beat:prod"
        settings.CELERY_FENCED_BEAT_TTL = 5
        app = fresh_app()
    assert beat_key(app) == "beat:prod"
    assert conf.load(app).beat_ttl == 5.0


@pytest.mark.parametrize(
    ("name", "value", "fragment"),
    [
        ("fenced_beat_ttl", 0, "greater than 0"),
        ("fenced_beat_ttl", "30", "number of seconds"),
        ("fenced_beat_key", "  ", "non-empty string"),
        ("fenced_beat_key", 7, "non-empty string"),
    ],
)
def test_beat_settings__a_bad_value_names_the_setting(
    name: str, value: object, fragment: str
) -> None:
    with pytest.raises(FencedConfigurationError) as error:
        conf.load(fresh_app(**{name: value}))
    assert name in str(error.value)
    assert fragment in str(error.value)


def test_beat_settings__a_key_the_lease_table_cannot_store_names_the_setting() -> None:
    with pytest.raises(FencedConfigurationError) as error:
        beat_key(fresh_app(fenced_beat_key="k" * 1000))
    assert "fenced_beat_key" in str(error.value)


def test_tick_task_id__one_per_key_entry_and_tick() -> None:
    tick = dt.datetime(2026, 1, 1, 12, tzinfo=UTC)
    same = tick_task_id("k", "e", tick)
    assert same == tick_task_id("k", "e", tick)
    others = {
        tick_task_id("k2", "e", tick),
        tick_task_id("k", "e2", tick),
        tick_task_id("k", "e", tick + dt.timedelta(microseconds=1)),
    }
    assert same not in others
    assert len(others) == 3


def test_lateness__how_long_ago_an_entry_fell_due() -> None:
    app = fresh_app(timezone="UTC")
    now = app.now()
    every_minute = ScheduleEntry(
        name="e", task="t", schedule=dt.timedelta(minutes=1), app=app,
        last_run_at=now - dt.timedelta(minutes=11),
    )  # fmt: skip
    assert _lateness(every_minute) == pytest.approx(600, abs=5)
    not_yet = ScheduleEntry(
        name="e", task="t", schedule=crontab(minute="*"), app=app, last_run_at=now
    )
    assert _lateness(not_yet) == 0.0
