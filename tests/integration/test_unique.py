"""No duplicate queued (``lease_unique``): decided by the outbox's row.

Published through Celery's own ``apply_async`` (the ``broker`` fixture records what
reaches the broker), delivered through Celery's tracer.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from celery import chain, chord, states
from django.db import connections, transaction
from django.db.models.functions import Now
from django.test.utils import CaptureQueriesContext

from celery_fenced import FencedTask, signals
from celery_fenced.conf import load
from celery_fenced.exceptions import FencedConfigurationError
from celery_fenced.models import Lease, LeaseEvent, PendingJob
from celery_fenced.outbox import resend_pending
from tests.conftest import WITH_MARIADB, run_in_threads
from tests.integration.test_outbox import pending, rolled_back
from tests.integration.test_seams import Broker, Execution, deliver, granted, status, wait_for

pytestmark = [
    pytest.mark.django_db(transaction=True, databases=WITH_MARIADB),
    pytest.mark.timeout(120),
]


@pytest.fixture(params=["until_started", "until_done"])
def unique(request: pytest.FixtureRequest, broker: Broker) -> Iterator[str]:
    """``seams.keyed`` (key ``report:{report_id}``) with ``lease_unique``."""
    task = broker.app.tasks["seams.keyed"]
    task.lease_unique = request.param
    yield request.param
    task.lease_unique = None


def publish(broker: Broker, report_id: int, **options: Any) -> str:
    return str(broker.app.tasks["seams.keyed"].apply_async((report_id,), **options).id)


def deduplicated(alias: str) -> list[LeaseEvent]:
    return list(
        LeaseEvent.objects.using(alias).filter(kind=LeaseEvent.Kind.DEDUPLICATED).order_by("id")
    )


def test_copies_while_one_waits__refused_with_its_id(
    broker: Broker, lease_db: str, unique: str
) -> None:
    seen: list[dict[str, Any]] = []

    def receiver(**kwargs: Any) -> None:
        seen.append(kwargs)

    signals.lease_deduplicated.connect(receiver)
    try:
        first = publish(broker, 7)
        copies = [publish(broker, 7) for _ in range(4)]
    finally:
        signals.lease_deduplicated.disconnect(receiver)
    assert copies == [first] * 4
    broker.one("seams.keyed")  # one message reached the broker
    assert [row.task_id for row in pending(lease_db)] == [first]
    events = deduplicated(lease_db)
    assert len(events) == 4
    assert {e.task_id for e in events} == {first}
    assert len({e.detail["refused_task_id"] for e in events}) == 4
    assert [(s["key"], s["task_id"], s["token"]) for s in seen] == [("report:7", first, None)] * 4
    # another key is another job
    other = publish(broker, 8)
    assert other != first
    assert len(broker.sent("seams.keyed")) == 2


#: statements of a refused copy, its event included (MariaDB: the portable transaction)
REFUSAL_STATEMENTS = {"postgresql": 1, "sqlite": 2}


def test_a_refused_copy__its_event_written_by_the_refusing_statements(
    broker: Broker, lease_db: str, unique: str
) -> None:
    with CaptureQueriesContext(connections[lease_db]) as captured:
        first = publish(broker, 7)
    if connections[lease_db].vendor in REFUSAL_STATEMENTS:
        assert len(captured.captured_queries) == 1  # the key free: its row, one insert
    assert publish(broker, 7) == first  # the key's lease row made by the first refusal
    with CaptureQueriesContext(connections[lease_db]) as captured:
        assert publish(broker, 7) == first
    vendor = connections[lease_db].vendor
    if vendor in REFUSAL_STATEMENTS:
        assert len(captured.captured_queries) == REFUSAL_STATEMENTS[vendor]
    events = deduplicated(lease_db)
    assert [e.task_id for e in events] == [first, first]
    assert events[1].detail["task_name"] == "seams.keyed"


def test_after_the_copy_started_or_ended__a_new_call_queues(
    broker: Broker, lease_db: str, unique: str
) -> None:
    first = publish(broker, 7)
    running = Execution(broker.app, broker.one("seams.keyed"), "A")
    granted(lease_db, first, 1)
    while_running = publish(broker, 7)
    if unique == "until_done":
        assert while_running == first  # running counts
        assert len(broker.sent("seams.keyed")) == 1
    else:
        assert while_running != first  # started: no longer waiting
        assert len(broker.sent("seams.keyed")) == 2
    running.finish()
    assert status(lease_db, first) == (states.SUCCESS, '"7@1"')
    after = publish(broker, 7)
    if unique == "until_done":
        assert after != first
    else:
        assert after == while_running  # that copy still waits
    assert len(broker.sent("seams.keyed")) == 2


def test_rolled_back_publish__leaves_no_copy_to_refuse_the_next(
    broker: Broker, lease_db: str, unique: str
) -> None:
    rolled_back(lease_db, lambda: publish(broker, 7))
    assert pending(lease_db) == []
    assert deduplicated(lease_db) == []
    second = publish(broker, 7)
    assert [h["id"] for h, _ in broker.sent("seams.keyed")] == [second]


def test_concurrent_publishers__one_copy_queued_all_given_its_id(
    broker: Broker, lease_db: str, unique: str
) -> None:
    ids: list[str] = []
    errors: list[BaseException] = []
    start = threading.Barrier(6)

    def one() -> None:
        try:
            start.wait(30)
            ids.append(publish(broker, 7))
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=one) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    (headers, _body) = broker.one("seams.keyed")
    assert ids == [headers["id"]] * 6
    assert len(deduplicated(lease_db)) == 5


def test_in_open_transactions__the_second_waits_for_the_first_then_is_refused(
    broker: Broker, lease_db: str, unique: str
) -> None:
    """A copy recorded in a transaction not yet committed holds its key: another
    publisher waits for that transaction, and is refused once it commits."""
    if connections[lease_db].vendor != "postgresql":
        pytest.skip("SQLite runs one writer at a time: the second cannot start its insert")
    second: list[str] = []
    with transaction.atomic(using=lease_db):
        first = publish(broker, 7)

        def other() -> None:
            try:
                second.append(publish(broker, 7))
            finally:
                connections.close_all()

        thread = threading.Thread(target=other)
        thread.start()
        thread.join(0.5)
        assert thread.is_alive()  # waiting on the first's uncommitted row
    thread.join(30)
    assert second == [first]
    broker.one("seams.keyed")


@pytest.mark.parametrize("mode", ["until_started", "until_done"])
def test_a_retry_keeps_its_place(broker: Broker, lease_db: str, mode: str) -> None:
    """A unique job that retries is the same job again, not a copy of itself: its retry
    is recorded and sent, and a new call while it waits is refused with its id."""
    app = broker.app
    tries: list[int] = []

    def flaky(self: Any, x: int) -> int:
        tries.append(x)
        if len(tries) == 1:
            raise self.retry(countdown=100)
        return x

    task = app.task(
        name="unique.flaky",
        bind=True,
        base=FencedTask,
        shared=False,
        lease_key="flaky:{x}",
        lease_unique=mode,
    )(flaky)
    first = str(task.delay(1).id)
    deliver(app, broker.one("unique.flaky"))
    assert tries == [1]
    retried = broker.sent("unique.flaky")
    assert [h["id"] for h, _ in retried] == [first, first]  # sent again, same id
    (row,) = pending(lease_db)
    assert (row.task_id, row.unique_key, row.started_token) == (first, "flaky:1", None)
    assert str(task.delay(1).id) == first  # refused: the retry holds the key
    assert len(broker.sent("unique.flaky")) == 2
    deliver(app, retried[1])
    assert status(lease_db, first) == (states.SUCCESS, "1")


def test_abandoned_or_expired_copy__gives_its_place_up(
    broker: Broker, lease_db: str, unique: str
) -> None:
    first = publish(broker, 7)
    PendingJob.objects.using(lease_db).update(abandoned_at=Now(), abandoned_reason="test")
    second = publish(broker, 7)
    assert second != first
    PendingJob.objects.using(lease_db).update(expires_at=Now())
    third = publish(broker, 7)
    assert third not in (first, second)
    assert [row.task_id for row in pending(lease_db)] == [third]


def test_until_done__a_run_that_ended_without_release_gives_its_place_up(
    broker: Broker, lease_db: str
) -> None:
    """A copy whose grant expired (its worker died; nothing re-sends it) does not
    block the key for good; the reclaimer's sweep deletes its row."""
    task = broker.app.tasks["seams.keyed"]
    task.lease_unique = "until_done"
    try:
        first = publish(broker, 7)
        running = Execution(broker.app, broker.one("seams.keyed"), "A")
        lease = granted(lease_db, first, 1)
        assert publish(broker, 7) == first
        (row,) = pending(lease_db)
        assert row.started_token == 1
        Lease.objects.using(lease_db).filter(pk=lease.pk).update(expires_at=lease.acquired_at)
        resend_pending(broker.app, using=lease_db)
        assert pending(lease_db) == []  # the sweep ended it
        second = publish(broker, 7)
        assert second != first
    finally:
        task.lease_unique = None
        running.finish()


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        ({"unique": "always"}, "unique must be one of 'until_started', 'until_done' or None"),
        ({"unique": "until_done", "outbox": False}, "needs the outbox"),
    ],
)
def test_invalid_unique__named(broker: Broker, options: dict[str, Any], fragment: str) -> None:
    broker.app.conf.fenced_tasks = {"x.*": options}
    with pytest.raises(FencedConfigurationError, match=fragment):
        load(broker.app)


