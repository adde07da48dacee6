"""How a fenced task behaves when called in the ways Celery allows besides a worker."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
from celery import Celery, Task, current_task
from celery.exceptions import Retry
from django.db import connections
from django_celery_results.models import TaskResult

from celery_fenced import FencedTask, LeaseBusy, acquire
from celery_fenced.execution import FencedExecution
from celery_fenced.models import Lease
from celery_fenced.renewal import renewer
from celery_fenced.request_state import state_of
from tests.conftest import DATABASE_ALIASES
from tests.integration.test_seams import expire
from tests.tracing import fenced_app, trace

db = pytest.mark.django_db(transaction=True, databases=DATABASE_ALIASES)


def define(**options: Any) -> Any:
    app = Celery("task-calls", set_as_current=False, broker="memory://")
    app.conf.task_default_queue = "task-calls"

    def build(report_id: int) -> int:
        from celery_fenced import current_lease

        lease = current_lease()
        assert lease is not None
        return lease.token

    app.task(name="calls.build", base=FencedTask, shared=False, **options)(build)
    return app.tasks["calls.build"]


@pytest.mark.core
@db
def test_direct_call__takes_and_releases_the_lease(lease_db: str) -> None:
    task = define(lease_key="report:{report_id}", lease_ttl=30)
    assert task(7) == 1
    lease = Lease.objects.using(lease_db).get(key="report:7")
    assert lease.released_at is not None
    assert not [held for held in renewer().held() if held.key == "report:7"]
    assert task(7) == 2  # not busy: the first call let go


@pytest.mark.core
@pytest.mark.parametrize("how", ["direct", "apply"])
@db
def test_body__sees_its_task_id_key_and_token_outside_a_worker(lease_db: str, how: str) -> None:
    """Celery before 5.5 gave a body run outside a worker a bare request of its own."""
    app = Celery("task-calls-request", set_as_current=False, broker="memory://")

    @app.task(bind=True, name="calls.request", base=FencedTask, shared=False, lease_key="r:{n}")
    def read(self: Any, n: int) -> list[Any]:
        request = self.request
        return [request.id, request.lease_key, request.fencing_token, self.lease.key]

    if how == "direct":
        assert read(3) == [None, "r:3", 1, "r:3"]
    else:
        assert read.apply((3,), task_id="t-3").get() == ["t-3", "r:3", 1, "r:3"]
    assert Lease.objects.using(lease_db).get(key="r:3").released_at is not None


@db
def test_direct_call__releases_when_the_body_raises(lease_db: str) -> None:
    task = define(lease_key=lambda args, kwargs: "report:any", lease_ttl=30)
    with pytest.raises(TypeError):
        task(7, "extra argument")  # granted, then the body cannot take these arguments
    assert Lease.objects.using(lease_db).get(key="report:any").token == 1
    assert not Lease.objects.using(lease_db).filter(released_at__isnull=True).exists()


@pytest.mark.core
@db
def test_busy_retry__not_limited_by_the_task_max_retries(lease_db: str) -> None:
    """Waiting for the key is not failing: retry 10 of a task allowed 3 is still sent."""
    task = define(lease_key="report:{report_id}", lease_ttl=30, max_retries=3)
    holder = acquire("report:7", ttl=30, using=lease_db)
    task.push_request(id="busy-task", args=(7,), kwargs={}, retries=10, called_directly=False)
    try:
        with pytest.raises(Retry) as retried:
            task(7)
    finally:
        task.pop_request()
        holder.release()
    assert isinstance(retried.value.exc, LeaseBusy)
    assert 0 < float(retried.value.when) <= 30  # after the holder's remaining time
    assert "override_max_retries" not in task.__dict__  # the task's own limit is untouched
    assert task.max_retries == 3


@db
def test_busy_retry__eager_keeps_the_task_limit(lease_db: str) -> None:
    """An eager retry runs at once, recursively: it must end (with LeaseBusy)."""
    task = define(lease_key="report:{report_id}", lease_ttl=30, max_retries=2)
    holder = acquire("report:7", ttl=30, using=lease_db)
    try:
        outcome = task.apply(args=(7,))
    finally:
        holder.release()
    assert outcome.failed()
    assert isinstance(outcome.result, LeaseBusy)


@db
def test_direct_call__threads_each_hold_and_release_their_own_lease(lease_db: str) -> None:
    """Celery's default request is one per task object: each direct call needs its own."""
    app = Celery("task-calls-threads", set_as_current=False, broker="memory://")
    both_inside = threading.Barrier(2, timeout=30)
    seen: dict[int, tuple[Any, ...]] = {}

    @app.task(
        bind=True,
        name="calls.bound",
        base=FencedTask,
        shared=False,
        lease_key="report:{report_id}",
    )
    def bound(self: Any, report_id: int) -> None:
        both_inside.wait()  # both calls have taken their lease before either ends
        seen[report_id] = (self.request.lease_key, self.request.fencing_token, self.lease.key)
        both_inside.wait()

    def call(report_id: int) -> None:
        try:
            bound(report_id)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=call, args=(n,)) for n in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
        assert not thread.is_alive()
    assert seen == {1: ("report:1", 1, "report:1"), 2: ("report:2", 1, "report:2")}
    assert not Lease.objects.using(lease_db).filter(released_at__isnull=True).exists()
    assert not [held for held in renewer().held() if held.key.startswith("report:")]
    assert state_of(bound._default_request).lease is None


