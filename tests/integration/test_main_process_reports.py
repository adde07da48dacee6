"""The worker's main process reports the end of an execution it did not run, through
Celery's own request (``celery.worker.request.Request``) and billiard's order of calls,
for a real child process standing in for the pool process.

A pool process's owners start with ``w@seams:<boot id>:<pid>:`` (celery_fenced.owners):
the boot id is this process's, the worker's main process that forked its pool."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from billiard.einfo import ExceptionInfo
from celery import states
from celery.contrib.testing.mocks import TaskMessage
from celery.exceptions import TimeLimitExceeded
from django.db import connections
from django.db.models import F
from django_celery_results.models import TaskResult

from celery_fenced import acquire, owners
from celery_fenced.models import Lease
from celery_fenced.request_state import state_of
from celery_fenced.requests import FencedRequest
from tests.conftest import WITH_MARIADB
from tests.integration.test_seams import RUNS, Broker, deliver, status, wait_for

pytestmark = [
    pytest.mark.django_db(transaction=True, databases=WITH_MARIADB),
    pytest.mark.timeout(120),
]


@pytest.fixture
def pool_process() -> Iterator[subprocess.Popen[bytes]]:
    """A real child process of this one, standing in for the worker's pool process."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield child
    child.kill()
    child.wait()


def pool_owner(pid: int) -> str:
    """The owner of an execution in this worker's pool process ``pid``."""
    return owners.process_prefix("w@seams", pid) + "1"


def reports_waiting() -> bool:
    return any(t.name.startswith("celery-fenced-after-exit-") for t in threading.enumerate())


def accepted(broker: Broker, task_id: str, pid: int) -> Any:
    """The main process's request of ``seams.step`` (with an errback), accepted by ``pid``."""
    app = broker.app
    message = TaskMessage(
        "seams.step",
        id=task_id,
        args=("t",),
        errbacks=[dict(app.signature("seams.errback"))],
    )
    request = FencedRequest(message, app=app, task=app.tasks["seams.step"], hostname="w@seams")
    request.on_accepted(pid, time.monotonic())
    return request


def test_hard_time_limit__reported_twice_by_celery__recorded_and_its_errback_sent_once(
    broker: Broker, lease_db: str, pool_process: subprocess.Popen[bytes]
) -> None:
    """billiard's ``TimeoutHandler.on_hard_timeout`` sets the job's result (Celery's
    ``Request.on_failure``: ``mark_as_failure``), then runs the timeout callback
    (``Request.on_timeout``: ``mark_as_failure`` again), then kills the process. One
    execution ended, once: its errback is sent once (R4)."""
    pid = pool_process.pid
    acquire("job", ttl=30, task_id="t1", owner=pool_owner(pid), using=lease_db)
    request = accepted(broker, "t1", pid)
    try:
        raise TimeLimitExceeded(1.0)
    except TimeLimitExceeded:
        request.on_failure(ExceptionInfo())
    request.on_timeout(False, 1.0)
    pool_process.kill()
    pool_process.wait()
    wait_for(lambda: not reports_waiting(), "the reports")
    assert status(lease_db, "t1")[0] == states.FAILURE
    assert Lease.objects.using(lease_db).get(key="job").released_at is not None
    assert len(broker.sent("seams.errback")) == 1


def test_hard_time_limit__a_copy_of_the_job_delivered_after_its_failure_does_not_run(
    broker: Broker, lease_db: str, pool_process: subprocess.Popen[bytes]
) -> None:
    """The pool process ran past its hard time limit: the main process records the job's
    FAILURE and sends its errback. A copy of the message delivered after that (a busy
    retry sent while the process held the key, a redelivery) is a duplicate of the
    completed job: it does not run, nor turn the FAILURE into a SUCCESS after the errback
    went out (found by the chaos runner's invariant e)."""
    app = broker.app
    app.signature("seams.step", ("t",)).apply_async(
        task_id="t1", link_error=app.signature("seams.errback")
    )
    copy = broker.one("seams.step")
    pid = pool_process.pid
    acquire("job", ttl=30, task_id="t1", owner=pool_owner(pid), using=lease_db)
    request = accepted(broker, "t1", pid)
    request.on_timeout(False, 1.0)
    pool_process.kill()
    pool_process.wait()
    wait_for(lambda: not reports_waiting(), "the report")
    assert status(lease_db, "t1")[0] == states.FAILURE
    assert len(broker.sent("seams.errback")) == 1
    deliver(app, copy)
    assert [run for run in RUNS if run[0] == "seams.step"] == []
    assert status(lease_db, "t1")[0] == states.FAILURE
    assert broker.sent("seams.sink") == []
    # a retry the body asked for before its limit (retries + 1) is another delivery: it runs
    headers, body = copy
    deliver(app, ({**headers, "retries": headers["retries"] + 1}, body))
    assert [run[:2] for run in RUNS if run[0] == "seams.step"] == [("seams.step", "t")]