def test_the_same_task_id_again__its_row_takes_the_key_not_refused_as_a_copy(
    broker: Broker, lease_db: str, unique: str
) -> None:
    """A job published again with its own task id (a chain step re-sent by its parent's
    second execution, say) whose row was recorded without the key: it is the same job,
    it takes the key if free — in a transaction of the caller's too."""
    first = publish(broker, 7)
    PendingJob.objects.using(lease_db).update(unique_key=None, unique_until="")
    task = broker.app.tasks["seams.keyed"]
    with transaction.atomic(using=lease_db):
        again = task.apply_async((7,), task_id=first)
    assert again.id == first
    (row,) = pending(lease_db)
    assert (row.task_id, row.unique_key) == (first, "report:7")
    assert [h["id"] for h, _ in broker.sent("seams.keyed")] == [first, first]
    assert publish(broker, 7) == first  # and a new call is refused with its id


def test_the_same_task_id_again_holding_its_key__its_row_started_afresh(
    broker: Broker, lease_db: str, unique: str
) -> None:
    """Published again with its own task id while its row holds the key: not a copy of
    itself, and its row starts afresh (its new ETA, no sends yet) on every database."""
    first = publish(broker, 7)
    PendingJob.objects.using(lease_db).update(sends=3)
    assert publish(broker, 7, task_id=first, countdown=1000) == first
    (row,) = pending(lease_db)
    assert (row.unique_key, row.sends, row.eta is not None) == ("report:7", 0, True)
    assert deduplicated(lease_db) == []


