"""The testing helpers (celery_fenced.testing) on SQLite and PostgreSQL: a body paused
while another execution takes its key over, a takeover right after the grant, a lost
lease, the captured events and the assertions."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery
from django.db import connections

from celery_fenced import FencedTask, LeaseLost, StaleToken, acquire, fenced_update
from celery_fenced.testing import Fenced, assert_fenced_out
from testproject.demo.models import Report
from tests.conftest import DATABASE_ALIASES
from tests.tracing import fenced_app, trace

db = pytest.mark.django_db(transaction=True, databases=DATABASE_ALIASES)


class Gate:
    """Pauses a body until the test opens it."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self.opened = threading.Event()

    def pause(self) -> None:
        self.reached.set()
        assert self.opened.wait(30), "the test never opened the gate"


@pytest.fixture
def app() -> Celery:
    return fenced_app("testing-helpers")


@pytest.fixture
def rebuild(app: Celery) -> Any:
    """A fenced task writing its report with ``fenced_update``; ``gate.pause()`` first."""
    gates: dict[int, Gate] = {}

    @app.task(
        bind=True,
        base=FencedTask,
        name="helpers.rebuild",
        shared=False,
        lease_key="report:{report_id}",
        lease_ttl=30,
    )
    def rebuild(self: Any, report_id: int) -> int:
        if report_id in gates:
            gates[report_id].pause()
        token: int = self.request.fencing_token
        fenced_update(Report.objects.filter(pk=report_id), token=token, body=f"token {token}")
        return token

    rebuild.gates = gates
    return rebuild


@pytest.fixture
def in_thread() -> Iterator[Callable[[Callable[[], Any]], threading.Thread]]:
    """Run a call in a thread of its own (its connections closed at its end); joined."""
    threads: list[threading.Thread] = []

    def start(call: Callable[[], Any]) -> threading.Thread:
        def run() -> None:
            try:
                call()
            finally:
                connections.close_all()

        thread = threading.Thread(target=run, daemon=True)
        threads.append(thread)
        thread.start()
        return thread

    yield start
    for thread in threads:
        thread.join(timeout=30)


def report(lease_db: str) -> Report:
    return Report.objects.create(name="r")


@pytest.mark.parametrize("run", ["worker", "apply"])
@db
def test_take_over__refuses_the_paused_body_and_fences_its_result_out(
    lease_db: str,
    fenced: Fenced,
    app: Celery,
    rebuild: Any,
    in_thread: Callable[[Callable[[], Any]], threading.Thread],
    run: str,
) -> None:
    """A body paused at a gate; meanwhile another execution takes its key over."""
    row = report(lease_db)
    key, gate = f"report:{row.pk}", Gate()
    rebuild.gates[row.pk] = gate
    outcome: dict[str, Any] = {}

    def execute() -> None:
        if run == "worker":  # Celery's tracer, the result stored by the fenced backend
            outcome["info"] = trace(rebuild, "paused-task", row.pk)[1]
        else:
            outcome["result"] = rebuild.apply(args=[row.pk], task_id="paused-task")

    thread = in_thread(execute)
    assert gate.reached.wait(30)
    fenced.assert_lease(key, token=1, state="held")

    taker = fenced.take_over(key)  # another worker reclaims the key: token 2

    assert taker.token == 2
    fenced.assert_lease(key, token=2, state="held")
    gate.opened.set()
    thread.join(timeout=30)
    assert not thread.is_alive()

    row.refresh_from_db()
    assert (row.body, row.fencing_token) == ("", 0)  # the stale write was refused
    result = outcome["result"] if run == "apply" else app.AsyncResult("paused-task")
    fenced.assert_fenced_out(result)
    if run == "worker":
        stored = app.AsyncResult("paused-task")
        assert stored.state == "FAILURE"
        assert (stored.result.token, stored.result.current) == (1, 2)
    refused = fenced.events(key, kind="stale_write_rejected")
    assert [(event.token, event.detail["current"]) for event in refused][:1] == [(1, 2)]
    assert "reclaimed" in fenced.kinds(key)
    # the taker, newer, writes
    fenced_update(Report.objects.filter(pk=row.pk), token=taker.token, body="taker")
    row.refresh_from_db()
    assert (row.body, row.fencing_token) == ("taker", 2)


