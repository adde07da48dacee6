"""Waiting for a job this thread's transaction still holds back raises at once.

The outbox sends a job published inside a transaction on the lease database when that
transaction commits; ``.get()`` (``wait``, ``collect``, a group's ``join``) before then,
in the same thread, raises :class:`UncommittedJob` instead of waiting for its timeout.
Jobs are published into an in-memory broker and delivered through Celery's tracer
(``test_seams``), on SQLite and PostgreSQL.
"""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
from celery import Celery, chain, chord, group
from celery.exceptions import TimeoutError as CeleryTimeout
from django.db import connections, transaction
from django.test import Client

from celery_fenced import UncommittedJob, results
from celery_fenced.models import PendingJob
from tests.conftest import WITH_MARIADB
from tests.integration.test_outbox import rolled_back
from tests.integration.test_seams import Broker, deliver

pytestmark = [
    pytest.mark.django_db(transaction=True, databases=WITH_MARIADB),
    pytest.mark.timeout(120),
]

#: how each way of waiting for one job waits
WAITS: dict[str, Callable[[Any], Any]] = {
    "get": lambda result: result.get(timeout=10),
    "wait": lambda result: result.wait(timeout=10),
    "collect": lambda result: [value for _, value in result.collect(timeout=10)],
}
#: how each way of waiting for a group waits
JOINS: dict[str, Callable[[Any], Any]] = {
    "get": lambda result: result.get(timeout=10),
    "join": lambda result: result.join(timeout=10),
    "join_native": lambda result: result.join_native(timeout=10),
}


def refused(wait: Callable[[], Any]) -> UncommittedJob:
    """The :class:`UncommittedJob` that ``wait()`` raises, at once (not after its 10 s)."""
    started = time.monotonic()
    with pytest.raises(UncommittedJob) as raised:
        wait()
    assert time.monotonic() - started < 5
    return raised.value


def step(broker: Broker) -> Any:
    return broker.app.tasks["seams.step"]


@pytest.mark.parametrize("how", list(WAITS))
def test_wait__inside_the_publishing_transaction__raises_at_once_naming_the_job(
    broker: Broker, lease_db: str, how: str
) -> None:
    with transaction.atomic(using=lease_db):
        result = step(broker).delay("x")
        error = refused(lambda: WAITS[how](result))
        assert (error.task_id, error.alias, error.task_name) == (result.id, lease_db, "seams.step")
        assert not error.rolled_back
        for named in (result.id, "seams.step", repr(lease_db), "transaction.on_commit"):
            assert named in str(error)
        assert broker.sent("seams.step") == []
    broker.one("seams.step")  # the refused wait changed nothing: sent on the commit


def test_wait__any_handle_of_the_job_in_that_thread__raises(broker: Broker, lease_db: str) -> None:
    with transaction.atomic(using=lease_db):
        result = step(broker).delay("x")
        for handle in (broker.app.AsyncResult(result.id), step(broker).AsyncResult(result.id)):
            assert refused(partial(handle.get, timeout=10)).task_id == result.id


@pytest.mark.parametrize("how", list(JOINS))
def test_group__a_member_not_sent__raises_before_waiting_for_any(
    broker: Broker, lease_db: str, how: str
) -> None:
    """A plain member (sent at once, no worker to run it) comes first: the group does not
    wait for it before finding the fenced member the commit holds back."""
    sink, fenced = broker.app.tasks["seams.sink"], step(broker)
    with transaction.atomic(using=lease_db):
        result = group(sink.s(1), fenced.s("g")).apply_async()
        plain, held = result.results
        error = refused(lambda: JOINS[how](result))
    assert (error.task_id, error.task_name) == (held.id, "seams.step")
    assert plain.id != held.id


@pytest.mark.parametrize("how", ["join", "join_native"])
def test_result_set__a_member_not_sent__raises(broker: Broker, lease_db: str, how: str) -> None:
    with transaction.atomic(using=lease_db):
        first, second = step(broker).delay("a"), step(broker).delay("b")
        for members in (broker.app.ResultSet([first, second]), broker.app.ResultSet([second])):
            assert refused(partial(JOINS[how], members)).task_id in (first.id, second.id)


def test_chain__its_first_step_not_sent__raises_naming_it(broker: Broker, lease_db: str) -> None:
    with transaction.atomic(using=lease_db):
        result = chain(step(broker).s("a"), step(broker).s("b")).apply_async()
        first = result.parent
        assert refused(lambda: result.get(timeout=10)).task_id == first.id


def test_chord__a_header_member_not_sent__raises_naming_it(broker: Broker, lease_db: str) -> None:
    sink = broker.app.tasks["seams.sink"]
    with transaction.atomic(using=lease_db):
        result = chord([step(broker).s("h")], sink.s()).apply_async()
        (member,) = result.parent.results
        assert refused(partial(result.get, timeout=10)).task_id == member.id


@pytest.mark.parametrize("how", list(WAITS))
def test_wait__after_the_commit__waits_as_celery_does(
    broker: Broker, lease_db: str, how: str
) -> None:
    with transaction.atomic(using=lease_db):
        result = step(broker).delay("c")
    delivery = threading.Thread(target=deliver, args=(broker.app, broker.one("seams.step")))
    delivery.start()  # while the caller waits
    try:
        assert WAITS[how](result) in ("c@1", ["c@1"])
    finally:
        delivery.join()