def test_hard_time_limit__a_copy_delivered_as_the_grant_is_released_is_a_duplicate(
    broker: Broker, lease_db: str, pool_process: subprocess.Popen[bytes]
) -> None:
    """A copy of the message is delivered the moment the main process's report releases
    the pool process's grant: the release comes with the job's FAILURE and the delivery
    marked ended, so the copy is a duplicate — released before the FAILURE was stored, the
    copy was granted and ran, and its SUCCESS stood after the errback went out (the chaos
    runner's invariant e)."""
    from celery_fenced import signals

    app = broker.app
    app.signature("seams.step", ("t",)).apply_async(
        task_id="t1", link_error=app.signature("seams.errback")
    )
    copy = broker.one("seams.step")
    key = copy[0]["fenced_lease_key"]
    pid = pool_process.pid
    acquire(key, ttl=30, task_id="t1", owner=pool_owner(pid), using=lease_db)
    copies: list[threading.Thread] = []

    def deliver_the_copy(sender: Any = None, forced: bool = False, **_: Any) -> None:
        if forced and not copies:  # in a thread of its own: it waits for the commit
            copies.append(threading.Thread(target=deliver_and_close, args=(app, copy)))
            copies[0].start()

    signals.lease_released.connect(deliver_the_copy, weak=False)
    try:
        request = accepted(broker, "t1", pid)
        request.on_timeout(False, 1.0)
        pool_process.kill()
        pool_process.wait()
        wait_for(lambda: not reports_waiting(), "the report")
    finally:
        signals.lease_released.disconnect(deliver_the_copy)
    assert copies, "the copy was not delivered at the release"
    copies[0].join(60)
    assert [run for run in RUNS if run[0] == "seams.step"] == []
    assert status(lease_db, "t1")[0] == states.FAILURE
    assert len(broker.sent("seams.errback")) == 1


def test_hard_time_limit__a_report_that_stops_before_its_outcome_leaves_the_job_to_run(
    broker: Broker, lease_db: str, pool_process: subprocess.Popen[bytes], monkeypatch: Any
) -> None:
    """The reporting main process stops (killed) after deciding to record the FAILURE and
    before writing it: the pool process's grant is still held and the delivery is not
    marked ended, so once the grant expires a copy of the message runs the job — marked
    ended with nothing written, every copy was a duplicate and the job never ended (the
    chaos runner's short form, a worker killed in between)."""
    from celery_fenced.backends import FencedDatabaseBackend

    app = broker.app
    app.signature("seams.step", ("t",)).apply_async(task_id="t1")
    copy = broker.one("seams.step")
    key = copy[0]["fenced_lease_key"]
    pid = pool_process.pid
    acquire(key, ttl=30, task_id="t1", owner=pool_owner(pid), using=lease_db)

    def stopped(*args: Any, **kwargs: Any) -> None:
        """The process stops here: nothing of the outcome is written, nothing after it."""

    monkeypatch.setattr(FencedDatabaseBackend, "_untokened", stopped)
    request = accepted(broker, "t1", pid)
    request.on_timeout(False, 1.0)
    pool_process.kill()
    pool_process.wait()
    wait_for(lambda: not reports_waiting(), "the report")
    monkeypatch.undo()
    lease = Lease.objects.using(lease_db).get(key=key)
    assert lease.released_at is None  # still the pool process's: a copy finds it held
    Lease.objects.using(lease_db).filter(pk=lease.pk).update(expires_at=F("acquired_at"))
    deliver(app, copy)  # the grant expired: the copy takes it over and runs the job
    assert [run[:2] for run in RUNS if run[0] == "seams.step"] == [("seams.step", "t")]
    assert status(lease_db, "t1")[0] == states.SUCCESS


def deliver_and_close(app: Any, message: Any) -> None:
    try:
        deliver(app, message)
    finally:
        connections.close_all()


def test_hard_time_limits_of_a_taken_over_process_and_its_taker__one_report_records(
    broker: Broker, lease_db: str, pool_process: subprocess.Popen[bytes]
) -> None:
    """A's pool process holds the job and stops; B's takes the expired grant over; both
    run past their hard time limits. B's report records the job's FAILURE and sends its
    errback; A's, made later (its worker was stopped too), changes nothing: A's grant was
    taken over by another execution of the job, whose outcome is the job's, even once it
    ended (found by the chaos runner's invariant e: the errback was sent twice)."""
    taker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        a, b = pool_process.pid, taker.pid
        acquire("job", ttl=30, task_id="t1", owner=pool_owner(a), using=lease_db)
        Lease.objects.using(lease_db).filter(key="job").update(expires_at=F("acquired_at"))
        acquire("job", ttl=30, task_id="t1", owner=pool_owner(b), using=lease_db)
        for pid in (b, a):  # B's report first, then the stale process's
            accepted(broker, "t1", pid).on_timeout(False, 1.0)
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda: not reports_waiting(), "the report")
            assert status(lease_db, "t1")[0] == states.FAILURE
    finally:
        taker.kill()
        taker.wait()
    assert len(broker.sent("seams.errback")) == 1
    assert Lease.objects.using(lease_db).get(key="job").token == 2