@db
def test_take_over__of_the_same_task_id_stores_nothing_for_the_stale_one(
    lease_db: str,
    fenced: Fenced,
    app: Celery,
    rebuild: Any,
    in_thread: Callable[[Callable[[], Any]], threading.Thread],
) -> None:
    """A redelivery took over: the newer execution owns the task's result."""
    row = report(lease_db)
    gate = Gate()
    rebuild.gates[row.pk] = gate
    thread = in_thread(lambda: trace(rebuild, "redelivered", row.pk))
    assert gate.reached.wait(30)

    fenced.take_over(f"report:{row.pk}", task_id="redelivered")
    gate.opened.set()
    thread.join(timeout=30)

    assert app.AsyncResult("redelivered").state == "PENDING"
    fenced.assert_fenced_out(app.AsyncResult("redelivered"))


@pytest.mark.parametrize("run", ["worker", "apply"])
@db
def test_taken_over_after_grant__the_body_runs_stale(
    lease_db: str, fenced: Fenced, app: Celery, rebuild: Any, run: str
) -> None:
    row = report(lease_db)
    key = f"report:{row.pk}"

    with fenced.taken_over_after_grant(key) as takeover:
        if run == "worker":
            trace(rebuild, "stale-from-start", row.pk)
            result: Any = app.AsyncResult("stale-from-start")
        else:
            result = rebuild.apply(args=[row.pk], task_id="stale-from-start")

    assert takeover.lease is not None
    assert takeover.lease.token == 2
    fenced.assert_fenced_out(result)
    row.refresh_from_db()
    assert row.body == ""
    assert fenced.kinds(key)[:2] == ["acquired", "reclaimed"]


@db
def test_taken_over_after_grant__fails_when_no_grant_of_the_key_is_issued(
    lease_db: str, fenced: Fenced, rebuild: Any
) -> None:
    row = report(lease_db)
    with (
        pytest.raises(AssertionError, match="no grant of 'report:typo'"),
        fenced.taken_over_after_grant("report:typo"),
    ):
        rebuild.apply(args=[row.pk])


@db
def test_lose__the_body_learns_it_and_the_task_retries_under_a_new_grant(
    lease_db: str, fenced: Fenced, app: Celery
) -> None:
    seen: list[tuple[int, str]] = []

    @app.task(bind=True, base=FencedTask, name="helpers.steps", shared=False, lease_key="steps")
    def steps(self: Any) -> int:
        token: int = self.request.fencing_token
        if token == 1:
            assert fenced.lose("steps") == 1
        try:
            self.lease.check()
        except LeaseLost as lost:
            seen.append((token, lost.reason))
            raise
        seen.append((token, "held"))
        return token

    assert steps.apply().get() == 2  # an eager retry at once, under the next grant
    assert [token for token, _ in seen] == [1, 2]
    assert "renewal refused" in seen[0][1]
    assert fenced.kinds("steps") == ["acquired", "lost", "reclaimed", "released"]
    fenced.assert_lease("steps", token=2, state="released")


@db
def test_lose__a_grant_taken_with_acquire_learns_it_at_its_guard(
    lease_db: str, fenced: Fenced
) -> None:
    lease = acquire("plain", ttl=30)
    assert fenced.lose("plain") == lease.token
    fenced.assert_lease("plain", token=1, state="expired")
    with pytest.raises(StaleToken), lease.guard():
        pass
    assert fenced.lose("nothing-held") is None


@db
def test_assert_fenced_out__fails_for_a_result_that_stands(
    lease_db: str, fenced: Fenced, app: Celery, rebuild: Any
) -> None:
    row = report(lease_db)
    trace(rebuild, "stands", row.pk)
    assert app.AsyncResult("stands").get() == 1
    with pytest.raises(AssertionError, match="no write of it was refused"):
        assert_fenced_out(app.AsyncResult("stands"))


@db
def test_assert_lease__names_what_differs(lease_db: str, fenced: Fenced) -> None:
    acquire("k", ttl=30)
    with pytest.raises(AssertionError, match=r"token 1 \(held\), expected 2"):
        fenced.assert_lease("k", token=2)
    with pytest.raises(AssertionError, match=r"is held .* expected released"):
        fenced.assert_lease("k", state="released")
    with pytest.raises(AssertionError, match="never granted"):
        fenced.assert_lease("other")
    with pytest.raises(ValueError, match="state must be one of"):
        fenced.assert_lease("k", state="gone")


@db
def test_fenced__releases_its_takers_and_stops_capturing(lease_db: str) -> None:
    helper = Fenced()
    helper.start()
    taker = helper.take_over("k")
    helper.stop()
    assert taker.released
    acquire("k", ttl=30)
    assert helper.kinds() == ["acquired", "released"]