class _RolledBack(Exception):
    pass


def test_concurrent_publishers_in_transactions_some_rolled_back__one_event_per_refusal(
    broker: Broker, lease_db: str, unique: str
) -> None:
    """Ten publishers of one key, each in its own transaction, every third rolled back:
    one copy stands, every committed refusal names it and left exactly one
    ``deduplicated`` event, a rolled-back one none. (PostgreSQL: on MariaDB a waiting
    insert whose key's other inserter rolls back can end in a deadlock, 1213.)"""
    if connections[lease_db].vendor != "postgresql":
        pytest.skip("SQLite runs one writer at a time; MariaDB: see the docstring")
    done: list[tuple[str, str, bool]] = []
    errors: list[BaseException] = []
    start = threading.Barrier(10)

    def one(i: int) -> None:
        own = f"c{i}"
        try:
            start.wait(30)
            try:
                with transaction.atomic(using=lease_db):
                    got = publish(broker, 7, task_id=own)
                    if i % 3 == 0:
                        raise _RolledBack
                done.append((own, got, True))
            except _RolledBack:
                done.append((own, got, False))
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            connections.close_all()

    run_in_threads(one, 10)
    assert errors == []
    committed = [(own, got) for own, got, kept in done if kept]
    recorded = [own for own, got in committed if own == got]
    refused = [own for own, got in committed if own != got]
    assert [row.task_id for row in pending(lease_db)] == recorded
    assert len(recorded) == 1
    assert {got for own, got in committed} == set(recorded)
    events = deduplicated(lease_db)
    assert sorted(event.detail["refused_task_id"] for event in events) == sorted(refused)


