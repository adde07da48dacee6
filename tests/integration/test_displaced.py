"""A job displaced by another job's takeover of its expired grant: handed to
the outbox, it ends with exactly one outcome, whichever report comes first. Found by an
adversarial review of the hand-over; through Celery's tracer on both databases."""

from __future__ import annotations

from typing import Any

import pytest
from celery import chain, states

from celery_fenced.models import Lease, PendingJob
from celery_fenced.outbox import resend_pending
from tests.conftest import WITH_MARIADB
from tests.integration.test_seams import (
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


def _chain_taken_over(broker: Broker, alias: str, value: str) -> tuple[str, Execution, Execution]:
    """A = chain(step(value), sink) with an errback, granted, held, expired; B (another task
    id, same default key) takes the key over. Returns A's task id, A and B."""
    app = broker.app
    step = app.signature("seams.step", (value,), link_error=app.signature("seams.errback"))
    chain(step, app.signature("seams.sink")).apply_async()
    message = broker.one("seams.step")
    a_id = message[0]["id"]
    a = Execution(app, message, "A")
    expire(alias, granted(alias, a_id, 1))
    app.signature("seams.step", (value,)).apply_async(task_id=f"b-{value}")
    b = Execution(app, broker.sent("seams.step")[1], "B")
    granted(alias, f"b-{value}", 2)
    return a_id, a, b


def test_displaced_job_already_resent__the_stale_report_is_its_one_outcome(
    broker: Broker, lease_db: str
) -> None:
    """The reclaimer has already sent A's displaced job (its copy is in the broker) when
    the paused A1 reports: R2 stores FAILURE(StaleToken) and the errback fires; the copy
    in flight is then a completed duplicate — never SUCCESS over that FAILURE, never the
    chain's next step (one outcome, its workflow driven once)."""
    app = broker.app
    a_id, a, b = _chain_taken_over(broker, lease_db, "q")
    assert [(o.task_id, o.action) for o in resend_pending(app)] == [(a_id, "resent")]
    resent = broker.sent("seams.step")[-1]
    assert resent[0]["id"] == a_id
    a.finish()  # A1 wakes: refused, the key is B's
    b.finish()
    first = status(lease_db, a_id)
    deliver(app, resent)  # the copy the reclaimer sent arrives
    outcomes = (first[0], status(lease_db, a_id)[0])
    drives = (len(broker.sent("seams.errback")), len(broker.sent("seams.sink")))
    # one outcome, one drive of the workflow: either A1's FAILURE stands and the copy does
    # not run, or the copy owns the result and A1 wrote nothing
    assert (outcomes, drives) in {
        ((states.FAILURE, states.FAILURE), (1, 0)),
        ((states.SUCCESS, states.SUCCESS), (0, 1)),
    }, (outcomes, drives)


def test_displaced_copy_busy_retrying__the_stale_report_ends_the_retry_too(
    broker: Broker, lease_db: str
) -> None:
    """The re-sent copy A2 meets B still holding the key: it is retried (its retry
    recorded in the outbox). Then A1 reports FAILURE(StaleToken): the retry, when it
    runs, is a completed duplicate — one outcome, one errback, no chain step."""
    app = broker.app
    a_id, a, b = _chain_taken_over(broker, lease_db, "r")
    resend_pending(app)
    deliver(app, broker.sent("seams.step")[-1])  # A2: busy, retried
    retry = broker.sent("seams.step")[-1]
    assert retry[0]["id"] == a_id
    assert len(broker.sent("seams.step")) == 4
    assert [row.task_id for row in pending(lease_db)] == [a_id]  # the retry's row
    a.finish()  # A1 reports while A's retry is pending
    first = status(lease_db, a_id)[0]
    left = [row.task_id for row in pending(lease_db)]  # the retry's row: deleted by A1
    b.finish()
    deliver(app, retry)  # the retry runs the job
    outcomes = (first, status(lease_db, a_id)[0])
    drives = (len(broker.sent("seams.errback")), len(broker.sent("seams.sink")))
    assert (outcomes, drives) in {
        ((states.FAILURE, states.FAILURE), (1, 0)),
        ((states.SUCCESS, states.SUCCESS), (0, 1)),
    }, (outcomes, drives, left)


def test_displaced_copy_busy__its_retry_state_written_after_the_stale_report__failure_stands(
    broker: Broker, lease_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The re-sent copy A2 finds B holding the key and is retried; A1 reports between
    A2's busy check and A2's RETRY state write (seen in the long chaos run): A1's
    FAILURE(StaleToken) is the job's one outcome — A2's untokened RETRY must not write
    over it, or the job ends RETRY for ever (its retry is a completed duplicate)."""
    import threading

    from celery_fenced.backends import FencedDatabaseBackend
    from tests.integration.test_seams import Execution

    app = broker.app
    a_id, a, b = _chain_taken_over(broker, lease_db, "w")
    resend_pending(app)
    reached, go_on = threading.Event(), threading.Event()
    original = FencedDatabaseBackend.mark_as_retry

    def held_retry(self: Any, task_id: str, *args: Any, **kwargs: Any) -> Any:
        if threading.current_thread().name == "A2":
            reached.set()
            assert go_on.wait(60)
        return original(self, task_id, *args, **kwargs)

    monkeypatch.setattr(FencedDatabaseBackend, "mark_as_retry", held_retry)
    a2 = Execution(app, broker.sent("seams.step")[-1], "A2")  # busy: B holds the key
    assert reached.wait(30), "A2 was never retried"
    a.finish()  # A1's stale report: FAILURE(StaleToken)
    assert status(lease_db, a_id)[0] == states.FAILURE
    go_on.set()
    a2.finish()  # A2 writes its RETRY state now
    retry = broker.sent("seams.step")[-1]
    assert retry[0]["id"] == a_id
    b.finish()
    deliver(app, retry)  # a completed duplicate: skipped
    assert status(lease_db, a_id)[0] == states.FAILURE
    assert len(broker.sent("seams.errback")) == 1
    assert broker.sent("seams.sink") == []


def test_displaced_execution_killed_by_time_limit__its_failure_ends_the_job(
    broker: Broker, lease_db: str
) -> None:
    """A1 (displaced by B, its job handed to the outbox) is killed by its hard time limit:
    the worker's main process records FAILURE(TimeLimitExceeded) for A (nobody holds a
    grant of A's task id) and the errback fires. That ends the job, as the same time
    limit does without a takeover: its outbox row goes, the reclaimer does not send it
    again."""
    import os
    import time

    from celery.contrib.testing.mocks import TaskMessage
    from celery.exceptions import TimeLimitExceeded

    from celery_fenced.requests import FencedRequest

    app = broker.app
    a_id, a, b = _chain_taken_over(broker, lease_db, "t")
    request = FencedRequest(
        TaskMessage("seams.step", id=a_id, args=("t",)),
        app=app,
        task=app.tasks["seams.step"],
        hostname="w@seams",
    )
    request.on_accepted(os.getpid(), time.monotonic())
    app.backend.mark_as_failure(a_id, TimeLimitExceeded(5.0), request=request._context)
    first = status(lease_db, a_id)[0]
    b.finish()
    left = [row.task_id for row in pending(lease_db)]
    for _outcome in resend_pending(app):
        deliver(app, broker.sent("seams.step")[-1])
    outcomes = (first, status(lease_db, a_id)[0])
    sink = len(broker.sent("seams.sink"))
    a.finish()
    # the main process's report is the job's outcome (as without a takeover): the row ends
    assert (outcomes, sink, left) == ((states.FAILURE, states.FAILURE), 0, []), (
        outcomes,
        sink,
        left,
    )


@pytest.mark.django_db(transaction=True, databases=WITH_MARIADB)
def test_postgresql_takeover_of_a_grant_committed_after_the_snapshot__hands_over_that_job(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """READ COMMITTED: the takeover's ON CONFLICT updates the row's *latest* version, but
    its ``displaced`` CTE reads the row from the statement's snapshot. C takes A's expired
    grant over in a transaction that commits late (its process paused before the commit), after
    its short grant has run out; D's takeover statement takes its snapshot (A's expired
    grant) and waits for the row; C commits; D's ON CONFLICT takes C's expired grant over,
    ``reclaimed_from`` = C, and its CTE would hand A's job (already handed over by C) to
    the outbox, not C's — C's job lost if C's worker dies. The takeover grants only over
    the row its snapshot read; refused, it is tried again from a new snapshot and hands
    C's job over.

    The routine statement is skipped (as for a D paused between its two statements:
    its takeover statement then takes its snapshot while C's is uncommitted)."""
    import threading

    from django.db import connections, transaction

    from celery_fenced import store
    from celery_fenced.reclaim import Job, encode_job
    from celery_fenced.store.dialects.postgresql import PostgreSQL
    from tests.conftest import wait_until_blocked
    from tests.integration.test_reclaim import expire as expire_key
    from tests.integration.test_seams import wait_for

    alias = "postgres"
    monkeypatch.setattr(PostgreSQL, "_routine_grant", lambda self, request: None)

    def job(name: str) -> str:
        return encode_job(Job("app.tasks.rebuild", [name], {}, {}))

    store.grant("k", ttl=30, task_id="a", task_name="app.tasks.rebuild", job=job("a"), using=alias)
    expire_key(alias, "k")
    errors: list[BaseException] = []
    c_granted: list[Any] = []
    c_commits = threading.Event()

    def take(task_id: str, ttl: float) -> Any:
        return store.grant(
            "k",
            ttl=ttl,
            task_id=task_id,
            task_name="app.tasks.rebuild",
            job=job(task_id),
            using=alias,
        )

    def run(body: Any) -> None:
        try:
            body()
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    def c_body() -> None:
        with transaction.atomic(using=alias):
            c_granted.append(take("c", 0.3))
            assert c_commits.wait(60)

    c = threading.Thread(target=run, args=(c_body,))
    c.start()
    (granted,) = wait_for(lambda: c_granted, "C's grant")
    # C's grant has run out by D's statement clock before D starts
    wait_for(lambda: store.database_now(alias) > granted.expires_at, "C's grant to run out")
    d = threading.Thread(target=run, args=(lambda: take("d", 30),))
    d.start()
    wait_until_blocked(alias, d)  # D's snapshot taken, waiting for C's row
    c_commits.set()
    c.join(60)
    d.join(60)
    assert not c.is_alive(), "C is still waiting"
    assert not d.is_alive(), "D is still waiting"
    assert not errors, errors
    lease = Lease.objects.using(alias).get(key="k")
    assert (lease.task_id, lease.token) == ("d", 3)  # D took C's grant (token 2) over
    handed = sorted(PendingJob.objects.using(alias).values_list("task_id", flat=True))
    assert handed == ["a", "c"], handed  # C's job was displaced too


@pytest.fixture
def alias(alias_with_mariadb: str) -> str:
    """SQLite, PostgreSQL and MariaDB."""
    return alias_with_mariadb