@db
def test_traced_body__runs_under_the_request_the_tracer_pushed(lease_db: str) -> None:
    """Through Celery's tracer, as in a worker's pool process, the body runs as Celery
    runs a task with no ``__call__`` of its own: under the tracer's request (no copy of
    it pushed around the body), which carries the grant's token and key."""
    app = fenced_app("calls-traced")
    seen: list[tuple[Any, ...]] = []

    @app.task(name="calls.traced", bind=True, base=FencedTask, shared=False, lease_key="t:{n}")
    def traced(self: Any, n: int) -> int:
        request = self.request
        seen.append((len(self.request_stack.stack), request.id, request.fencing_token))
        seen.append((request.lease_key, list(request.args), current_task.name))
        return n

    retval, info, *_ = trace(traced, "traced-1", 7)
    assert (retval, info) == (7, None)
    lease = Lease.objects.using(lease_db).get(key="t:7")
    assert seen == [(1, "traced-1", lease.token), ("t:7", [7], "calls.traced")]


class _Timed(Task):  # type: ignore[type-arg]
    """A base class of the application's with a ``__call__`` of its own."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        calls_seen.append(("base __call__", len(self.request_stack.stack)))  # type: ignore[attr-defined]
        return super().__call__(*args, **kwargs)


calls_seen: list[tuple[str, int]] = []


@db
def test_traced_body__a_base_class_call_of_its_own_still_runs(lease_db: str) -> None:
    """A task fenced through the settings keeps its class's own ``__call__``: the body
    runs through it, under the grant, as it did unfenced."""
    calls_seen.clear()
    app = fenced_app("calls-own-call")
    app.conf.fenced_tasks = {"calls.own_call": {"ttl": 30, "key": "own:{n}"}}

    @app.task(name="calls.own_call", bind=True, base=_Timed, shared=False)
    def own_call(self: Any, n: int) -> int:
        calls_seen.append(("body", self.request.fencing_token))
        return n

    assert isinstance(app.tasks["calls.own_call"], FencedExecution)  # fenced at finalize
    assert trace(own_call, "own-1", 3)[:2] == (3, None)
    token = Lease.objects.using(lease_db).get(key="own:3").token
    # Celery's Task.__call__ under the base's pushes the body's own request copy
    assert calls_seen == [("base __call__", 1), ("body", token)]


@db
def test_body_calling_its_own_task__each_call_holds_and_releases_its_own_grant(
    lease_db: str,
) -> None:
    """A body that calls its own task directly (a recursion on other arguments): the call
    runs under a grant of its own key, released at its end, and the running execution
    keeps its own request and grant, released with its outcome."""
    app = fenced_app("calls-recursion")
    seen: list[tuple[int, str, str | None]] = []

    @app.task(name="calls.down", bind=True, base=FencedTask, shared=False, lease_key="d:{n}")
    def down(self: Any, n: int) -> int:
        if n > 0:
            down(n - 1)
        seen.append((n, self.request.lease_key, self.request.id))
        return n

    assert trace(down, "down-2", 2)[:2] == (2, None)
    assert seen == [(0, "d:0", None), (1, "d:1", None), (2, "d:2", "down-2")]
    leases = Lease.objects.using(lease_db).order_by("key")
    assert [(x.key, x.release_state) for x in leases] == [
        ("d:0", ""),
        ("d:1", ""),
        ("d:2", "SUCCESS"),
    ]
    assert all(x.released_at is not None for x in leases)
    assert not [x for x in renewer().held() if x.key.startswith("d:")]
    stored = TaskResult.objects.using(lease_db).get(task_id="down-2")
    assert json.loads(stored.meta)["lease_key"] == "d:2"


@db
def test_body_calling_its_own_task__its_stale_outcome_still_refused(lease_db: str) -> None:
    """The execution that called its own task directly is then taken over (its grant
    expired, another holder took the key): its success is refused, as any stale
    execution's, not proven under the call's grant."""
    app = fenced_app("calls-recursion-stale")

    @app.task(name="calls.stale", bind=True, base=FencedTask, shared=False, lease_key="s:{n}")
    def stale(self: Any, n: int) -> int:
        if n > 0:
            stale(n - 1)
            expire(lease_db, Lease.objects.using(lease_db).get(key="s:1"))
            acquire("s:1", ttl=30, task_id="other", using=lease_db)  # token 2 takes over
        return n

    trace(stale, "stale-1", 1)
    stored = TaskResult.objects.using(lease_db).get(task_id="stale-1")
    assert (stored.status, json.loads(stored.meta)["stale_fencing_token"]) == ("FAILURE", 1)
    assert Lease.objects.using(lease_db).get(key="s:0").released_at is not None
    assert not [x for x in renewer().held() if x.key.startswith("s:")]