def test_wait__in_an_on_commit_callback__gets_the_result(broker: Broker, lease_db: str) -> None:
    """What the error advises: wait once the transaction has committed (the job's sending
    was registered first, so it is sent before the caller's callback runs)."""
    waited: list[Any] = []
    with transaction.atomic(using=lease_db):
        result = step(broker).delay("o")

        def wait_for_it() -> None:
            deliver(broker.app, broker.one("seams.step"))  # the worker, at once
            waited.append(result.get(timeout=10))

        transaction.on_commit(wait_for_it, using=lease_db)
    assert waited == ["o@1"]


def test_wait__after_a_rollback__raises_the_job_is_never_sent(
    broker: Broker, lease_db: str
) -> None:
    published: list[Any] = []
    rolled_back(lease_db, lambda: published.append(step(broker).delay("r")))
    (result,) = published
    error = refused(lambda: result.get(timeout=10))
    assert (error.task_id, error.alias, error.rolled_back) == (result.id, lease_db, True)
    assert "will never be sent" in str(error)
    assert broker.sent("seams.step") == []


def test_wait__after_a_savepoint_rollback__raises_the_job_is_never_sent(
    broker: Broker, lease_db: str
) -> None:
    with transaction.atomic(using=lease_db):
        kept = step(broker).delay("k")
        published: list[Any] = []
        rolled_back(lease_db, lambda: published.append(step(broker).delay("s")))
        (dropped,) = published
        assert refused(lambda: dropped.get(timeout=10)).rolled_back
        assert not refused(lambda: kept.get(timeout=10)).rolled_back
    assert [headers["id"] for headers, _ in broker.sent("seams.step")] == [kept.id]


def test_wait__from_another_thread__waits_as_celery_does(broker: Broker, lease_db: str) -> None:
    """Another thread's wait is not this transaction's: its commit may come meanwhile."""
    outcome: list[BaseException] = []

    def wait(result: Any) -> None:
        try:
            result.get(timeout=0.5)
        except BaseException as exc:
            outcome.append(exc)
        connections.close_all()

    with transaction.atomic(using=lease_db):
        result = step(broker).delay("t")
        waiter = threading.Thread(target=wait, args=(result,))
        waiter.start()
        waiter.join(30)
    assert [type(exc) for exc in outcome] == [CeleryTimeout]


def test_wait__eager__returns_the_result(broker: Broker, lease_db: str) -> None:
    broker.app.conf.task_always_eager = True
    with transaction.atomic(using=lease_db):
        assert step(broker).delay("e").get(timeout=10) == "e@1"


def test_wait__published_by_name__raises_at_once(
    web: tuple[Celery, Celery, Broker],
    lease_db: str,
) -> None:
    publisher, _worker, _broker = web
    with transaction.atomic(using=lease_db):
        result = publisher.send_task("remote.sync", kwargs={"account": "a"})
        mine = publisher.send_task(
            "remote.sync", kwargs={"account": "b"}, result_cls=publisher.AsyncResult
        )
        for handle in (result, mine):
            error = refused(partial(handle.get, timeout=10))
            assert (error.task_id, error.task_name) == (handle.id, "remote.sync")


def test_handle__refusing_it_keeps_what_the_apps_result_classes_do(broker: Broker) -> None:
    """Pickled, a handle is the app's result class again; a group result keeps its id."""
    broker.app.finalize()  # the app's result classes are made aware when it is finalized
    result = broker.app.AsyncResult("some-id")
    assert isinstance(result, results.UnsentAwareResult)
    assert pickle.loads(pickle.dumps(result)) == result
    grouped = broker.app.GroupResult("group-id", [result])
    assert isinstance(grouped, results.UnsentAwareResultSet)
    assert (grouped.id, grouped.results) == ("group-id", [result])
    assert results.aware(type(result)) is type(result)


@pytest.fixture
def atomic_requests(lease_db: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Django's ``ATOMIC_REQUESTS`` on the lease database: each view in a transaction."""
    monkeypatch.setitem(connections[lease_db].settings_dict, "ATOMIC_REQUESTS", True)
    return lease_db


def test_view__atomic_requests__waiting_for_its_job_fails_at_once(
    atomic_requests: str, client: Client
) -> None:
    """A view that waits for the job it publishes gets the error, not its 10 s timeout;
    the request's transaction rolls back with it: nothing is left to send."""
    error = refused(lambda: client.get("/demo/probe-now/", {"marker": "view"}))
    assert (error.alias, error.task_name) == (atomic_requests, "testproject.demo.tasks.probe")
    assert not PendingJob.objects.using(atomic_requests).exists()


def test_wait__a_rolled_back_id_published_again_and_sent__waits_as_celery_does(
    broker: Broker, lease_db: str
) -> None:
    """A task id of a rolled-back publish, published again outside a transaction (a fixed
    ``task_id``): the job is sent, so no handle of it says it never will be."""
    published: list[Any] = []
    rolled_back(
        lease_db, lambda: published.append(step(broker).apply_async(("x",), task_id="fixed"))
    )
    again = step(broker).apply_async(("x",), task_id="fixed")
    assert [headers["id"] for headers, _ in broker.sent("seams.step")] == ["fixed"]
    for handle in (*published, again, broker.app.AsyncResult("fixed")):
        with pytest.raises(CeleryTimeout):
            handle.get(timeout=0.2)
