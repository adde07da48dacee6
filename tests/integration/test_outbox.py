"""The outbox: record at publish, send on commit, re-send what never started.

Published through Celery's own ``apply_async`` (the ``broker`` fixture records what
reaches the broker), delivered through Celery's tracer, re-sent by the reclaimer.
"""

from __future__ import annotations

import datetime as dt
import threading
from typing import Any

import pytest
from celery import states
from django.db import connections, transaction
from django.db.models import F
from django.test.utils import CaptureQueriesContext
from kombu.exceptions import OperationalError as BrokerDown

from celery_fenced import FencedTask, acquire, reclaim
from celery_fenced.lifecycle import on_task_revoked
from celery_fenced.models import Lease, LeaseEvent, PendingJob
from celery_fenced.outbox import PLAIN_HEADER, resend_pending
from tests.conftest import (
    WITH_MARIADB,
    rolled_back,
    side_connection,
    terminate_connection,
)
from tests.integration.test_seams import (
    RUNS,
    Broker,
    Execution,
    deliver,
    expire,
    granted,
    status,
)

pytestmark = [
    pytest.mark.django_db(transaction=True, databases=WITH_MARIADB),
    pytest.mark.timeout(120),
]


def pending(alias: str) -> list[PendingJob]:
    return list(PendingJob.objects.using(alias).order_by("id"))


def make_due(alias: str, **more: Any) -> None:
    """Every pending row due now, as if ``fenced_outbox_resend_after`` had passed."""
    PendingJob.objects.using(alias).update(
        resend_at=F("published_at") - dt.timedelta(seconds=1), **more
    )


def test_rolled_back_transaction__nothing_sent_nothing_left(broker: Broker, lease_db: str) -> None:
    seen: list[int] = []

    def publish() -> None:
        broker.app.signature("seams.step", ("r",)).apply_async()
        seen.append(len(pending(lease_db)))  # written in the caller's transaction

    rolled_back(lease_db, publish)
    assert seen == [1]
    assert broker.sent("seams.step") == []
    assert pending(lease_db) == []


def test_in_a_transaction__sent_once_on_commit(broker: Broker, lease_db: str) -> None:
    with transaction.atomic(using=lease_db):
        result = broker.app.signature("seams.step", ("c",)).apply_async()
        assert broker.sent("seams.step") == []  # not before the commit
    (headers, _body) = broker.one("seams.step")
    assert headers["id"] == result.id
    (row,) = pending(lease_db)
    assert (row.task_id, row.task_name, row.sends, row.unsent) == (
        result.id,
        "seams.step",
        0,
        False,
    )
    job = reclaim.decode_job(row.job)
    assert (job.task, job.args, job.kwargs) == ("seams.step", ["c"], {})


def test_outside_a_transaction__recorded_then_sent_at_once(broker: Broker, lease_db: str) -> None:
    result = broker.app.signature("seams.keyed", (7,)).apply_async(countdown=100)
    broker.one("seams.keyed")
    (row,) = pending(lease_db)
    assert row.task_id == result.id
    assert row.key == "report:7"
    assert row.eta is not None
    # due fenced_outbox_resend_after (300 s) past the ETA, by the database's clock
    assert row.resend_at - row.published_at == dt.timedelta(seconds=400)


def test_outside_a_transaction__its_row_is_one_statement(broker: Broker, lease_db: str) -> None:
    task = broker.app.tasks["seams.keyed"]
    task.apply_async((1,))  # the tables' check, once per process
    with CaptureQueriesContext(connections[lease_db]) as captured:
        task.apply_async((2,))
    assert [q["sql"].split()[0] for q in captured.captured_queries] == ["INSERT"]
    assert [row.key for row in pending(lease_db)] == ["report:1", "report:2"]


def test_the_grant_ends_the_pending_row(broker: Broker, lease_db: str) -> None:
    result = broker.app.signature("seams.step", ("g",)).apply_async()
    assert len(pending(lease_db)) == 1
    deliver(broker.app, broker.one("seams.step"))
    assert status(lease_db, result.id) == (states.SUCCESS, '"g@1"')
    assert pending(lease_db) == []


