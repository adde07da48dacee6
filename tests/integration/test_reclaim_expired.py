"""The reclaimer and a job whose ``expires`` passed while its holder was stopped.

A worker discards an expired message, and RabbitMQ drops one whose time to live ran out
before any consumer took it: a job sent again after its expiry would never end. The
reclaimer records its ``REVOKED`` outcome instead (as the worker does for an expired
message) and ends the expired grant, so the holder changes nothing when it wakes. Each
test runs the job through Celery's tracer (:mod:`tests.integration.test_seams`).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from celery import chord
from django_celery_results.models import ChordCounter, TaskResult

from celery_fenced.models import Lease, LeaseEvent
from celery_fenced.reclaim import EXPIRED, Job, expired, reclaim_expired
from tests.conftest import WITH_MARIADB
from tests.integration.test_seams import (
    RUNS,
    Broker,
    Execution,
    deliver,
    expire,
    granted,
    status,
    wait_for,
)

pytestmark = [
    pytest.mark.django_db(transaction=True, databases=WITH_MARIADB),
    pytest.mark.timeout(120),
]

#: seconds from the send to the job's expiry: its delivery starts well before
EXPIRES = 1.0


def expiring(broker: Broker) -> dt.datetime:
    return broker.app.now() + dt.timedelta(seconds=EXPIRES)


def until_expired(broker: Broker, moment: dt.datetime) -> None:
    job = Job("seams.step", [], {}, {"expires": moment.isoformat()})
    wait_for(lambda: expired(broker.app, job), "the job's expiry")


def sent_steps(broker: Broker) -> int:
    return len(broker.sent("seams.step"))


@pytest.mark.parametrize("resends", [0, 3], ids=["first-claim", "after-max-resends"])
def test_expired_job__revoked_not_sent_again_and_its_stopped_holder_changes_nothing(
    broker: Broker, lease_db: str, resends: int
) -> None:
    app = broker.app
    moment = expiring(broker)
    app.signature("seams.step", ("x",)).apply_async(
        expires=moment, link=app.signature("seams.sink")
    )
    message = broker.one("seams.step")
    task_id = message[0]["id"]
    a = Execution(app, message, "A")
    lease = granted(lease_db, task_id, 1)
    expire(lease_db, lease)
    # the claim after the last re-send allowed abandons the grant: an expired job is
    # revoked all the same, never left without an outcome
    Lease.objects.using(lease_db).filter(pk=lease.pk).update(reclaim_attempts=resends)
    until_expired(broker, moment)
    (outcome,) = reclaim_expired(app, grace=0, using=lease_db)
    assert (outcome.task_id, outcome.action) == (task_id, "revoked")
    assert sent_steps(broker) == 1  # never sent again
    assert status(lease_db, task_id)[0] == "REVOKED"
    row = Lease.objects.using(lease_db).get(pk=lease.pk)
    assert (row.token, row.released_at is not None) == (1, True)
    ended = LeaseEvent.objects.using(lease_db).get(lease=row, kind="force_released")
    assert (ended.token, ended.detail["by"]) == (1, EXPIRED)
    assert reclaim_expired(app, grace=0, using=lease_db) == []  # nothing left to claim

    a.finish()  # the stopped holder wakes: its SUCCESS and its callback are refused
    assert status(lease_db, task_id)[0] == "REVOKED"
    assert broker.sent("seams.sink") == []
    assert (
        LeaseEvent.objects.using(lease_db)
        .filter(lease=row, kind="stale_write_rejected", token=1)
        .exists()
    )


def test_expired_chord_member__counted_once__its_stopped_holder_counts_nothing(
    broker: Broker, lease_db: str
) -> None:
    """The REVOKED member counts in its chord once: the holder that wakes afterwards
    counts nothing, so the chord waits for its other member and then fails (a member
    was revoked) instead of firing its body early."""
    app = broker.app
    moment = expiring(broker)
    header = [
        app.signature("seams.step", ("a",)).set(expires=moment),
        app.signature("seams.step", ("b",)),
    ]
    result = chord(header, app.signature("seams.sink")).apply_async()
    first, second = broker.sent("seams.step")
    task_id = first[0]["id"]
    a = Execution(app, first, "A")
    expire(lease_db, granted(lease_db, task_id, 1))
    until_expired(broker, moment)
    assert [o.action for o in reclaim_expired(app, grace=0, using=lease_db)] == ["revoked"]
    a.finish()
    counter = ChordCounter.objects.using(lease_db).get()
    assert counter.count == 1  # the other member still to come
    deliver(app, second)
    assert not ChordCounter.objects.using(lease_db).exists()
    assert broker.sent("seams.sink") == []  # a member was revoked: the chord fails
    body = TaskResult.objects.using(lease_db).get(task_id=result.id)
    assert body.status == "FAILURE"
    assert [run[1] for run in RUNS if run[0] == "seams.step"] == ["a", "b"]


def test_job_not_expired__sent_again_as_before(broker: Broker, lease_db: str) -> None:
    app = broker.app
    later = app.now() + dt.timedelta(hours=1)
    app.signature("seams.step", ("y",)).apply_async(expires=later)
    message = broker.one("seams.step")
    task_id = message[0]["id"]
    a = Execution(app, message, "A")
    expire(lease_db, granted(lease_db, task_id, 1))
    assert [o.action for o in reclaim_expired(app, grace=0, using=lease_db)] == ["resent"]
    resent: Any = broker.sent("seams.step")[1]
    assert resent[0]["id"] == task_id
    deliver(app, resent)
    a.finish()
    assert status(lease_db, task_id) == ("SUCCESS", '"y@2"')
