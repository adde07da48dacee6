"""A stale execution changes nothing, through Celery's own tracer (issue 14).

Each test delivers real messages — published by Celery's canvas (chains, chords, links)
into an in-memory broker and captured with Celery's ``before_task_publish`` signal — to
``celery.app.trace.build_tracer``, as a worker's pool process does, with the fenced
result backend and real leases on SQLite and PostgreSQL. A "stale" execution is one whose
grant expired while its body was held at a gate and was taken over by another delivery
of the same message.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from celery import Celery, chain, chord, signals
from celery.app.trace import build_tracer
from django.db import connections
from django_celery_results.models import ChordCounter, TaskResult

from celery_fenced import FencedTask, StaleToken, fenced_update
from celery_fenced.models import Lease, LeaseEvent
from testproject.demo.models import Report

from .conftest import DATABASE_ALIASES

pytestmark = [
    pytest.mark.django_db(transaction=True, databases=DATABASE_ALIASES),
    pytest.mark.timeout(120),
]

#: names of the threads whose task bodies wait at the gate, and their gates
GATES: dict[str, threading.Event] = {}
#: names of the threads whose task bodies raise once through the gate
FAILING: set[str] = set()
#: (task name, value, thread) of every body that ran
RUNS: list[tuple[str, Any, str]] = []


def _gate(name: str, value: Any) -> None:
    thread = threading.current_thread().name
    RUNS.append((name, value, thread))
    gate = GATES.get(thread)
    if gate is not None:
        assert gate.wait(60), f"the gate of {thread} was never opened"
    if thread in FAILING:
        raise ValueError(f"{name} failed in {thread}")


def make_app() -> Celery:
    app = Celery("seams", set_as_current=False, broker="memory://")
    app.conf.update(
        result_backend="celery_fenced.backends:FencedDatabaseBackend",
        result_extended=True,
        task_default_queue="seams",
        fenced_duplicate_window=3600,
    )

    @app.task(name="seams.step", bind=True, base=FencedTask, lease_ttl=30, shared=False)
    def step(self: Any, value: str) -> str:
        _gate("seams.step", value)
        return f"{value}@{self.request.fencing_token}"

    @app.task(
        name="seams.keyed",
        bind=True,
        base=FencedTask,
        shared=False,
        lease_ttl=30,
        lease_key="report:{report_id}",
    )
    def keyed(self: Any, report_id: int) -> str:
        _gate("seams.keyed", report_id)
        return f"{report_id}@{self.request.fencing_token}"

    @app.task(name="seams.conflict", bind=True, base=FencedTask, shared=False, lease_ttl=30)
    def conflict(self: Any, report_id: int) -> int:
        _gate("seams.conflict", report_id)
        token = self.request.fencing_token
        return fenced_update(Report.objects.filter(pk=report_id), token=token, body="x")

    @app.task(name="seams.sink", shared=False)
    def sink(*values: Any) -> list[Any]:
        RUNS.append(("seams.sink", values, threading.current_thread().name))
        return list(values)

    @app.task(name="seams.errback", shared=False)
    def errback(task_id: str) -> str:
        return task_id

    return app


@dataclass
class Broker:
    """What the app published, in order: (task name, headers, body) of each message."""

    app: Celery
    messages: list[tuple[str, dict[str, Any], Any]] = field(default_factory=list)

    def record(self, sender: Any = None, headers: Any = None, body: Any = None, **_: Any) -> None:
        self.messages.append((headers["task"], dict(headers), body))

    def sent(self, name: str) -> list[tuple[dict[str, Any], Any]]:
        return [(h, b) for n, h, b in self.messages if n == name]

    def one(self, name: str) -> tuple[dict[str, Any], Any]:
        sent = self.sent(name)
        assert len(sent) == 1, f"{name} was sent {len(sent)} times: {sent}"
        return sent[0]


@pytest.fixture
def broker(lease_db: str) -> Iterator[Broker]:
    app = make_app()
    recorded = Broker(app)
    signals.before_task_publish.connect(recorded.record, weak=False)
    GATES.clear()
    FAILING.clear()
    RUNS.clear()
    yield recorded
    signals.before_task_publish.disconnect(recorded.record)
    for gate in GATES.values():
        gate.set()


def deliver(app: Celery, message: tuple[dict[str, Any], Any]) -> Any:
    """Run one delivery of ``message`` through Celery's tracer, as a pool process does."""
    headers, body = message
    args, kwargs, embed = body
    request = {
        **headers,
        **embed,
        "delivery_info": {"exchange": "", "routing_key": "seams", "priority": 0},
        "hostname": "w@seams",
        "is_eager": False,
    }
    task = app.tasks[headers["task"]]
    trace = build_tracer(task.name, task, app=app, hostname="w@seams")
    return trace(headers["id"], list(args), dict(kwargs), request)


