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

from celery_fenced import resend, store
from celery_fenced.models import Lease, LeaseEvent
from celery_fenced.reclaim import EXPIRED, reclaim_expired
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


def until_expired(lease_db: str, moment: dt.datetime) -> None:
    """Until the job's expiry has passed by the database's clock (the reclaimer's judge)."""
    wait_for(lambda: store.database_now(lease_db) >= moment, "the job's expiry")


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
    until_expired(lease_db, moment)
    (preview,) = reclaim_expired(app, grace=0, using=lease_db, dry_run=True)
    assert (preview.action, preview.dry_run) == ("revoked", True)  # and nothing done:
    assert Lease.objects.using(lease_db).get(pk=lease.pk).released_at is None
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
    until_expired(lease_db, moment)
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


def test_copy_run_after_the_revoke__a_duplicate__revoked_stands_and_its_chord_counts_once(
    broker: Broker, lease_db: str
) -> None:
    """A copy of the message that a worker runs after the reclaimer's REVOKED (its clock
    behind, it did not find the message expired) is a completed duplicate: it runs no
    body, records nothing over REVOKED and counts nothing in the chord."""
    app = broker.app
    moment = expiring(broker)
    header = [
        app.signature("seams.step", ("a",)).set(expires=moment),
        app.signature("seams.step", ("b",)),
    ]
    chord(header, app.signature("seams.sink")).apply_async()
    first, _second = broker.sent("seams.step")
    task_id = first[0]["id"]
    a = Execution(app, first, "A")
    expire(lease_db, granted(lease_db, task_id, 1))
    until_expired(lease_db, moment)
    assert [o.action for o in reclaim_expired(app, grace=0, using=lease_db)] == ["revoked"]
    a.finish()
    deliver(app, first)  # the late copy
    assert status(lease_db, task_id)[0] == "REVOKED"
    assert ChordCounter.objects.using(lease_db).get().count == 1
    assert [run[1] for run in RUNS if run[0] == "seams.step"] == ["a"]


def test_expiry_judged_by_the_database_clock__not_the_reclaimers(
    broker: Broker, lease_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DESIGN: every expiry decision is the database's. A reclaimer whose clock is an hour
    behind still revokes a job whose ``expires`` has passed by the database's clock."""
    app = broker.app
    moment = expiring(broker)
    app.signature("seams.step", ("x",)).apply_async(expires=moment)
    message = broker.one("seams.step")
    task_id = message[0]["id"]
    a = Execution(app, message, "A")
    expire(lease_db, granted(lease_db, task_id, 1))
    until_expired(lease_db, moment)
    behind = app.now() - dt.timedelta(hours=1)
    monkeypatch.setattr(app, "now", lambda: behind)
    assert [o.action for o in reclaim_expired(app, grace=0, using=lease_db)] == ["revoked"]
    assert sent_steps(broker) == 1
    a.finish()
    assert status(lease_db, task_id)[0] == "REVOKED"


def test_revoke_that_fails_once__after_max_resends__tried_again_by_the_next_sweep(
    broker: Broker, lease_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The claim after the last re-send allowed marks the grant abandoned; when recording
    the expired job's REVOKED fails, the grant goes back to the next sweep, which revokes
    it: the job is not left without an outcome."""
    app = broker.app
    moment = expiring(broker)
    app.signature("seams.step", ("x",)).apply_async(expires=moment)
    message = broker.one("seams.step")
    task_id = message[0]["id"]
    a = Execution(app, message, "A")
    lease = granted(lease_db, task_id, 1)
    expire(lease_db, lease)
    Lease.objects.using(lease_db).filter(pk=lease.pk).update(reclaim_attempts=3)
    until_expired(lease_db, moment)
    real = resend.record_revoked
    failures = [RuntimeError("the result database is away")]

    def record_revoked(*args: Any, **kwargs: Any) -> None:
        if failures:
            raise failures.pop()
        real(*args, **kwargs)

    monkeypatch.setattr(resend, "record_revoked", record_revoked)
    assert [o.action for o in reclaim_expired(app, grace=0, using=lease_db)] == ["failed"]
    row = Lease.objects.using(lease_db).get(pk=lease.pk)
    assert (row.released_at, row.reclaim_state) == (None, "")  # claimable again
    assert [o.action for o in reclaim_expired(app, grace=0, using=lease_db)] == ["revoked"]
    assert status(lease_db, task_id)[0] == "REVOKED"
    assert sent_steps(broker) == 1
    a.finish()
    assert status(lease_db, task_id)[0] == "REVOKED"


def test_lost_grant_retry_racing_the_revoke__writes_no_retry_over_revoked(
    broker: Broker, lease_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The holder learns its grant expired and finds it unclaimed, so it retries the job;
    the reclaimer revokes the expired job in between. The holder's RETRY is refused over
    REVOKED, and its retry message is a completed duplicate that runs nothing."""
    app = broker.app
    moment = expiring(broker)
    app.signature("seams.lost", ("x",)).apply_async(expires=moment)
    message = broker.one("seams.lost")
    task_id = message[0]["id"]
    a = Execution(app, message, "A")
    expire(lease_db, granted(lease_db, task_id, 1))
    until_expired(lease_db, moment)
    real = store.end_unclaimed
    revoked: list[str] = []

    def end_unclaimed(lease: Any) -> bool:
        unclaimed = real(lease)
        # the reclaimer runs between the holder's check and its RETRY
        revoked.extend(o.action for o in reclaim_expired(app, grace=0, using=lease_db))
        return unclaimed

    monkeypatch.setattr(store, "end_unclaimed", end_unclaimed)
    a.finish()
    assert revoked == ["revoked"]
    assert status(lease_db, task_id)[0] == "REVOKED"
    retried = broker.sent("seams.lost")[1:]
    assert len(retried) == 1  # the holder's retry went out
    deliver(app, retried[0])
    assert status(lease_db, task_id)[0] == "REVOKED"
    assert [run[1] for run in RUNS if run[0] == "seams.lost"] == ["x"]