def test_a_busy_key_ends_the_pending_row(broker: Broker, lease_db: str) -> None:
    """Skipped, failed or retried (the retry records itself again): not pending."""
    holder = broker.app.signature("seams.keyed", (3,)).apply_async()
    second = broker.app.signature("seams.keyed", (3,)).apply_async()
    held = Lease.objects.using(lease_db)

    acquire("report:3", ttl=30, task_id=holder.id, using=lease_db)  # held by the first
    (message,) = [m for m in broker.sent("seams.keyed") if m[0]["id"] == second.id]
    deliver(broker.app, message)  # busy: retried with a countdown (fenced_on_busy)
    assert held.get(key="report:3").task_id == holder.id
    rows = {row.task_id: row for row in pending(lease_db)}
    assert set(rows) == {holder.id, second.id}
    assert rows[second.id].eta is not None  # the retry's row, recorded afresh


def test_lost_message__sent_again_once_with_its_task_id_then_runs_once(
    broker: Broker, lease_db: str
) -> None:
    result = broker.app.signature("seams.step", ("l",)).apply_async()
    make_due(lease_db)
    first, again = resend_pending(broker.app), resend_pending(broker.app)
    assert [(o.task_id, o.action, o.attempt) for o in first] == [(result.id, "resent", 1)]
    assert again == []  # not due again before fenced_outbox_resend_after
    original, resent = broker.sent("seams.step")
    assert original[0]["id"] == resent[0]["id"] == result.id
    deliver(broker.app, resent)
    assert status(lease_db, result.id) == (states.SUCCESS, '"l@1"')
    assert pending(lease_db) == []
    deliver(broker.app, original)  # the first copy turns up after all: a duplicate
    assert status(lease_db, result.id) == (states.SUCCESS, '"l@1"')


def test_row_locked_by_a_stopped_transaction__passed_over_not_waited_for(
    broker: Broker, lease_db: str
) -> None:
    """A worker granting a job holds its pending row locked, and stops there (SIGSTOP, a
    GC pause): the reclaimer sends the other due jobs instead of waiting for it (found
    by the chaos runner, whose reclaimer waited on a row of a worker it had stopped)."""
    if not connections[lease_db].features.has_select_for_update_skip_locked:
        pytest.skip("SQLite: one writer at a time, no row locks")
    ids = [broker.app.signature("seams.step", (f"s{i}",)).apply_async().id for i in range(3)]
    make_due(lease_db)
    stopped = side_connection(lease_db)
    cursor = stopped.cursor()
    try:
        cursor.execute("BEGIN")
        cursor.execute(
            "SELECT id FROM celery_fenced_pendingjob WHERE task_id = %s FOR UPDATE", [ids[0]]
        )
        outcomes = resend_pending(broker.app)
        assert sorted(o.task_id for o in outcomes) == sorted(ids[1:])
    finally:
        cursor.execute("ROLLBACK")
        stopped.close()
    assert [o.task_id for o in resend_pending(broker.app)] == [ids[0]]  # its turn now


