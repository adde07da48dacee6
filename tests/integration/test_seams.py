"""A stale execution changes nothing, through Celery's own tracer.

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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from celery import Celery, chain, chord, signals
from celery.app.trace import build_tracer
from django.db import OperationalError, connections
from django.db.models import F
from django_celery_results.models import ChordCounter, TaskResult

from celery_fenced import FencedTask, StaleToken, fenced_update
from celery_fenced.models import Lease, LeaseEvent
from celery_fenced.request_state import RequestState, carry
from testproject.demo.models import Report
from tests.conftest import WITH_MARIADB, terminate_connection

pytestmark = [
    pytest.mark.django_db(transaction=True, databases=WITH_MARIADB),
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

    @app.task(
        name="seams.permit",
        bind=True,
        base=FencedTask,
        shared=False,
        lease_ttl=30,
        lease_key="tiles:{customer}",
        lease_limit=2,
    )
    def permit(self: Any, customer: int, tile: int) -> str:
        _gate("seams.permit", tile)
        return f"{tile}@{self.request.fencing_token}"

    @app.task(name="seams.tracked", bind=True, base=FencedTask, shared=False, track_started=True)
    def tracked(self: Any, value: str) -> str:
        return f"{value}@{self.request.fencing_token}"

    @app.task(name="seams.conflict", bind=True, base=FencedTask, shared=False, lease_ttl=30)
    def conflict(self: Any, report_id: int) -> int:
        _gate("seams.conflict", report_id)
        token = self.request.fencing_token
        return fenced_update(Report.objects.filter(pk=report_id), token=token, body="x")

    @app.task(name="seams.lost", bind=True, base=FencedTask, shared=False, lease_ttl=30)
    def lost(self: Any, value: str) -> str:
        """Learns through the gate that its grant is gone (as the renewer tells it)."""
        _gate("seams.lost", value)
        self.lease.mark_lost("its grant expired")
        self.lease.check()
        return value

    @app.task(name="seams.sink", shared=False)
    def sink(*values: Any) -> list[Any]:
        RUNS.append(("seams.sink", values, threading.current_thread().name))
        return list(values)

    @app.task(name="seams.errback", shared=False)
    def errback(task_id: str) -> str:
        return task_id

    @app.task(name="seams.inline_errback", shared=False)
    def inline_errback(request: Any, exc: Any, traceback: Any) -> None:
        """An errback of the old (request, exc, traceback) signature: Celery runs it inline.

        Its own database write fails (a duplicate name): Celery logs and swallows that.
        """
        RUNS.append(("seams.inline_errback", request.id, threading.current_thread().name))
        Report.objects.create(name="taken")

    @app.task(
        name="seams.retrying",
        bind=True,
        base=FencedTask,
        shared=False,
        lease_ttl=30,
        lease_key="report:{report_id}",
    )
    def retrying(self: Any, report_id: int) -> str:
        _gate("seams.retrying", report_id)
        raise self.retry(countdown=3600)

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
    """The grant runs out by the database's clock (its holder is held at the gate).

    Copied in the database (``F``): on SQLite a time on a whole second, sent from Python,
    is text without its fraction, which sorts before the stored ``acquired_at`` and
    fails the expiry-order check."""
    Lease.objects.using(alias).filter(pk=lease.pk, token=lease.token).update(
        expires_at=F("acquired_at")
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


# -- review: what the change under review still lets through --------------------------------
def test_revoked_retrying_task__recorded_while_another_job_holds_its_key(
    broker: Broker, lease_db: str
) -> None:
    """A retrying task revoked by the worker's main process (its ETA'd retry message is
    discarded) records REVOKED, even while another job (another task id) holds the key:
    nobody else will ever record this task's outcome."""
    from celery.app.task import Context

    from celery_fenced.requests import EndedProcess

    app = broker.app
    app.signature("seams.retrying", (7,)).apply_async(task_id="retrying-7")
    deliver(app, broker.one("seams.retrying"))
    assert status(lease_db, "retrying-7")[0] == "RETRY"
    app.signature("seams.keyed", (7,)).apply_async(task_id="other-7")
    other = Execution(app, broker.one("seams.keyed"), "B")
    granted(lease_db, "other-7", 2)
    # what FencedRequest._context gives the main process for a delivery that never started
    context = Context(
        {
            "id": "retrying-7",
            "task": "seams.retrying",
            "args": [7],
            "kwargs": {},
            "hostname": "w@seams",
            "retries": 1,
        }
    )
    carry(context, RequestState(process=EndedProcess(None)))
    app.backend.mark_as_revoked("retrying-7", "revoked", request=context)
    other.finish()
    assert status(lease_db, "retrying-7")[0] == "REVOKED"
    assert status(lease_db, "other-7") == ("SUCCESS", '"7@2"')


