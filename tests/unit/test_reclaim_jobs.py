"""The reclaimer's recorded job (encoded, decoded, taken from a request) and its settings:
no database (the reclaimer itself is in tests/integration/test_reclaim.py)."""

from __future__ import annotations

import datetime as dt
import decimal
import logging
import pickle
import uuid
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery
from kombu import Exchange, Queue

from celery_fenced import conf as fenced_conf
from celery_fenced.exceptions import FencedConfigurationError
from celery_fenced.keys import key_headers
from celery_fenced.reclaim import Job, decode_job, encode_job, job_for

TASK = "app.tasks.rebuild"
#: a pickle that would run a command if it were ever unpickled
PICKLE = "cos\nsystem\n(S'touch /tmp/pwned'\ntR."


# -- the recorded job --------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "message"),
    [
        (PICKLE, "not a JSON job"),  # never unpickled
        (pickle.dumps({"v": 1}, protocol=0).decode("latin-1"), "not a JSON job"),
        ('{"v": 1, "task": "x", "args": [], "kwargs": {}, "options": {"eta": 1}}', "'eta'"),
        ('{"v": 1, "task": "", "args": [], "kwargs": {}, "options": {}}', "task name"),
        ('{"v": 1, "task": "x", "args": {}, "kwargs": {}, "options": {}}', "args must be"),
        ('{"v": 2, "task": "x", "args": [], "kwargs": {}, "options": {}}', "unknown format"),
        ("[1, 2]", "unknown format"),
    ],
)
def test_job__decode_refuses_what_is_not_a_json_job(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        decode_job(text)


def test_job__round_trips_through_kombu_json() -> None:
    when = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)
    ident = uuid.uuid4()
    job = Job(TASK, [1, "a", when], {"id": ident, "amount": decimal.Decimal("1.50")}, {})
    text = encode_job(job)
    assert isinstance(text, str)
    back = decode_job(text)
    assert back.args[2] == when
    assert back.kwargs["id"] == ident
    assert str(back.kwargs["amount"]) == "1.50"


def fake_task(app: Any, **request: Any) -> Any:
    defaults: dict[str, Any] = {
        "id": "tid",
        "is_eager": False,
        "delivery_info": {"exchange": "reports", "routing_key": "reports", "priority": 5},
        "timelimit": (60, 50),
    }
    return SimpleNamespace(app=app, name=TASK, request=SimpleNamespace(**{**defaults, **request}))


def test_job_for__records_routing_and_workflow_of_the_request() -> None:
    app = Celery("jobs", set_as_current=False)
    app.conf.task_queues = [Queue("reports", Exchange("reports"), routing_key="reports")]
    link = {"task": "app.tasks.next", "args": [], "kwargs": {}, "options": {}}
    task = fake_task(
        app, callbacks=[link], chain=[link], root_id="root", parent_id="parent", retries=2
    )
    job = decode_job(job_for(task, (1,), {"b": 2}, "k") or "")
    assert (job.task, job.args, job.kwargs) == (TASK, [1], {"b": 2})
    assert job.options == {
        "queue": "reports",
        "priority": 5,
        "link": [link],
        "chain": [link],
        "root_id": "root",
        "parent_id": "parent",
        "retries": 2,
        "time_limit": 60,
        "soft_time_limit": 50,
        # a copy sent again runs under the same key, decided for this job
        "headers": key_headers("k", TASK, "tid"),
    }


def test_job_for__unknown_exchange_keeps_exchange_and_routing_key() -> None:
    app = Celery("jobs", set_as_current=False)
    info = {"exchange": "topics", "routing_key": "a.b", "priority": None}
    task = fake_task(app, delivery_info=info, timelimit=None)
    job = decode_job(job_for(task, (), {}, "k") or "")
    assert job.options == {
        "exchange": "topics",
        "routing_key": "a.b",
        "headers": key_headers("k", TASK, "tid"),
    }


@pytest.mark.parametrize("request_", [{"is_eager": True}, {"id": None}])
def test_job_for__eager_and_direct_calls_record_nothing(request_: dict[str, Any]) -> None:
    task = fake_task(Celery("jobs", set_as_current=False), **request_)
    assert job_for(task, (), {}, "k") is None


def test_job_for__arguments_json_cannot_carry_are_not_recorded(
    caplog: pytest.LogCaptureFixture,
) -> None:
    task = fake_task(Celery("jobs", set_as_current=False))
    with caplog.at_level(logging.WARNING, logger="celery_fenced.reclaim"):
        assert job_for(task, (object(),), {}, "k") is None
    assert "will not be reclaimed" in caplog.text


# -- settings ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("setting", "value", "fragments"),
    [
        ("fenced_reclaim", "yes", ["fenced_reclaim", "True, False or None", "'yes'"]),
        ("fenced_reclaim", 1, ["fenced_reclaim", "got 1"]),
        ("fenced_reclaim_max", 0, ["fenced_reclaim_max", "integer of 1 or more", "got 0"]),
        ("fenced_reclaim_max", 2.5, ["fenced_reclaim_max", "got 2.5"]),
        ("fenced_reclaim_max", True, ["fenced_reclaim_max", "got True"]),
        ("fenced_reclaim_grace", -1, ["fenced_reclaim_grace", "0 or more", "got -1"]),
        ("fenced_reclaim_grace", "1", ["fenced_reclaim_grace", "got '1'"]),
        ("fenced_reclaim_resend_after", 0, ["fenced_reclaim_resend_after", "greater than 0"]),
        ("fenced_tasks", {"m.*": {"reclaim": "on"}}, ["fenced_tasks['m.*'] reclaim", "'on'"]),
    ],
)
def test_settings__invalid_reclaim_settings_name_the_setting(
    setting: str, value: Any, fragments: list[str]
) -> None:
    app = Celery("settings", set_as_current=False)
    app.conf.update({setting: value})
    with pytest.raises(FencedConfigurationError) as error:
        fenced_conf.load(app)
    for fragment in fragments:
        assert fragment in str(error.value)


@pytest.mark.parametrize(
    ("globally", "per_task", "key", "expected"),
    [
        (None, None, None, True),  # the default key: on
        (None, None, "report:{id}", False),  # an explicit key: its next acquirer reclaims
        (None, True, "report:{id}", True),  # opt in per task
        (None, False, None, False),  # opt out per task
        (True, None, "report:{id}", True),  # on for all
        (False, None, None, False),  # off for all
        (False, True, None, True),  # the task's own choice wins
    ],
)
def test_settings__reclaim_rule(
    globally: bool | None, per_task: bool | None, key: str | None, expected: bool
) -> None:
    settings = fenced_conf.FencedSettings(reclaim=globally)
    options = settings.task_options("task 't'", key=key, reclaim=per_task)
    assert options.reclaim is expected


def test_settings__defaults() -> None:
    settings = fenced_conf.load(Celery("defaults", set_as_current=False))
    assert (settings.reclaim, settings.reclaim_max) == (None, 3)
    assert (settings.reclaim_grace, settings.reclaim_resend_after) == (1.0, 300.0)


def test_fenced_task__lease_reclaim_option_is_validated_at_definition() -> None:
    from celery_fenced import FencedTask

    with pytest.raises(FencedConfigurationError, match="option lease_reclaim must be True"):

        class Bad(FencedTask):
            name = "bad"
            lease_reclaim = "always"