def test_two_reclaimers__each_due_job_sent_once(broker: Broker, lease_db: str) -> None:
    ids = [broker.app.signature("seams.step", (f"m{i}",)).apply_async().id for i in range(30)]
    make_due(lease_db)
    outcomes: list[Any] = []

    def sweep() -> None:
        try:
            outcomes.extend(resend_pending(broker.app, limit=7))
        finally:
            connections.close_all()

    threads = [threading.Thread(target=sweep) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(o.task_id for o in outcomes if o.action == "resent") == sorted(ids)
    sent = [h["id"] for h, _ in broker.sent("seams.step")]
    assert sorted(sent) == sorted(ids * 2)  # the original and one re-send each


def test_expired_job__its_revoked_recorded_never_sent_again(broker: Broker, lease_db: str) -> None:
    """Its message lost, its ``expires`` passed before the re-send: the reclaimer records
    ``REVOKED`` (as the worker does for an expired message), ends its row, sends nothing."""
    result = broker.app.signature("seams.step", ("e",)).apply_async(expires=60)
    make_due(lease_db, expires_at=F("published_at") - dt.timedelta(hours=1))
    assert [(o.task_id, o.action) for o in resend_pending(broker.app)] == [(result.id, "revoked")]
    assert status(lease_db, result.id)[0] == states.REVOKED
    assert pending(lease_db) == []
    assert len(broker.sent("seams.step")) == 1
    assert resend_pending(broker.app) == []


def test_too_many_sendings__abandoned_and_kept(broker: Broker, lease_db: str) -> None:
    result = broker.app.signature("seams.step", ("a",)).apply_async()
    make_due(lease_db, sends=3)  # fenced_reclaim_max
    (outcome,) = resend_pending(broker.app)
    assert (outcome.action, outcome.attempt) == ("abandoned", 4)
    (row,) = pending(lease_db)
    assert row.task_id == result.id
    assert row.abandoned_at is not None
    assert "never started" in row.abandoned_reason
    assert resend_pending(broker.app) == []  # abandoned rows are not due
    assert len(broker.sent("seams.step")) == 1


def test_broker_down_at_publish__no_error_row_kept_and_sent_by_the_next_sweep(
    broker: Broker, lease_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The caller gets its result handle, not an error: the job is recorded (in a web
    request the transaction has committed; a retried request would publish it twice)."""
    amqp = broker.app.amqp
    real = amqp.send_task_message

    def down(*args: Any, **kwargs: Any) -> Any:
        raise BrokerDown("Error 111 connecting to localhost:6379. Connection refused.")

    monkeypatch.setattr(amqp, "send_task_message", down)
    with transaction.atomic(using=lease_db):
        result = broker.app.signature("seams.step", ("d",)).apply_async()
    (row,) = pending(lease_db)
    assert (row.task_id, row.unsent) == (result.id, True)
    assert row.resend_at <= row.published_at + dt.timedelta(seconds=60)
    assert [o.action for o in resend_pending(broker.app)] == ["failed"]  # still down
    assert pending(lease_db)[0].sends == 0
    monkeypatch.setattr(amqp, "send_task_message", real)
    assert [o.action for o in resend_pending(broker.app)] == ["resent"]
    deliver(broker.app, broker.one("seams.step"))
    assert status(lease_db, result.id) == (states.SUCCESS, '"d@1"')


def test_revoked__its_pending_row_ends(broker: Broker, lease_db: str) -> None:
    result = broker.app.signature("seams.step", ("v",)).apply_async()
    request = type("Request", (), {"id": result.id})()
    on_task_revoked(request=request, sender=broker.app.tasks["seams.step"])
    assert pending(lease_db) == []


@pytest.mark.parametrize("where", ["setting", "task option"])
def test_outbox_off__sent_as_celery_sends_it(
    broker: Broker, lease_db: str, settings: Any, where: str
) -> None:
    task = broker.app.tasks["seams.step"]
    if where == "setting":
        settings.CELERY_FENCED_OUTBOX = False
    else:
        task.lease_outbox = False
    try:
        with transaction.atomic(using=lease_db):
            broker.app.signature("seams.step", ("o",)).apply_async()
            assert len(broker.sent("seams.step")) == 1  # at once, not on commit
    finally:
        task.lease_outbox = None
    assert pending(lease_db) == []


def test_group_in_a_transaction__each_member_recorded_and_sent_once_on_commit(
    broker: Broker, lease_db: str
) -> None:
    """A group lends its members one producer, back in the pool by the commit: each
    deferred member is sent with a producer of its own."""
    from celery import group

    app = broker.app
    with transaction.atomic(using=lease_db):
        result = group(app.signature("seams.step", (f"g{i}",)) for i in range(3)).apply_async()
        assert broker.sent("seams.step") == []
    members = sorted(r.id for r in result.results)
    assert sorted(h["id"] for h, _ in broker.sent("seams.step")) == members
    assert sorted(row.task_id for row in pending(lease_db)) == members


def test_retry_inside_the_callers_transaction__sent_at_once_not_lost(
    broker: Broker, lease_db: str
) -> None:
    """``raise self.retry()`` inside ``transaction.atomic()``: the raise rolls that
    transaction back, so the retry cannot wait for its commit: it is sent at once."""
    app = broker.app

    @app.task(name="outbox.atomic_retry", bind=True, base=FencedTask, shared=False)
    def atomic_retry(self: Any, value: int) -> int:
        if self.request.retries == 0:
            with transaction.atomic(using=lease_db):
                raise self.retry(countdown=1)
        return value

    result = atomic_retry.apply_async((1,))
    deliver(app, broker.one("outbox.atomic_retry"))
    assert status(lease_db, result.id)[0] == states.RETRY
    first, retry = broker.sent("outbox.atomic_retry")
    assert (first[0]["retries"], retry[0]["retries"]) == (0, 1)
    deliver(app, retry)
    assert status(lease_db, result.id) == (states.SUCCESS, "1")


def test_replace_inside_the_callers_transaction__the_replacement_is_sent(
    broker: Broker, lease_db: str
) -> None:
    app = broker.app

    @app.task(name="outbox.atomic_replace", bind=True, base=FencedTask, shared=False)
    def atomic_replace(self: Any, value: str) -> Any:
        with transaction.atomic(using=lease_db):
            return self.replace(app.signature("seams.step", (value,)))

    atomic_replace.apply_async(("r",))
    deliver(app, broker.one("outbox.atomic_replace"))
    deliver(app, broker.one("seams.step"))


def test_broker_down_with_a_countdown__sent_again_at_its_eta_not_before(
    broker: Broker, lease_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    amqp = broker.app.amqp
    real = amqp.send_task_message

    def down(*args: Any, **kwargs: Any) -> Any:
        raise BrokerDown("Connection refused.")

    monkeypatch.setattr(amqp, "send_task_message", down)
    broker.app.signature("seams.step", ("later",)).apply_async(countdown=3600)
    monkeypatch.setattr(amqp, "send_task_message", real)
    assert resend_pending(broker.app) == []  # not before its ETA
    make_due(lease_db)  # as if the hour had passed
    PendingJob.objects.using(lease_db).update(eta=F("published_at") + dt.timedelta(hours=1))
    assert [o.action for o in resend_pending(broker.app)] == ["resent"]
    (headers, _body) = broker.one("seams.step")
    assert headers["eta"] is not None  # still ahead: the re-send carries it


def test_callbacks_sent_through_the_outbox__are_the_parents_children(
    broker: Broker, lease_db: str
) -> None:
    app = broker.app
    result = app.signature("seams.step", ("c",)).apply_async(link=app.signature("seams.step", ()))
    deliver(app, broker.one("seams.step"))
    assert [child.id for child in app.AsyncResult(result.id).children] == [
        h["id"] for h, _ in broker.sent("seams.step")[1:]
    ]


def test_a_job_that_fails_before_its_grant__is_not_sent_again(
    broker: Broker, lease_db: str
) -> None:
    """A key the lease table cannot hold fails the job before any grant: it is not
    pending any more (the reclaimer would send a finished job again)."""
    app = broker.app
    result = app.signature("seams.keyed", ("x" * 300,)).apply_async()
    deliver(app, broker.one("seams.keyed"))
    assert status(lease_db, result.id)[0] == states.FAILURE
    assert pending(lease_db) == []


def test_skipped_as_busy__a_copy_sent_again_is_a_duplicate_once_the_key_is_free(
    broker: Broker, lease_db: str
) -> None:
    """``on_busy="skip"``: the first copy finds the key busy and is skipped; the outbox's
    copy of it, arriving once the key is free, does not run it after all."""
    app = broker.app
    runs: list[str] = []

    @app.task(
        name="outbox.skipping",
        bind=True,
        base=FencedTask,
        shared=False,
        lease_key="skipping",
        lease_on_busy="skip",
    )
    def skipping(self: Any, value: str) -> str:
        runs.append(value)
        return value

    result = skipping.apply_async(("s",))
    make_due(lease_db)
    assert [o.action for o in resend_pending(app)] == ["resent"]
    original, copy = broker.sent("outbox.skipping")
    holder = acquire("skipping", ttl=30, task_id="another-job", using=lease_db)
    deliver(app, original)  # busy: skipped
    holder.release()
    deliver(app, copy)  # the key is free now
    assert runs == []
    duplicates = LeaseEvent.objects.using(lease_db).filter(kind="duplicate", task_id=result.id)
    assert duplicates.count() == 1


def test_lease_database_away_at_publish__waited_out_then_recorded_and_sent(
    broker: Broker, lease_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restart of the lease database while a job is published: the record is tried
    again (as a result write is), never skipped: a job sent unrecorded could be lost by
    the broker with nothing to send it again."""
    from django.db import OperationalError

    from celery_fenced import store

    real = store.record_pending
    failures = [OperationalError("the database system is shutting down")] * 2

    def flaky(alias: str, pending: Any) -> str:
        if failures:
            raise failures.pop()
        return real(alias, pending)

    monkeypatch.setattr(store, "record_pending", flaky)
    result = broker.app.signature("seams.step", ("w",)).apply_async()
    assert failures == []
    (row,) = pending(lease_db)
    assert row.task_id == result.id
    broker.one("seams.step")


def test_retry_not_raised_in_a_committed_transaction__recorded_by_the_outbox(
    broker: Broker, lease_db: str
) -> None:
    """``self.retry(throw=False)`` inside ``transaction.atomic()``: nothing rolls that
    transaction back, so the retry is recorded in it and sent when it commits."""
    app = broker.app

    @app.task(name="outbox.retry_nothrow", bind=True, base=FencedTask, shared=False)
    def retry_nothrow(self: Any, value: int) -> int:
        if self.request.retries == 0:
            with transaction.atomic(using=lease_db):
                self.retry(countdown=1, throw=False)
                assert len(broker.sent("outbox.retry_nothrow")) == 1  # on commit, not now
        return value

    result = retry_nothrow.apply_async((1,))
    deliver(app, broker.one("outbox.retry_nothrow"))
    assert [row.task_id for row in pending(lease_db)] == [result.id]
    assert len(broker.sent("outbox.retry_nothrow")) == 2


def test_database_down_before_the_grant__the_retry_is_sent_unrecorded(
    broker: Broker, lease_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The grant met a database outage: the worker's re-send of the job cannot be
    recorded in that database, so it goes to the broker as before (the outbox is not
    tried: waiting out the outage there would end in a rejected, lost message)."""
    from django.db import OperationalError

    from celery_fenced import store

    app = broker.app
    result = app.signature("seams.step", ("o",)).apply_async()

    def down(*args: Any, **kwargs: Any) -> Any:
        raise OperationalError("connection refused")

    monkeypatch.setattr(store, "grant", down)
    monkeypatch.setattr(store, "record_pending", down)
    deliver(app, broker.one("seams.step"))
    first, again = broker.sent("seams.step")
    assert first[0]["id"] == again[0]["id"] == result.id
    assert again[0]["eta"] is not None  # the backoff


def test_fenced_tasks_task_registered_after_finalize__published_through_the_outbox(
    broker: Broker, lease_db: str
) -> None:
    """A web process imports its tasks modules after the app is finalized (Django's
    autodiscovery, a view's import): a ``fenced_tasks`` task registered then is fenced as
    it registers, so its publish in a rolled-back transaction sends nothing."""
    app = broker.app
    app.conf.fenced_tasks = {"late.*": {"ttl": 30}}
    app.finalize()

    def late_report(report_id: int) -> int:
        return report_id

    task = app.task(name="late.report", shared=False)(late_report)
    rolled_back(lease_db, lambda: task.delay(1))
    assert broker.sent("late.report") == []
    with transaction.atomic(using=lease_db):
        result = task.delay(2)
        assert broker.sent("late.report") == []
    (headers, _body) = broker.one("late.report")
    assert headers["id"] == result.id
    assert [row.task_id for row in pending(lease_db)] == [result.id]
    deliver(app, broker.one("late.report"))
    assert status(lease_db, result.id) == (states.SUCCESS, "2")
    assert pending(lease_db) == []


def test_plain_callback__recorded_by_the_proof_sent_on_its_commit_ended_when_it_starts(
    broker: Broker, lease_db: str
) -> None:
    """A plain task sent on by a fenced success (R4) is recorded in the transaction that
    proves the token and sent when it commits (a message cannot be taken back: a proof
    that never commits is none); its row ends when a worker starts it. It is the
    parent's child."""
    app = broker.app
    seen: list[int] = []

    def at_publish(sender: Any = None, **_: Any) -> None:
        if sender == "seams.sink":  # sent after the commit: the parent's row is there
            seen.append(PendingJob.objects.using(lease_db).filter(task_name=sender).count())

    from celery import signals as celery_signals

    celery_signals.before_task_publish.connect(at_publish, weak=False)
    try:
        result = app.signature("seams.step", ("p",)).apply_async(link=app.signature("seams.sink"))
        deliver(app, broker.one("seams.step"))
    finally:
        celery_signals.before_task_publish.disconnect(at_publish)
    assert seen == [1]  # recorded before it was sent
    (headers, body) = broker.one("seams.sink")
    assert list(body[0]) == ["p@1"]
    assert headers[PLAIN_HEADER] == 1
    assert [row.task_id for row in pending(lease_db)] == [headers["id"]]  # sent, not started
    assert [c.id for c in app.AsyncResult(result.id).children] == [headers["id"]]
    deliver(app, broker.one("seams.sink"))
    assert pending(lease_db) == []  # started: ended
    assert resend_pending(app, using=lease_db) == []


def test_plain_callback__lost_by_the_broker__sent_again_once_by_the_reclaimer(
    broker: Broker, lease_db: str
) -> None:
    """The plain callback's message is lost by the broker (Redis restarted empty) before
    any worker started it: its row is still pending, so the reclaimer sends it again
    (same task id, same arguments) — once: the copy that starts ends the row."""
    app = broker.app
    app.signature("seams.step", ("l",)).apply_async(link=app.signature("seams.sink"))
    deliver(app, broker.one("seams.step"))
    (lost_headers, _body) = broker.one("seams.sink")  # never delivered: lost
    make_due(lease_db)
    assert [o.action for o in resend_pending(app, using=lease_db)] == ["resent"]
    resent = broker.sent("seams.sink")[-1]
    assert resent[0]["id"] == lost_headers["id"]
    assert list(resent[1][0]) == ["l@1"]
    assert resent[0][PLAIN_HEADER] == 1  # its starting ends the row again
    deliver(app, resent)
    assert pending(lease_db) == []
    make_due(lease_db)
    assert resend_pending(app, using=lease_db) == []
    assert len(broker.sent("seams.sink")) == 2
    assert [run[1] for run in RUNS if run[0] == "seams.sink"] == [("l@1",)]  # ran once


def test_plain_callback__database_restarted_as_a_worker_starts_it__not_sent_again(
    broker: Broker, lease_db: str
) -> None:
    """The lease database restarts just as a worker starts the plain callback (seen in
    the chaos runner: a beat tick's job ran twice): ending its row waits the restart out,
    so the reclaimer does not send a job that already ran."""
    if lease_db != "postgres":
        pytest.skip("terminates a PostgreSQL backend")
    app = broker.app
    app.signature("seams.step", ("r",)).apply_async(link=app.signature("seams.sink"))
    deliver(app, broker.one("seams.step"))
    message = broker.one("seams.sink")
    terminate_connection(lease_db)  # the server restarted under this process's connection
    deliver(app, message)
    assert pending(lease_db) == []
    make_due(lease_db)
    assert resend_pending(app, using=lease_db) == []
    assert [run[1] for run in RUNS if run[0] == "seams.sink"] == [("r@1",)]


def test_plain_callback__revoked_at_the_worker__its_row_ends(
    broker: Broker, lease_db: str
) -> None:
    """A worker that discards the plain callback's message as revoked (or expired) ends
    its row: it is never sent again."""
    from celery import signals as celery_signals
    from celery.app.task import Context

    app = broker.app
    app.signature("seams.step", ("v",)).apply_async(link=app.signature("seams.sink"))
    deliver(app, broker.one("seams.step"))
    (headers, _body) = broker.one("seams.sink")
    # what the worker sends for a revoked request: its context, the headers as attributes
    celery_signals.task_revoked.send(
        app.tasks["seams.sink"], request=Context(headers), terminated=False, expired=False
    )
    assert pending(lease_db) == []


def test_plain_callback__broker_down_at_the_commit__sent_by_the_reclaimer_once(
    broker: Broker, lease_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = broker.app
    app.signature("seams.step", ("d",)).apply_async(link=app.signature("seams.sink"))
    message = broker.one("seams.step")
    amqp = app.amqp
    original = amqp.send_task_message

    def refusing(producer: Any, name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "seams.sink":
            raise BrokerDown("broker down")
        return original(producer, name, *args, **kwargs)

    monkeypatch.setattr(amqp, "send_task_message", refusing)
    deliver(app, message)
    assert status(lease_db, message[0]["id"])[0] == states.SUCCESS  # not a FAILURE
    assert broker.sent("seams.sink") == []
    (row,) = pending(lease_db)
    assert (row.task_name, row.plain, row.unsent) == ("seams.sink", True, True)
    monkeypatch.undo()
    outcomes = resend_pending(app, using=lease_db)
    assert [(o.action, o.reason) for o in outcomes] == [("resent", "")]
    message = broker.one("seams.sink")
    assert list(message[1][0]) == ["d@1"]
    deliver(app, message)
    assert pending(lease_db) == []  # started: ended, never sent again
    assert resend_pending(app, using=lease_db) == []


def test_sent_again__with_its_custom_headers_and_shadow_name(
    broker: Broker, lease_db: str
) -> None:
    result = broker.app.signature("seams.step", ("h",)).apply_async(
        headers={"trace_id": "t-42"}, shadow="seams.step[report]"
    )
    make_due(lease_db)
    assert [o.action for o in resend_pending(broker.app)] == ["resent"]
    original, resent = broker.sent("seams.step")
    for headers, _body in (original, resent):
        assert headers["id"] == result.id
        assert headers["trace_id"] == "t-42"
        assert headers["shadow"] == "seams.step[report]"


def _taken_over(broker: Broker, alias: str, value: str) -> tuple[Execution, Execution]:
    """Job A is granted (its job recorded on the lease row: the default key) and held, its
    grant expires; another job of the same call, B, takes the key over."""
    app = broker.app
    app.signature("seams.step", (value,)).apply_async(task_id=f"a-{value}")
    a = Execution(app, broker.one("seams.step"), "A")
    lease = granted(alias, f"a-{value}", 1)
    assert reclaim.decode_job(lease.job or "").args == [value]
    expire(alias, lease)
    app.signature("seams.step", (value,)).apply_async(task_id=f"b-{value}")
    b = Execution(app, broker.sent("seams.step")[1], "B")
    granted(alias, f"b-{value}", 2)
    return a, b


def test_another_job_takes_an_expired_grant_over__the_displaced_job_is_sent_again(
    broker: Broker, lease_db: str
) -> None:
    """A's worker died and the broker lost A's message: the lease row recorded A's job for
    the reclaimer, and B's grant replaced it. The grant hands A's job to the outbox in the
    same statement (transaction), due at once; re-sent, A runs once B is done."""
    a, b = _taken_over(broker, lease_db, "v")
    (row,) = pending(lease_db)
    job = reclaim.decode_job(row.job)
    assert (row.task_id, row.task_name, job.task, job.args) == (
        "a-v",
        "seams.step",
        "seams.step",
        ["v"],
    )
    assert row.key == Lease.objects.using(lease_db).get().key
    assert row.resend_at <= row.published_at  # due at once
    b.finish()
    assert status(lease_db, "b-v") == (states.SUCCESS, '"v@2"')
    assert [(o.task_id, o.action) for o in resend_pending(broker.app)] == [("a-v", "resent")]
    resent = broker.sent("seams.step")[-1]
    assert resent[0]["id"] == "a-v"
    deliver(broker.app, resent)
    assert status(lease_db, "a-v") == (states.SUCCESS, '"v@3"')
    assert pending(lease_db) == []
    a.finish()  # the first execution was only paused after all: it changes nothing
    assert status(lease_db, "a-v") == (states.SUCCESS, '"v@3"')
    assert resend_pending(broker.app) == []


def test_displaced_job_woken_before_its_sending__its_stale_token_failure_ends_it(
    broker: Broker, lease_db: str
) -> None:
    """A was only paused and reports first: its outcome is FAILURE(StaleToken) (R2), and
    its job, handed to the outbox by B's grant, is not sent again."""
    a, b = _taken_over(broker, lease_db, "w")
    assert [row.task_id for row in pending(lease_db)] == ["a-w"]
    a.finish()
    row_status, result = status(lease_db, "a-w")
    assert (row_status, "StaleToken" in result) == (states.FAILURE, True)
    assert pending(lease_db) == []
    assert resend_pending(broker.app) == []
    b.finish()
    assert status(lease_db, "b-w") == (states.SUCCESS, '"w@2"')


def test_same_job_takes_its_expired_grant_over__nothing_handed_to_the_outbox(
    broker: Broker, lease_db: str
) -> None:
    """A redelivery of A's own message takes its grant over: the lease row records the same
    job, and the reclaimer's bookkeeping stays there."""
    broker.app.signature("seams.step", ("s",)).apply_async(task_id="a-s")
    message = broker.one("seams.step")
    a = Execution(broker.app, message, "A")
    expire(lease_db, granted(lease_db, "a-s", 1))
    b = Execution(broker.app, message, "B")
    granted(lease_db, "a-s", 2)
    assert pending(lease_db) == []
    b.finish()
    a.finish()
    assert status(lease_db, "a-s") == (states.SUCCESS, '"s@2"')


def test_abandoned_job_taken_over__stays_abandoned(broker: Broker, lease_db: str) -> None:
    """A job the reclaimer gave up on (``fenced_reclaim_max``) is not revived by a takeover."""
    broker.app.signature("seams.step", ("x",)).apply_async(task_id="a-x")
    a = Execution(broker.app, broker.one("seams.step"), "A")
    lease = granted(lease_db, "a-x", 1)
    expire(lease_db, lease)
    Lease.objects.using(lease_db).filter(pk=lease.pk).update(reclaim_state="abandoned")
    acquire(lease.key, ttl=30, task_id="b-x", using=lease_db)
    assert pending(lease_db) == []
    a.finish()


@pytest.fixture
def alias(alias_with_mariadb: str) -> str:
    """SQLite, PostgreSQL and MariaDB."""
    return alias_with_mariadb


def test_two_copies_recorded_at_once__the_later_replaces_the_row_without_error(
    lease_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two copies of one job retried at the same moment (a redelivery beside the original)
    both find no pending row, then both insert it (the portable dialect: MariaDB's): the
    later insert, refused once the first commits, replaces that row — no duplicate-key
    error (MariaDB's 1062 failed the retry, seen in CI)."""
    from django.db.models.query import QuerySet

    from celery_fenced.store.dialects import for_alias
    from celery_fenced.store.types import Pending

    if lease_db == "default":
        pytest.skip("SQLite has one writer: the second copy's update waits for the first")
    both_found_none = threading.Barrier(2)
    create = QuerySet.create

    def create_once_both_looked(self: QuerySet[Any], **fields: Any) -> Any:
        if self.model is PendingJob:
            both_found_none.wait(30)
        return create(self, **fields)

    monkeypatch.setattr(QuerySet, "create", create_once_both_looked)
    errors: list[BaseException] = []

    def copy(n: int) -> None:
        try:
            pending = Pending("t1", "t.n", "k", f'{{"copy": {n}}}', None, None, None, 60)
            for_alias(lease_db, portable=True).record_pending(pending)
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections[lease_db].close()

    threads = [threading.Thread(target=copy, args=(n,)) for n in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    rows = [(row.task_id, row.job) for row in pending(lease_db)]
    assert rows in ([("t1", '{"copy": 1}')], [("t1", '{"copy": 2}')])