class Execution:
    """One delivery running in a thread of its own, held at the gate until finished."""

    def __init__(self, app: Celery, message: tuple[dict[str, Any], Any], name: str) -> None:
        self.name = name
        self.gate = GATES.setdefault(name, threading.Event())
        self.outcome: list[Any] = []

        def run() -> None:
            try:
                self.outcome.append(deliver(app, message))
            finally:
                connections.close_all()

        self.thread = threading.Thread(target=run, name=name)
        self.thread.start()

    def finish(self) -> None:
        self.gate.set()
        self.thread.join(60)
        assert not self.thread.is_alive()


def wait_for(condition: Callable[[], Any], what: str, timeout: float = 30) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def granted(alias: str, task_id: str, token: int) -> Lease:
    return wait_for(
        lambda: Lease.objects.using(alias).filter(task_id=task_id, token=token).first(),
        f"token {token} of task {task_id}",
    )


def expire(alias: str, lease: Lease) -> None:
    """The grant runs out by the database's clock (its holder is held at the gate)."""
    Lease.objects.using(alias).filter(pk=lease.pk, token=lease.token).update(
        expires_at=lease.acquired_at
    )


def stale_then_current(
    broker: Broker, alias: str, message: tuple[dict[str, Any], Any], stale_last: bool
) -> None:
    """Delivery A is granted, held, and its grant expires; delivery B takes over.

    ``stale_last``: A finishes after B has finished; otherwise while B is still held.
    """
    task_id = message[0]["id"]
    a = Execution(broker.app, message, "A")
    expire(alias, granted(alias, task_id, 1))
    b = Execution(broker.app, message, "B")
    granted(alias, task_id, 2)
    first, last = (b, a) if stale_last else (a, b)
    first.finish()
    last.finish()


ORDERS = pytest.mark.parametrize("stale_last", [True, False], ids=["A-after-B", "A-before-B"])


def status(alias: str, task_id: str) -> tuple[str, str]:
    row = TaskResult.objects.using(alias).get(task_id=task_id)
    return row.status, row.result


# -- case 2: a stale execution drives nothing of its workflow --------------------------------
@ORDERS
def test_chain__stale_success_sends_no_next_step(
    broker: Broker, lease_db: str, stale_last: bool
) -> None:
    app = broker.app
    chain(app.signature("seams.step", ("x",)), app.signature("seams.sink")).apply_async()
    message = broker.one("seams.step")
    stale_then_current(broker, lease_db, message, stale_last)
    _, body = broker.one("seams.sink")
    assert list(body[0]) == ["x@2"]  # the current execution's value, sent once
    assert status(lease_db, message[0]["id"]) == ("SUCCESS", '"x@2"')


@ORDERS
def test_link__stale_success_sends_no_callback(
    broker: Broker, lease_db: str, stale_last: bool
) -> None:
    app = broker.app
    app.signature("seams.step", ("y",)).apply_async(link=app.signature("seams.sink"))
    message = broker.one("seams.step")
    stale_then_current(broker, lease_db, message, stale_last)
    assert list(broker.one("seams.sink")[1][0]) == ["y@2"]