@pytest.fixture
def until_done(broker: Broker) -> Iterator[Any]:
    task = broker.app.tasks["seams.keyed"]
    task.lease_unique = "until_done"
    yield task
    task.lease_unique = None
    task.lease_on_busy = None


@pytest.mark.parametrize("on_busy", ["skip"])
def test_until_done__a_redelivery_found_busy_does_not_end_the_running_copys_row(
    broker: Broker, lease_db: str, until_done: Any, on_busy: str
) -> None:
    """The broker delivers the running copy's message again (a visibility timeout, a
    connection lost before the ack): that delivery finds the key busy and is skipped.
    The copy still runs under its grant: a new call must still be refused."""
    until_done.lease_on_busy = on_busy
    first = publish(broker, 7)
    message = broker.one("seams.keyed")
    running = Execution(broker.app, message, "A")
    try:
        granted(lease_db, first, 1)
        deliver(broker.app, message)  # the same message again: busy, skipped
        assert publish(broker, 7) == first  # the first copy is still running
        assert len(broker.sent("seams.keyed")) == 1
    finally:
        running.finish()


def test_until_done__a_busy_retried_redelivery_then_a_completed_duplicate__key_freed(
    broker: Broker, lease_db: str, until_done: Any
) -> None:
    """The redelivered copy is retried as busy (re-recording the row), then arrives once
    the job has completed: it is a duplicate and never runs. Its row must not go on
    standing for a copy that will never run (refusing every new call with its id)."""
    first = publish(broker, 7)
    message = broker.one("seams.keyed")
    running = Execution(broker.app, message, "A")
    granted(lease_db, first, 1)
    deliver(broker.app, message)  # busy: retried later, recorded again
    running.finish()
    retried = broker.sent("seams.keyed")[-1]
    assert retried[0]["id"] == first
    deliver(broker.app, retried)  # a duplicate of a completed job: skipped
    assert [r.task_id for r in pending(lease_db) if r.started_token is None] == []
    assert publish(broker, 7) != first  # the copy is done: a new call queues


def test_until_done__a_running_copy_past_its_expires_still_holds_the_key(
    broker: Broker, lease_db: str, until_done: Any
) -> None:
    """``expires`` is when an unstarted message is dropped; a copy that started before it
    runs to the end, and until_done holds the key until its grant ends."""
    first = publish(broker, 7, expires=3600)
    running = Execution(broker.app, broker.one("seams.keyed"), "A")
    try:
        granted(lease_db, first, 1)
        PendingJob.objects.using(lease_db).update(expires_at=Now())  # the deadline passes
        assert publish(broker, 7) == first  # still running
        resend_pending(broker.app, using=lease_db)  # the sweep
        assert publish(broker, 7) == first  # still running
    finally:
        running.finish()


def test_chain_whose_first_step_is_refused__the_rest_of_the_chain_still_runs(
    broker: Broker, lease_db: str, until_done: Any
) -> None:
    """A refused call sends nothing, so a chain whose first step is a copy of a queued
    job loses its other steps: its result (the last step's id) never completes."""
    app = broker.app
    publish(broker, 7)  # a copy queued by someone else
    result = chain(app.signature("seams.keyed", (7,)), app.signature("seams.sink")).apply_async()
    for message in broker.sent("seams.keyed"):
        deliver(app, message)
    sunk = broker.sent("seams.sink")
    assert [h["id"] for h, _ in sunk] == [result.id]  # the chain's last step was sent


def test_chord_with_two_copies_in_its_header__the_body_fires(
    broker: Broker, lease_db: str, until_done: Any
) -> None:
    """The chord counts its header's results: a refused header member never reports,
    so the body never fires."""
    app = broker.app
    header = [app.signature("seams.keyed", (7,)), app.signature("seams.keyed", (7,))]
    chord(header, app.signature("seams.sink")).apply_async()
    for message in broker.sent("seams.keyed"):
        deliver(app, message)
    assert len(broker.sent("seams.sink")) == 1