def test_warm_shutdown__waits_for_a_report_still_to_be_made(
    broker: Broker, lease_db: str, pool_process: subprocess.Popen[bytes], caplog: Any
) -> None:
    """A report waits for its pool process to exit; the worker shuts down warm (Celery's
    ``worker_shutdown``, sent once the pool has been stopped). The report is made before
    the shutdown goes on: a daemon thread dies with the process, and the outcome with it
    (the message is acknowledged, the grant would run out its ttl)."""
    import logging

    from celery import signals

    caplog.set_level(logging.INFO, logger="celery_fenced.exits")
    pid = pool_process.pid
    acquire("job", ttl=30, task_id="t1", owner=pool_owner(pid), using=lease_db)
    request = accepted(broker, "t1", pid)
    request.on_timeout(False, 1.0)
    assert reports_waiting()
    recorded: list[bool] = []

    def shutdown() -> None:
        try:
            signals.worker_shutdown.send(sender=None)
            recorded.append(
                TaskResult.objects.using(lease_db).filter(task_id="t1", status="FAILURE").exists()
            )
        finally:
            connections.close_all()

    stopping = threading.Thread(target=shutdown)
    stopping.start()
    wait_for(
        lambda: not stopping.is_alive() or "waiting for the reports" in caplog.text,
        "the shutdown to return or to wait for the report",
    )
    pool_process.kill()  # the pool stopped: its processes exit
    stopping.join(60)
    assert recorded == [True]


#: another start of a worker named ``w@seams`` (on another machine, or this one's previous
#: start): its execution of the job holds the grant, in a process whose pid a pool process
#: of this worker had; it prints its owner
OTHER_WORKER = """
import sys
from types import SimpleNamespace

import django

django.setup()
from celery_fenced import acquire, owners
from celery_fenced.execution import execution_owner

owner = execution_owner(SimpleNamespace(hostname="w@seams"))
acquire("job", ttl=60, task_id="t1", owner=owner, using=sys.argv[1])
print(owner)
"""


def test_report_of_a_pool_process__another_worker_start_with_its_pid_keeps_its_grant(
    broker: Broker, lease_db: str, child_env: dict[str, str]
) -> None:
    """Two workers of one node name (``-n w@seams`` on two machines started alike, or this
    worker and its previous start): the other's execution of the job holds the grant, in
    a process with the pid of this worker's pool process that ran the job and ended. This
    worker's main process reports that end (a hard time limit): the grant is not its
    process's, and stays; nothing is recorded while the other holds it."""
    other = subprocess.Popen(
        [sys.executable, "-c", OTHER_WORKER, lease_db],
        env=child_env,
        stdout=subprocess.PIPE,
        text=True,
    )
    owner = other.communicate(timeout=60)[0].strip()
    assert other.returncode == 0
    pid = other.pid  # exited: no live child of this process, the report is made at once
    assert owner.startswith("w@seams:")
    assert f":{pid}:" in owner
    request = accepted(broker, "t1", pid)
    request.on_timeout(False, 1.0)
    wait_for(lambda: not reports_waiting(), "the report")
    lease = Lease.objects.using(lease_db).get(key="job")
    assert (lease.owner, lease.token, lease.released_at) == (owner, 1, None)
    assert not TaskResult.objects.using(lease_db).filter(task_id="t1").exists()
    assert broker.sent("seams.errback") == []
    # the report named pid ``pid`` of this worker start; the other's owner has another boot id
    ended = state_of(request._context).process
    assert ended is not None
    assert ended.owner_prefix == owners.process_prefix("w@seams", pid)
    assert owner.split(":")[1] != owners.boot()


def test_hard_time_limit__grant_taken_over_after_the_report_decided__nothing_recorded(
    broker: Broker, lease_db: str, pool_process: subprocess.Popen[bytes], monkeypatch: Any
) -> None:
    """A's report decides to record the FAILURE (its pool process's grant expired, nobody
    had taken it over), and B's delivery takes that expired grant over before the outcome
    is written: A's report writes and sends nothing — B's execution owns the job's outcome
    (found by the chaos runner's invariant e: the errback was sent by both)."""
    from celery_fenced.backends import FencedDatabaseBackend

    decide = FencedDatabaseBackend._may_record_elsewhere
    a = pool_process.pid
    acquire("job", ttl=30, task_id="t1", owner=pool_owner(a), using=lease_db)
    Lease.objects.using(lease_db).filter(key="job").update(expires_at=F("acquired_at"))

    def then_taken_over(self: Any, task_id: str, state: str, request: Any) -> bool:
        may = decide(self, task_id, state, request)
        acquire("job", ttl=30, task_id="t1", owner=pool_owner(a + 1), using=lease_db)
        return may

    monkeypatch.setattr(FencedDatabaseBackend, "_may_record_elsewhere", then_taken_over)
    accepted(broker, "t1", a).on_timeout(False, 1.0)
    pool_process.kill()
    pool_process.wait()
    wait_for(lambda: not reports_waiting(), "the report")
    assert broker.sent("seams.errback") == []
    assert not TaskResult.objects.using(lease_db).filter(task_id="t1").exists()
    lease = Lease.objects.using(lease_db).get(key="job")
    assert (lease.token, lease.released_at) == (2, None)  # B's grant stands