@ORDERS
def test_chord__stale_header_counts_nothing_and_the_body_fires_once(
    broker: Broker, lease_db: str, stale_last: bool
) -> None:
    app = broker.app
    header = [app.signature("seams.step", (v,)) for v in ("a", "b")]
    chord(header, app.signature("seams.sink")).apply_async()
    first, second = broker.sent("seams.step")
    deliver(app, second)  # header b completes
    stale_then_current(broker, lease_db, first, stale_last)
    _, body = broker.one("seams.sink")
    assert sorted(body[0][0]) == ["a@2", "b@1"]
    assert not ChordCounter.objects.using(lease_db).exists()


@ORDERS
def test_chain__stale_failure_marks_nothing_failed_and_fires_no_errback(
    broker: Broker, lease_db: str, stale_last: bool
) -> None:
    app = broker.app
    step = app.signature("seams.step", ("z",), link_error=app.signature("seams.errback"))
    chain(step, app.signature("seams.sink")).apply_async()
    message = broker.one("seams.step")
    FAILING.add("A")
    stale_then_current(broker, lease_db, message, stale_last)
    successor = broker.one("seams.sink")
    deliver(app, successor)
    assert status(lease_db, successor[0]["id"])[0] == "SUCCESS"
    assert status(lease_db, message[0]["id"]) == ("SUCCESS", '"z@2"')
    assert broker.sent("seams.errback") == []


def test_chain__current_failure_marks_successors_failed_and_fires_the_errback_once(
    broker: Broker, lease_db: str
) -> None:
    """The current execution still does what Celery does with a failure, once."""
    app = broker.app
    step = app.signature("seams.step", ("f",), link_error=app.signature("seams.errback"))
    result = chain(step, app.signature("seams.sink")).apply_async()
    message = broker.one("seams.step")
    FAILING.add("MainThread")
    deliver(app, message)
    assert status(lease_db, message[0]["id"])[0] == "FAILURE"
    assert status(lease_db, result.id)[0] == "FAILURE"  # the chain's last step
    assert len(broker.sent("seams.errback")) == 1
    assert broker.sent("seams.sink") == []


# -- case 3: a completed job never runs again, whatever its copy's retry count ------------
def test_busy_copy__retried_copy_of_a_completed_job_does_not_run_again(
    broker: Broker, lease_db: str
) -> None:
    app = broker.app
    app.signature("seams.step", ("r",)).apply_async()
    message = broker.one("seams.step")
    holder = Execution(app, message, "A")
    granted(lease_db, message[0]["id"], 1)
    deliver(app, message)  # a redelivered copy finds the key busy: retried later
    original, retried = broker.sent("seams.step")
    assert retried[0]["retries"] == original[0]["retries"] == 0  # a re-send keeps the count
    holder.finish()
    assert status(lease_db, message[0]["id"]) == ("SUCCESS", '"r@1"')
    deliver(app, retried)
    assert [run for run in RUNS if run[0] == "seams.step"] == [("seams.step", "r", "A")]
    assert LeaseEvent.objects.using(lease_db).filter(kind="duplicate").count() == 1


# -- case 6: a refused row is not taken for an expired grant ------------------------------
def test_row_conflict__fails_with_stale_token_and_releases_the_grant(
    broker: Broker, lease_db: str
) -> None:
    report = Report.objects.using(lease_db).create(name="r")
    # written under another key's newer token (save() never sets the token column)
    Report.objects.using(lease_db).filter(pk=report.pk).update(fencing_token=100)
    app = broker.app
    app.signature("seams.conflict", (report.pk,)).apply_async()
    message = broker.one("seams.conflict")
    deliver(app, message)
    row = TaskResult.objects.using(lease_db).get(task_id=message[0]["id"])
    assert row.status == "FAILURE"
    assert "StaleToken" in row.result
    assert len(broker.sent("seams.conflict")) == 1  # not retried
    lease = Lease.objects.using(lease_db).get(task_id=message[0]["id"])
    assert (lease.token, lease.released_at is not None) == (1, True)