def test_refused_call_in_an_open_transaction__does_not_hold_up_the_copys_grant(
    broker: Broker, lease_db: str, until_done: Any
) -> None:
    """A web request whose transaction publishes a copy (refused) and goes on working
    must not stop the standing copy's worker from starting it until that commit."""
    if connections[lease_db].vendor != "postgresql":
        pytest.skip("SQLite: a writer's open transaction blocks every other writer anyway")
    from tests.conftest import side_connection

    first = publish(broker, 7)
    message = broker.one("seams.keyed")
    with transaction.atomic(using=lease_db):
        assert publish(broker, 7) == first  # refused
        ours = connections[lease_db].connection.info.backend_pid
        running = Execution(broker.app, message, "A")

        def granted_or_waiting() -> str | None:
            if _granted_elsewhere(lease_db, first):
                return "granted"
            with side_connection(lease_db) as admin:
                waiting = admin.execute(
                    "SELECT 1 FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))",
                    [ours],
                ).fetchone()
            return "waits for this transaction" if waiting else None

        outcome = wait_for(granted_or_waiting, "A's grant, or A waiting on this transaction")
    running.finish()
    assert outcome == "granted"


def _granted_elsewhere(alias: str, task_id: str) -> bool:
    """Whether ``task_id`` holds token 1, read on a connection of its own."""
    result: list[bool] = []

    def read() -> None:
        try:
            result.append(Lease.objects.using(alias).filter(task_id=task_id, token=1).exists())
        finally:
            connections.close_all()

    thread = threading.Thread(target=read)
    thread.start()
    thread.join(10)
    return bool(result and result[0])


def test_group_with_two_copies__every_member_result_completes(
    broker: Broker, lease_db: str, until_done: Any
) -> None:
    """A group's result holds its members' frozen ids, not what apply_async returned:
    a refused member's id never gets a result."""
    from celery import group

    app = broker.app
    result = group(app.signature("seams.keyed", (7,)), app.signature("seams.keyed", (7,)))()
    for message in broker.sent("seams.keyed"):
        deliver(app, message)
    sent = {h["id"] for h, _ in broker.sent("seams.keyed")}
    assert {child.id for child in result.results} <= sent


def test_until_done_no_longer_configured__the_grant_ends_the_row(
    broker: Broker, lease_db: str
) -> None:
    """A row recorded as until_done by a publisher whose configuration has since changed
    (the worker's task is no longer unique) is ended by the grant, not left for good."""
    task = broker.app.tasks["seams.keyed"]
    task.lease_unique = "until_done"
    try:
        first = publish(broker, 7)
    finally:
        task.lease_unique = None
    deliver(broker.app, broker.one("seams.keyed"))
    assert status(lease_db, first)[0] == states.SUCCESS
    assert pending(lease_db) == []


@pytest.fixture
def alias(alias_with_mariadb: str) -> str:
    """SQLite, PostgreSQL and MariaDB."""
    return alias_with_mariadb


def test_until_done__a_started_row_whose_key_has_no_grant_is_ended_by_the_sweep(
    broker: Broker, lease_db: str
) -> None:
    """A row stamped started under a key that has no lease row at all — left by a version
    that worked a job's key out twice (the row under ``report:(7,)``, the grant under
    another key) — is ended by the reclaimer's sweep: the key is not blocked forever. A
    started row whose grant is live stands."""
    task = broker.app.tasks["seams.keyed"]
    task.lease_unique = "until_done"
    try:
        orphan = publish(broker, 7)
        running = publish(broker, 8)
        rows = PendingJob.objects.using(lease_db)
        rows.filter(task_id=orphan).update(
            key="report:(7,)", unique_key="report:(7,)", started_token=1
        )
        execution = Execution(broker.app, broker.sent("seams.keyed")[1], "held")
        granted(lease_db, running, 1)
        assert publish(broker, 8) == running  # its copy still runs: refused
        resend_pending(broker.app, using=lease_db)
        assert not rows.filter(task_id=orphan).exists()
        assert rows.filter(task_id=running).exists()
        execution.finish()
    finally:
        task.lease_unique = None
