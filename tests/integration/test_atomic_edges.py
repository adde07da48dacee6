"""Atomic task bodies at their edges, through Celery's own tracer.

What a body can do besides returning or raising — replace itself, set a state of its
own, register ``on_commit`` hooks, swallow a database error, return what cannot be
encoded — and what a delivery after it finds: each either commits with the proof of its
token or not at all, and leaves the connection as it found it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from celery import states
from django.db import DatabaseError, connections, transaction
from django.db.models import F, Value
from django.db.models.functions import Concat

from celery_fenced.models import Lease, LeaseEvent
from testproject.demo.models import Report
from tests.conftest import WITH_MARIADB
from tests.integration.test_atomic import broker, make_app, report  # noqa: F401
from tests.integration.test_seams import (
    GATES,
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


def _write(name: str) -> None:
    thread = threading.current_thread().name
    Report.objects.filter(name=name).update(body=Concat(F("body"), Value(f"{thread};")))


@pytest.fixture
def body(broker: Broker) -> Iterator[dict[str, Any]]:  # noqa: F811
    """``body["run"]``: what ``atomic.charge`` runs instead of its own body."""
    task = broker.app.tasks["atomic.charge"]
    original = task.run
    holder: dict[str, Any] = {}

    def run(name: str) -> Any:
        thread = threading.current_thread().name
        RUNS.append(("atomic.charge", name, thread))
        gate = GATES.get(thread)
        if gate is not None:
            assert gate.wait(60)
        return holder["run"](task, name)

    task.run = run
    yield holder
    task.run = original


def _clean(alias: str) -> None:
    connection = connections[alias]
    assert not connection.in_atomic_block
    assert not connection.needs_rollback
    assert transaction.get_autocommit(using=alias)


def test_atomic_replace__a_redelivered_copy_does_not_replace_it_again(
    broker: Broker,  # noqa: F811
    body: dict[str, Any],
    lease_db: str,
) -> None:
    """The current execution writes and replaces itself: the replacement is sent, and the
    job is done — its lease released as replaced, a copy of its message a duplicate."""

    def run(task: Any, name: str) -> Any:
        _write(name)
        return task.replace(broker.app.signature("atomic.notify", (name, "replacement")))

    body["run"] = run
    broker.app.send_task("atomic.charge", args=["inv-1"], task_id="replaced-1")
    message = broker.one("atomic.charge")
    deliver(broker.app, message)
    _clean(lease_db)
    assert len(broker.sent("atomic.notify")) == 1
    lease = Lease.objects.using(lease_db).get(task_id="replaced-1")
    assert lease.released_at is not None
    deliver(broker.app, message)  # redelivered
    assert len([run for run in RUNS if run[0] == "atomic.charge"]) == 1
    assert len(broker.sent("atomic.notify")) == 1


@pytest.mark.parametrize("state", [states.SUCCESS, states.FAILURE])
def test_atomic_update_state_ready__refused_and_nothing_commits(
    broker: Broker,  # noqa: F811
    body: dict[str, Any],
    lease_db: str,
    state: str,
) -> None:
    """An execution sets a ready state mid-body (``update_state``), then writes and
    returns: the call raises (a ready state would end the body's transaction early), so
    nothing of a stale execution or of the current one commits, before or after it."""

    def run(task: Any, name: str) -> Any:
        _write(name)
        task.update_state(state=state, meta={"by": threading.current_thread().name})
        _write(name)
        return "done"

    body["run"] = run
    result = broker.app.send_task("atomic.charge", args=["inv-1"])
    message = broker.one("atomic.charge")
    a = Execution(broker.app, message, "A")
    expire(lease_db, granted(lease_db, result.id, 1))
    b = Execution(broker.app, message, "B")
    granted(lease_db, result.id, 2)
    b.finish()
    a.finish()
    assert report(lease_db)[0] == ""
    assert status(lease_db, result.id)[0] == states.FAILURE


def test_atomic_current_update_state_success__later_writes_are_in_its_transaction(
    broker: Broker,  # noqa: F811
    body: dict[str, Any],
    lease_db: str,
) -> None:
    """The current execution sets SUCCESS itself mid-body (Celery's "update_state, then
    raise Ignore" idiom, without the Ignore), then writes and raises: the body raised, so
    none of its writes commit."""

    def run(task: Any, name: str) -> Any:
        _write(name)
        task.update_state(state=states.SUCCESS, meta={})
        _write(name)
        raise ValueError("after the state")

    body["run"] = run
    broker.app.send_task("atomic.charge", args=["inv-1"])
    deliver(broker.app, broker.one("atomic.charge"))
    _clean(lease_db)
    assert report(lease_db)[0] == ""


def test_atomic_stale_on_commit_hook__never_runs(
    broker: Broker,  # noqa: F811
    body: dict[str, Any],
    lease_db: str,
) -> None:
    hooks: list[str] = []

    def run(task: Any, name: str) -> Any:
        thread = threading.current_thread().name
        _write(name)
        transaction.on_commit(lambda: hooks.append(thread), using=lease_db)
        return "done"

    body["run"] = run
    result = broker.app.send_task("atomic.charge", args=["inv-1"])
    message = broker.one("atomic.charge")
    a = Execution(broker.app, message, "A")
    expire(lease_db, granted(lease_db, result.id, 1))
    b = Execution(broker.app, message, "B")
    granted(lease_db, result.id, 2)
    b.finish()
    a.finish()
    assert hooks == ["B"]
    assert report(lease_db)[0] == "B;"


def test_atomic_on_commit_hook_raises__the_success_stands_and_the_lease_is_released(
    broker: Broker,  # noqa: F811
    body: dict[str, Any],
    lease_db: str,
) -> None:
    """A hook of the body's that raises after the commit: the job's writes, its child
    and its result committed; the child is still sent, the grant let go."""

    def run(task: Any, name: str) -> Any:
        _write(name)

        def broken() -> None:
            raise RuntimeError("hook failed")

        transaction.on_commit(broken, using=lease_db)
        broker.app.send_task("atomic.notify", args=[name, "child"])
        return "done"

    body["run"] = run
    result = broker.app.send_task("atomic.charge", args=["inv-1"])
    with pytest.warns(RuntimeWarning, match="hook failed"):
        deliver(broker.app, broker.one("atomic.charge"))
    _clean(lease_db)
    assert report(lease_db)[0] == "MainThread;"
    assert status(lease_db, result.id)[0] == states.SUCCESS
    assert Lease.objects.using(lease_db).get(task_id=result.id).released_at is not None
    assert len(broker.sent("atomic.notify")) == 1


def test_atomic_swallowed_database_error__failure_recorded_connection_clean(
    broker: Broker,  # noqa: F811
    body: dict[str, Any],
    lease_db: str,
) -> None:
    """A body that catches a failed statement without a savepoint of its own: its
    transaction is broken; the job fails, its grant is released, and the connection is
    usable by the next task."""

    def run(task: Any, name: str) -> Any:
        _write(name)
        with contextlib.suppress(DatabaseError):
            Report.objects.create(name=name)  # a duplicate name, no savepoint of its own
        return "done"

    body["run"] = run
    result = broker.app.send_task("atomic.charge", args=["inv-1"])
    deliver(broker.app, broker.one("atomic.charge"))
    _clean(lease_db)
    assert report(lease_db)[0] == ""
    assert status(lease_db, result.id)[0] == states.FAILURE
    assert Lease.objects.using(lease_db).get(task_id=result.id).released_at is not None


def test_atomic_result_not_encodable__failure_recorded_nothing_commits(
    broker: Broker,  # noqa: F811
    body: dict[str, Any],
    lease_db: str,
) -> None:
    def run(task: Any, name: str) -> Any:
        _write(name)
        broker.app.send_task("atomic.notify", args=[name, "child"])
        return object()  # JSON cannot encode it

    body["run"] = run
    result = broker.app.send_task("atomic.charge", args=["inv-1"])
    deliver(broker.app, broker.one("atomic.charge"))
    _clean(lease_db)
    assert report(lease_db)[0] == ""
    assert broker.sent("atomic.notify") == []
    assert status(lease_db, result.id)[0] == states.FAILURE
    assert Lease.objects.using(lease_db).get(task_id=result.id).released_at is not None


def test_atomic_success_redelivered__does_not_run_again(
    broker: Broker,  # noqa: F811
    lease_db: str,
) -> None:
    """acks_late: the commit of the body, its result and its release went through but the
    ack was lost; the broker delivers the message again: a duplicate, not a second run."""
    broker.app.send_task("atomic.charge", args=["inv-1"])
    message = broker.one("atomic.charge")
    deliver(broker.app, message)
    deliver(broker.app, message)
    assert report(lease_db) == ("MainThread;", "MainThread")
    assert len([run for run in RUNS if run[0] == "atomic.charge"]) == 1
    assert LeaseEvent.objects.using(lease_db).filter(kind="duplicate").count() == 1


@pytest.mark.parametrize("backend", ["cache+memory://", "django-db"])
def test_atomic_without_the_fenced_backend__commits_and_leaves_no_transaction(
    lease_db: str, backend: str
) -> None:
    from celery_fenced import hooks

    app = make_app()
    app.conf.result_backend = backend
    hooks.fence_in_every_process()
    Report.objects.using(lease_db).create(name="inv-1")
    from tests.integration.test_seams import Broker as Recorder

    recorded = Recorder(app)
    from celery import signals

    signals.before_task_publish.connect(recorded.record, weak=False)
    try:
        app.send_task("atomic.charge", args=["inv-1"])
        deliver(app, recorded.one("atomic.charge"))
        _clean(lease_db)
        assert report(lease_db) == ("MainThread;", "MainThread")
        assert len(recorded.sent("atomic.notify")) == 1
    finally:
        signals.before_task_publish.disconnect(recorded.record)


def test_atomic_close_old_connections_in_body__fails_cleanly(
    broker: Broker,  # noqa: F811
    body: dict[str, Any],
    lease_db: str,
) -> None:
    """``close_old_connections()`` inside the body closes the connection holding its
    transaction: the job fails, nothing commits, the next task has a working connection."""
    from django.db import close_old_connections

    def run(task: Any, name: str) -> Any:
        _write(name)
        close_old_connections()
        return "done"

    body["run"] = run
    result = broker.app.send_task("atomic.charge", args=["inv-1"])
    deliver(broker.app, broker.one("atomic.charge"))
    _clean(lease_db)
    assert report(lease_db)[0] == ""
    assert status(lease_db, result.id)[0] == states.FAILURE


@pytest.mark.parametrize("how", ["link", "retry", "chain"])
def test_atomic_stale__sends_no_callback_retry_or_next_step(
    broker: Broker,  # noqa: F811
    body: dict[str, Any],
    lease_db: str,
    how: str,
) -> None:
    """A stale execution (A, held past its grant while B ran to its end) that retries or
    whose success would drive a callback or a chain's next step: none of it is sent."""

    def run(task: Any, name: str) -> Any:
        _write(name)
        if how == "retry" and threading.current_thread().name == "A":
            raise task.retry(countdown=60)
        return threading.current_thread().name

    body["run"] = run
    notify = broker.app.signature("atomic.notify", ("inv-1",))
    charge = broker.app.signature("atomic.charge", ("inv-1",))
    if how == "chain":
        (charge | notify).apply_async()
    else:
        charge.apply_async(link=notify if how == "link" else None)
    message = broker.one("atomic.charge")
    task_id = message[0]["id"]
    a = Execution(broker.app, message, "A")
    expire(lease_db, granted(lease_db, task_id, 1))
    b = Execution(broker.app, message, "B")
    granted(lease_db, task_id, 2)
    b.finish()
    a.finish()
    assert report(lease_db)[0] == "B;"
    assert len(broker.sent("atomic.charge")) == 1  # no retry of A's
    sent = [body_[0] for _, body_ in broker.sent("atomic.notify")]
    assert sent == ([] if how == "retry" else [["B", "inv-1"]])
    assert status(lease_db, task_id) == (states.SUCCESS, '"B"')