# -- case 7: an expired grant nobody took over still stores its result -----------------------
def test_expired_grant_without_successor__result_is_stored(broker: Broker, lease_db: str) -> None:
    app = broker.app
    app.signature("seams.keyed", (7,)).apply_async()
    message = broker.one("seams.keyed")
    a = Execution(app, message, "A")
    expire(lease_db, granted(lease_db, message[0]["id"], 1))
    a.finish()
    assert status(lease_db, message[0]["id"]) == ("SUCCESS", '"7@1"')
    lease = Lease.objects.using(lease_db).get(key="report:7")
    assert lease.released_at is not None


# -- case 14: a task id reused for a new job runs; its redelivery does not -----------------
def test_reused_task_id__new_arguments_run_and_a_redelivery_does_not(
    broker: Broker, lease_db: str
) -> None:
    app = broker.app
    app.signature("seams.step", ("first",)).apply_async(task_id="report-7")
    app.signature("seams.step", ("second",)).apply_async(task_id="report-7")
    first, second = broker.sent("seams.step")
    deliver(app, first)
    deliver(app, second)
    deliver(app, second)  # redelivered
    assert [run[1] for run in RUNS if run[0] == "seams.step"] == ["first", "second"]
    assert status(lease_db, "report-7") == ("SUCCESS", '"second@1"')


# -- retries and replace: a stale execution sends neither -----------------------------------
@pytest.mark.parametrize("how", ["retry", "replace"])
def test_stale_retry_or_replace__sends_nothing(broker: Broker, lease_db: str, how: str) -> None:
    from celery_fenced.store import HeldLease

    app = broker.app
    app.signature("seams.step", ("s",)).apply_async()
    message = broker.one("seams.step")
    task = app.tasks["seams.step"]
    lease_seen: list[HeldLease] = []
    original = task.run

    def run(value: str) -> Any:
        _gate("seams.step", value)
        lease_seen.append(task.lease)
        if how == "replace":
            return task.replace(app.signature("seams.sink", ("replaced",)))
        return task.retry(countdown=60)

    task.run = run
    try:
        a = Execution(app, message, "A")
        lease = granted(lease_db, message[0]["id"], 1)
        expire(lease_db, lease)
        Lease.objects.using(lease_db).filter(pk=lease.pk).update(token=2)  # taken over
        a.finish()
    finally:
        task.run = original
    assert len(broker.sent("seams.step")) == 1  # no retry message
    assert broker.sent("seams.sink") == []  # no replacement
    assert len(lease_seen) == 1
    assert lease_seen[0].lost
    with pytest.raises(StaleToken):
        lease_seen[0].guard().__enter__()


# -- the database goes away while a result settles: the outcome is settled again -----------
def test_connection_lost_before_the_result__success_settles_once_back(
    broker: Broker, lease_db: str
) -> None:
    """A done job does not become a FAILURE because the database dropped the connection
    just before its result transaction (a restart, a failover)."""
    if lease_db != "postgres":
        pytest.skip("terminates a PostgreSQL backend")
    import psycopg

    app = broker.app
    task = app.tasks["seams.step"]
    original = task.run

    def run(value: str) -> str:
        connection = connections[lease_db]
        connection.ensure_connection()
        pid = connection.connection.info.backend_pid
        settings = connection.settings_dict
        with psycopg.connect(
            host=settings["HOST"],
            port=settings["PORT"],
            user=settings["USER"],
            password=settings["PASSWORD"],
            dbname=settings["NAME"],
            autocommit=True,
        ) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", [pid])
        return f"{value}@{task.request.fencing_token}"

    task.run = run
    try:
        app.signature("seams.step", ("c",)).apply_async()
        deliver(app, broker.one("seams.step"))
    finally:
        task.run = original
    task_id = broker.one("seams.step")[0]["id"]
    assert status(lease_db, task_id) == ("SUCCESS", '"c@1"')
    lease = Lease.objects.using(lease_db).get(task_id=task_id)
    assert lease.released_at is not None
    kinds = set(LeaseEvent.objects.using(lease_db).values_list("kind", flat=True))
    assert not kinds & {"lost", "stale_write_rejected"}