def test_inline_errback_database_error__the_failure_is_still_stored_and_released(
    broker: Broker, lease_db: str
) -> None:
    """An old-signature errback runs inline, inside the proven transaction; its own failed
    database write (logged and swallowed by Celery) must not take the task's FAILURE and
    the lease release down with it."""
    Report.objects.using(lease_db).create(name="taken")
    app = broker.app
    app.signature(
        "seams.keyed", (9,), link_error=app.signature("seams.inline_errback")
    ).apply_async(task_id="fails-9")
    message = broker.one("seams.keyed")
    FAILING.add("MainThread")
    deliver(app, message)
    assert [run[0] for run in RUNS] == ["seams.keyed", "seams.inline_errback"]
    assert status(lease_db, "fails-9")[0] == "FAILURE"
    lease = Lease.objects.using(lease_db).get(key="report:9")
    assert lease.released_at is not None
    assert lease.completed_digest  # a redelivery is a completed duplicate


@pytest.mark.parametrize("workflow", ["chord", "chain"])
def test_stale_member_refused_for_another_job__the_workflow_ends_with_an_error(
    broker: Broker, lease_db: str, workflow: str
) -> None:
    """A workflow member refused as stale while *another* job holds its key is stored as
    FAILURE(StaleToken) (R2), and no execution of its task id will ever run again: the
    chord (or chain) waiting on it must end with that error, not wait forever."""
    app = broker.app
    member = app.signature("seams.keyed", (1,))
    if workflow == "chord":
        result = chord(
            [member, app.signature("seams.step", ("b",))], app.signature("seams.sink")
        )()
        deliver(app, broker.one("seams.step"))  # the other header member completes
    else:
        result = chain(member, app.signature("seams.sink")).apply_async()
    message = broker.one("seams.keyed")
    a = Execution(app, message, "A")
    expire(lease_db, granted(lease_db, message[0]["id"], 1))
    app.signature("seams.keyed", (1,)).apply_async(task_id="other-1")
    b = Execution(app, broker.sent("seams.keyed")[1], "B")
    granted(lease_db, "other-1", 2)
    a.finish()
    b.finish()
    row = TaskResult.objects.using(lease_db).get(task_id=message[0]["id"])
    assert (row.status, "StaleToken" in row.result) == ("FAILURE", True)
    assert broker.sent("seams.sink") == []
    # the caller of the workflow gets the error (here: the body / last step is failed)
    assert TaskResult.objects.using(lease_db).filter(task_id=result.id, status="FAILURE").exists()


@pytest.mark.filterwarnings("ignore:Exception raised outside body:RuntimeWarning")
def test_chain_step_publish_fails__the_failure_reaches_the_chain(
    broker: Broker, lease_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The current execution succeeds but its next chain step cannot be published (a
    broker error): as in Celery, the task is recorded FAILURE and the chain's remaining
    steps are marked failed, so the chain's caller gets the error instead of waiting."""
    from kombu.exceptions import OperationalError

    app = broker.app
    result = chain(app.signature("seams.step", ("p",)), app.signature("seams.sink")).apply_async()
    message = broker.one("seams.step")

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise OperationalError("broker down")

    monkeypatch.setattr(app.tasks["seams.sink"], "apply_async", refused)
    deliver(app, message)
    assert status(lease_db, message[0]["id"])[0] == "FAILURE"
    assert status(lease_db, result.id)[0] == "FAILURE"  # the chain's last step
    lease = Lease.objects.using(lease_db).get(task_id=message[0]["id"])
    assert lease.released_at is not None


def test_busy_resend_publish_fails__the_message_is_requeued_not_failed(
    broker: Broker, lease_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A delivery that finds the key busy is sent again by the package itself; when that
    re-send cannot be published, the job must not end (Celery's retry() turns a failed
    publish into Reject(requeue=False), which the worker records as FAILURE and acks)."""
    from celery.exceptions import Reject
    from kombu.exceptions import OperationalError

    app = broker.app
    app.signature("seams.keyed", (3,)).apply_async(task_id="holder-3")
    app.signature("seams.keyed", (3,)).apply_async(task_id="waiting-3")
    holder, waiting = broker.sent("seams.keyed")
    a = Execution(app, holder, "A")
    granted(lease_db, "holder-3", 1)
    task = app.tasks["seams.keyed"]
    original = task.apply_async

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise OperationalError("broker down")

    monkeypatch.setattr(task, "apply_async", refused)
    try:
        outcome = deliver(app, waiting)
    finally:
        monkeypatch.setattr(task, "apply_async", original)
        a.finish()
    rejected = outcome[0].exception  # what the worker's main process acts on
    rejected = getattr(rejected, "exc", rejected)
    assert isinstance(rejected, Reject)
    assert rejected.requeue  # the worker puts the message back: the job is not lost


def test_in_process_pool_report__ends_no_grant_of_another_execution(
    broker: Broker, lease_db: str
) -> None:
    """In the threads (or solo) pool the executions run in the worker's main process, so
    the pool pid the main process reports with is its own and names every execution of
    the worker. A stale execution's Reject(requeue=False), reported by the main process
    as FAILURE, must not end the grant of the current execution of the same task id
    running in another thread of that worker, nor record anything."""
    import os

    from celery.contrib.testing.mocks import TaskMessage
    from celery.exceptions import Reject

    from celery_fenced.requests import FencedRequest

    app = broker.app
    app.signature("seams.step", ("t",)).apply_async(task_id="threads-1")
    message = broker.one("seams.step")
    a = Execution(app, message, "A")
    expire(lease_db, granted(lease_db, "threads-1", 1))
    b = Execution(app, message, "B")
    granted(lease_db, "threads-1", 2)
    # the worker's request of A, accepted by the threads pool (apply_target: os.getpid())
    request = FencedRequest(
        TaskMessage("seams.step", id="threads-1", args=("t",)),
        app=app,
        task=app.tasks["seams.step"],
        hostname="w@seams",
    )
    request.on_accepted(os.getpid(), time.monotonic())
    a.finish()
    app.backend.mark_as_failure(
        "threads-1", Reject("stale", requeue=False), request=request._context
    )
    current = Lease.objects.using(lease_db).get(task_id="threads-1")
    assert (current.token, current.released_at) == (2, None)  # B still holds its grant
    b.finish()
    assert status(lease_db, "threads-1") == ("SUCCESS", '"t@2"')


@ORDERS
def test_ignore_result__stale_success_sends_no_callback_and_the_current_one_sends_it(
    broker: Broker, lease_db: str, stale_last: bool
) -> None:
    app = broker.app
    app.signature("seams.step", ("i",)).apply_async(
        link=app.signature("seams.sink"), ignore_result=True
    )
    message = broker.one("seams.step")
    stale_then_current(broker, lease_db, message, stale_last)
    assert list(broker.one("seams.sink")[1][0]) == ["i@2"]
    assert not TaskResult.objects.using(lease_db).filter(task_id=message[0]["id"]).exists()
    lease = Lease.objects.using(lease_db).get(task_id=message[0]["id"])
    assert (lease.token, lease.released_at is not None, bool(lease.completed_digest)) == (
        2,
        True,
        True,
    )


def test_eager__callbacks_run_once_and_the_lease_is_released(
    broker: Broker, lease_db: str
) -> None:
    app = broker.app
    app.conf.task_always_eager = True
    result = app.signature("seams.step", ("e",)).apply_async(link=app.signature("seams.sink"))
    assert result.get() == "e@1"
    assert [run[:2] for run in RUNS] == [("seams.step", "e"), ("seams.sink", ("e@1",))]
    lease = Lease.objects.using(lease_db).get()
    assert lease.released_at is not None


@pytest.mark.parametrize("original_first", [True, False], ids=["original-first", "resent-first"])
def test_reclaimed_job__original_completes_later_and_the_job_runs_and_chains_once(
    broker: Broker, lease_db: str, original_first: bool
) -> None:
    """The reclaimer re-sends an expired job whose original execution is only paused;
    the original then completes (no successor yet, or after the re-send ran). Either way
    the body's result is recorded once and the next chain step is sent once."""
    from celery_fenced.reclaim import reclaim_expired

    app = broker.app
    chain(app.signature("seams.step", ("c",)), app.signature("seams.sink")).apply_async()
    message = broker.one("seams.step")
    task_id = message[0]["id"]
    a = Execution(app, message, "A")
    expire(lease_db, granted(lease_db, task_id, 1))
    wait_for(lambda: reclaim_expired(app, grace=0, using=lease_db), "the re-send")
    resent = broker.sent("seams.step")[1]
    assert resent[0]["id"] == task_id
    if original_first:
        a.finish()
        deliver(app, resent)  # a completed duplicate: skipped
        expected = "c@1"
    else:
        deliver(app, resent)
        a.finish()  # refused: the re-sent execution owns the result
        expected = "c@2"
    assert list(broker.one("seams.sink")[1][0]) == [expected]
    assert status(lease_db, task_id) == ("SUCCESS", f'"{expected}"')
    assert len([run for run in RUNS if run[0] == "seams.step"]) == (1 if original_first else 2)


def test_stale_failure_store__never_overwrites_a_newer_execution_of_the_same_task(
    broker: Broker, lease_db: str
) -> None:
    """R1. A's grant expires; a redelivery A2 of the same task id takes over (token 2)
    and stores SUCCESS; then another job takes the key (token 3). Only then does A finish:
    its outcome is refused, and the FAILURE(StaleToken) R2 stores for a task id nobody
    else holds must not overwrite A2's result, written under a newer token."""
    app = broker.app
    app.signature("seams.keyed", (4,)).apply_async(task_id="job-4")
    message = broker.one("seams.keyed")
    a = Execution(app, message, "A")
    expire(lease_db, granted(lease_db, "job-4", 1))
    deliver(app, message)  # A2: token 2, SUCCESS
    assert status(lease_db, "job-4") == ("SUCCESS", '"4@2"')
    app.signature("seams.keyed", (4,)).apply_async(task_id="other-4")
    deliver(app, broker.sent("seams.keyed")[1])  # another job: token 3
    a.finish()
    assert status(lease_db, "job-4") == ("SUCCESS", '"4@2"')
    assert LeaseEvent.objects.using(lease_db).filter(kind="stale_write_rejected").count() == 1


def test_callbacks__published_as_the_tracer_publishes_them(broker: Broker, lease_db: str) -> None:
    """Celery's tracer publishes callbacks and chain steps through ``_retry_publish``:
    each message retried on its own, a bounded number of times. The backend that sends
    them for the tracer does the same (inside the lease's transaction, an unbounded
    publish retry would hold the lease row, on SQLite the database, for the outage)."""
    from celery.app import amqp

    if not hasattr(amqp, "_callback_publish_retry"):
        pytest.skip("Celery before 5.7 publishes callbacks without a retry of their own")
    app = broker.app
    seen: list[bool] = []

    def record(sender: Any = None, **_: Any) -> None:
        if sender == "seams.sink":
            seen.append(amqp._callback_publish_retry.get())

    signals.before_task_publish.connect(record, weak=False)
    try:
        step = app.signature("seams.step", ("q",), link=app.signature("seams.sink"))
        chain(step, app.signature("seams.sink")).apply_async()
        deliver(app, broker.one("seams.step"))
    finally:
        signals.before_task_publish.disconnect(record)
    assert seen == [True, True]


@pytest.mark.filterwarnings("ignore:Exception raised outside body:RuntimeWarning")
def test_success_not_settled__database_error_before_the_proof_fails_the_chain(
    broker: Broker, lease_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The database fails as the current execution's SUCCESS is settled, before anything
    is sent: as in Celery, the tracer records FAILURE, and the chain's remaining steps are
    marked failed (the backend still holds them), not left pending forever."""
    from django.db import OperationalError

    from celery_fenced.store import dialects

    app = broker.app
    result = chain(app.signature("seams.step", ("d",)), app.signature("seams.sink")).apply_async()
    message = broker.one("seams.step")
    dialect = type(dialects.for_alias(lease_db))
    original = dialect.release_current

    def flaky(self: Any, *args: Any, **kwargs: Any) -> Any:
        if args[0].state == "SUCCESS":
            raise OperationalError("connection lost")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(dialect, "release_current", flaky)
    # the settle rides out the failure as an outage first: its pauses, not 15 s of them
    monkeypatch.setattr("celery_fenced.outages.PAUSES", (0.01,) * 5)
    deliver(app, message)
    assert status(lease_db, message[0]["id"])[0] == "FAILURE"
    assert status(lease_db, result.id)[0] == "FAILURE"  # the chain's last step
    assert broker.sent("seams.sink") == []


def test_completed_job__redelivered_after_another_job_replaced_the_marker__does_not_run(
    broker: Broker, lease_db: str
) -> None:
    """Job 1 completes under its key; job 2 (another task id) completes under the same key
    and replaces the lease row's completion marker; a redelivery of job 1 is still found
    completed (its ``released`` event) and does not run."""
    app = broker.app
    app.signature("seams.keyed", (5,)).apply_async(task_id="first-5")
    app.signature("seams.keyed", (5,)).apply_async(task_id="second-5")
    first, second = broker.sent("seams.keyed")
    deliver(app, first)
    deliver(app, second)
    deliver(app, first)  # redelivered
    assert [run[1] for run in RUNS if run[0] == "seams.keyed"] == [5, 5]
    assert status(lease_db, "first-5") == ("SUCCESS", '"5@1"')
    assert LeaseEvent.objects.using(lease_db).filter(kind="duplicate").count() == 1


def test_stale_update_state__custom_state_not_written(broker: Broker, lease_db: str) -> None:
    """A stale execution's update_state() with a custom state writes nothing over the
    current execution's row."""
    app = broker.app
    app.signature("seams.step", ("u",)).apply_async(task_id="progress-1")
    message = broker.one("seams.step")
    task = app.tasks["seams.step"]
    original = task.run

    def run(value: str) -> str:
        _gate("seams.step", value)
        task.update_state(state="PROGRESS", meta={"by": threading.current_thread().name})
        return f"{value}@{task.request.fencing_token}"

    task.run = run
    try:
        a = Execution(app, message, "A")
        expire(lease_db, granted(lease_db, "progress-1", 1))
        b = Execution(app, message, "B")
        granted(lease_db, "progress-1", 2)
        b.gate.set()
        wait_for(
            lambda: TaskResult.objects.using(lease_db).filter(task_id="progress-1").exists(),
            "B's result",
        )
        a.finish()
        b.finish()
    finally:
        task.run = original
    assert status(lease_db, "progress-1") == ("SUCCESS", '"u@2"')


def test_replaced_task__redelivered_copy_does_not_replace_it_again(
    broker: Broker, lease_db: str
) -> None:
    """The current execution replaces itself (Celery sends the replacement under the same
    task id and raises Ignore); a copy of the original message delivered afterwards (a
    broker redelivery, or the package's own busy re-send) must not run the body and
    send the replacement a second time: the job was done."""
    app = broker.app
    app.signature("seams.step", ("r",)).apply_async(task_id="replaced-1")
    message = broker.one("seams.step")
    task = app.tasks["seams.step"]
    original = task.run

    def run(value: str) -> Any:
        _gate("seams.step", value)
        return task.replace(app.signature("seams.sink", ("replaced",)))

    task.run = run
    try:
        deliver(app, message)
        deliver(app, message)  # redelivered
    finally:
        task.run = original
    assert len([run for run in RUNS if run[0] == "seams.step"]) == 1
    assert len(broker.sent("seams.sink")) == 1
    assert len(broker.sent("seams.step")) == 1  # not re-sent as busy either
    assert Lease.objects.using(lease_db).get(task_id="replaced-1").released_at is not None
    assert LeaseEvent.objects.using(lease_db).filter(kind="duplicate").count() == 1


def test_retried_attempt__a_copy_of_its_message_does_not_run_the_job_again(
    broker: Broker, lease_db: str
) -> None:
    """Attempt 0 asks for a retry (message 1 is sent, the grant released as RETRY). A
    copy of attempt 0's message delivered afterwards (a broker redelivery) is a duplicate
    of a finished attempt: if it ran, it and the retry would each complete the job, and
    the chain would go on twice."""
    app = broker.app
    chain(app.signature("seams.step", ("a",)), app.signature("seams.sink")).apply_async()
    message = broker.one("seams.step")
    task = app.tasks["seams.step"]
    original = task.run
    calls: list[int] = []

    def run(value: str) -> Any:
        calls.append(task.request.retries)
        if len(calls) == 1:
            raise task.retry(countdown=0)
        return f"{value}@{task.request.fencing_token}"

    task.run = run
    try:
        deliver(app, message)  # attempt 0: retry
        retry = broker.sent("seams.step")[1]
        assert retry[0]["retries"] == 1
        deliver(app, message)  # attempt 0's message, redelivered
        deliver(app, retry)
    finally:
        task.run = original
    assert calls == [0, 1]
    assert len(broker.sent("seams.sink")) == 1


@ORDERS
def test_group_in_chain__stale_success_sends_no_group_and_the_current_one_sends_it_once(
    broker: Broker, lease_db: str, stale_last: bool
) -> None:
    from celery import group

    app = broker.app
    sinks = group(app.signature("seams.sink"), app.signature("seams.sink"))
    chain(app.signature("seams.step", ("g",)), sinks).apply_async()
    message = broker.one("seams.step")
    stale_then_current(broker, lease_db, message, stale_last)
    sent = broker.sent("seams.sink")
    assert [list(body[0]) for _, body in sent] == [["g@2"], ["g@2"]]


# -- the database goes away while a result settles: the outcome is settled again -----------
@pytest.mark.parametrize("keep", [True, False], ids=["kept connection", "Django's"])
def test_connection_lost_before_the_result__success_settles_once_back(
    broker: Broker, lease_db: str, keep: bool, settings: Any
) -> None:
    """A done job does not become a FAILURE because the database dropped the connection
    just before its result transaction (a restart, a failover): on the connection the
    worker keeps (``fenced_keep_connection``) or on Django's."""
    if lease_db != "postgres":
        pytest.skip("terminates a PostgreSQL backend")
    settings.CELERY_FENCED_KEEP_CONNECTION = keep
    app = broker.app
    task = app.tasks["seams.step"]
    original = task.run

    def run(value: str) -> str:
        terminate_connection(lease_db)
        return f"{value}@{task.request.fencing_token}"

    task.run = run
    try:
        app.signature("seams.step", ("c",)).apply_async()
        deliver(app, broker.one("seams.step"))
    finally:
        task.run = original
    connections[lease_db].close()  # this test's own reads: a new session
    task_id = broker.one("seams.step")[0]["id"]
    assert status(lease_db, task_id) == ("SUCCESS", '"c@1"')
    lease = Lease.objects.using(lease_db).get(task_id=task_id)
    assert lease.released_at is not None
    kinds = set(LeaseEvent.objects.using(lease_db).values_list("kind", flat=True))
    assert not kinds & {"lost", "stale_write_rejected"}


def test_connection_lost_before_the_started_state__the_job_still_runs(
    broker: Broker, lease_db: str
) -> None:
    """``track_started``: Celery's tracer writes STARTED before the body, so before the
    grant; a database restart then must not turn the job into a FAILURE (seen in the chaos
    runner: the write is waited through like a result's)."""
    if lease_db != "postgres":
        pytest.skip("terminates a PostgreSQL backend")
    app = broker.app
    app.signature("seams.tracked", ("v",)).apply_async(task_id="tracked-1")
    terminate_connection(lease_db)  # the server restarted under this process's connection
    deliver(app, broker.one("seams.tracked"))
    assert status(lease_db, "tracked-1") == ("SUCCESS", '"v@1"')


def test_connection_lost_before_a_retry__the_retry_is_sent_not_a_failure(
    broker: Broker, lease_db: str
) -> None:
    """``autoretry_for=(OperationalError,)`` is how tasks ride out a database restart: the
    proof of the lease that guards the retry message meets the same outage and must wait
    for the database, not turn the job into a FAILURE (seen in the chaos runner)."""
    if lease_db != "postgres":
        pytest.skip("terminates a PostgreSQL backend")

    def run(task: Any, report_id: int) -> str:
        terminate_connection(lease_db)  # the body saw the restart; it asks for a retry
        raise task.retry(countdown=3600)

    retry_sent_after_a_restart(broker, lease_db, run, 8)


def retry_sent_after_a_restart(
    broker: Broker, lease_db: str, run: Callable[[Any, int], str], report_id: int
) -> None:
    """Deliver ``seams.retrying`` (its body ``run(task, report_id)``, which meets the
    database's restart and asks for a retry): the retry is sent, RETRY recorded, and the
    grant ended (the next run takes one)."""
    app = broker.app
    task = app.tasks["seams.retrying"]
    original = task.run
    task_id = f"retrying-{report_id}"
    task.run = lambda report_id: run(task, report_id)
    try:
        app.signature("seams.retrying", (report_id,)).apply_async(task_id=task_id)
        deliver(app, broker.sent("seams.retrying")[0])
    finally:
        task.run = original
    assert status(lease_db, task_id)[0] == "RETRY"
    (first, _), (again, _) = broker.sent("seams.retrying")
    assert (first["retries"], again["retries"]) == (0, 1)
    lease = Lease.objects.using(lease_db).get(task_id=task_id)
    assert lease.released_at is not None  # the retry ended this grant; the next run takes one


def test_connection_lost_seen_by_the_body__its_autoretry_is_sent_not_a_failure(
    broker: Broker, lease_db: str
) -> None:
    """As above, but the body's own query met the ended session (as ``autoretry_for``
    sees it): psycopg marked the connection lost, its transaction status unknown, and
    Django keeps it. The guard's transaction must not be opened on it — setting
    autocommit there is psycopg's ProgrammingError ("can't change 'autocommit' now"),
    no outage to wait through: the job ended as a FAILURE, its retry lost."""
    if lease_db != "postgres":
        pytest.skip("terminates a PostgreSQL backend")

    def run(task: Any, report_id: int) -> str:
        terminate_connection(lease_db)  # the database restarted under the body
        try:
            Report.objects.using(lease_db).exists()
        except OperationalError as exc:  # what autoretry_for=(OperationalError,) does
            raise task.retry(exc=exc, countdown=3600) from exc
        raise AssertionError("the session was not ended")

    retry_sent_after_a_restart(broker, lease_db, run, 9)


@pytest.mark.parametrize("keep", [True, False], ids=["kept connection", "Django's"])
def test_connection_lost_after_the_proof__the_stale_execution_sends_no_callback(
    broker: Broker, lease_db: str, keep: bool, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """R4 (seen in the chaos runner). A's success is proven, and A's process is paused
    (SIGSTOP) in the transaction that proved it, before its callback is sent. The
    database restarts under it: that transaction is rolled back, the grant expires, B
    takes over (token 2) and sends the callback. A resumes: its proof went with its
    connection, so it must send nothing (its outcome is refused when tried again)."""
    if lease_db != "postgres":
        pytest.skip("terminates a PostgreSQL backend")
    from celery_fenced import store
    from tests.conftest import side_connection

    settings.CELERY_FENCED_KEEP_CONNECTION = keep
    app = broker.app
    app.signature("seams.step", ("y",)).apply_async(link=app.signature("seams.sink"))
    message = broker.one("seams.step")
    task_id = message[0]["id"]
    paused, resume = threading.Event(), threading.Event()
    backend_pid: list[int] = []
    prove = store.prove_for_result

    def pause_a(lease: Any, *args: Any, **kwargs: Any) -> Any:
        proven = prove(lease, *args, **kwargs)
        if threading.current_thread().name == "A" and not paused.is_set():
            # A is paused in the transaction that proved it, holding the lease row
            backend_pid.append(connections[lease.alias].connection.info.backend_pid)
            paused.set()
            assert resume.wait(60)
        return proven

    monkeypatch.setattr(store, "prove_for_result", pause_a)
    try:
        a = Execution(app, message, "A")
        a.gate.set()  # the body returns at once; A settles its success
        assert paused.wait(30), "A never settled its success"
        with side_connection(lease_db) as admin:  # the restart, while A is paused
            admin.execute("SELECT pg_terminate_backend(%s)", [backend_pid[0]])
            wait_for(
                lambda: (
                    not admin.execute(
                        "SELECT 1 FROM pg_stat_activity WHERE pid = %s", [backend_pid[0]]
                    ).fetchone()
                ),
                "A's session to end",
            )
        expire(lease_db, granted(lease_db, task_id, 1))  # A's release went with it
        b = Execution(app, message, "B")
        b.finish()  # token 2: the job's result, and its callback
        resume.set()
        a.thread.join(60)
        assert not a.thread.is_alive()
    finally:
        resume.set()
    assert [list(body[0]) for _, body in broker.sent("seams.sink")] == [["y@2"]]
    assert status(lease_db, task_id) == ("SUCCESS", '"y@2"')


def test_busy_failed_redelivery_in_the_same_process__ends_not_the_running_grant(
    broker: Broker, lease_db: str
) -> None:
    """A threads pool runs the redelivered copy of a running job in the same process:
    found busy with ``on_busy="fail"``, its FAILURE is reported without a lease — and must
    end no grant but its own thread's (it has none): the running execution keeps its
    lease and its result stands (a late or duplicate delivery ends none)."""
    app = broker.app
    task = app.tasks["seams.keyed"]
    task.lease_on_busy = "fail"
    try:
        app.signature("seams.keyed", (5,)).apply_async(task_id="running-5")
        message = broker.one("seams.keyed")
        a = Execution(app, message, "A")
        granted(lease_db, "running-5", 1)
        deliver(app, message)  # the same message again, in this thread: busy, fails
        lease = Lease.objects.using(lease_db).get(key="report:5")
        assert (lease.token, lease.released_at) == (1, None)  # A still holds it
        a.finish()
    finally:
        task.lease_on_busy = None
    assert status(lease_db, "running-5") == ("SUCCESS", '"5@1"')


@pytest.fixture
def alias(alias_with_mariadb: str) -> str:
    """SQLite, PostgreSQL and MariaDB."""
    return alias_with_mariadb
