"""A job published by task name (``app.send_task``) in a process that does not import the
task: when ``fenced_tasks`` fences the name, it goes through the outbox like the task's
``apply_async`` — recorded in the caller's transaction, sent on commit, sent again by the
reclaimer when the broker loses it.

The publishing app (a web process's) registers no task; the worker's app registers the
task plainly and fences it through the same setting. Messages are captured with
``before_task_publish`` and delivered through Celery's tracer (see ``test_seams``).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
from celery import Celery, states
from celery.exceptions import AlwaysEagerIgnored
from django.db import transaction
from kombu.exceptions import OperationalError as BrokerDown

from celery_fenced.keys import KEY_HEADER, default_key
from celery_fenced.models import Lease, LeaseEvent, PendingJob
from celery_fenced.outbox import PLAIN_HEADER, resend_pending
from tests.conftest import WITH_MARIADB
from tests.integration.test_outbox import make_due, rolled_back
from tests.integration.test_seams import Broker, deliver, status

pytestmark = [
    pytest.mark.django_db(transaction=True, databases=WITH_MARIADB),
    pytest.mark.timeout(120),
]

FENCED_TASKS = {
    "remote.charge": {"ttl": 30, "key": "charge:{order_id}", "unique": "until_started"},
    "remote.*": {"ttl": 30},
}
#: (task name, arguments) of every body that ran
RUNS: list[tuple[str, Any]] = []


def configured(name: str) -> Celery:
    app = Celery(name, set_as_current=False, broker="memory://")
    app.conf.update(
        result_backend="celery_fenced.backends:FencedDatabaseBackend",
        result_extended=True,
        task_default_queue="remote",
        fenced_tasks=FENCED_TASKS,
        fenced_duplicate_window=3600,
    )
    return app


def worker_app() -> Celery:
    """The worker's app: it registers the tasks, plainly; ``fenced_tasks`` fences them."""
    app = configured("remote-worker")

    @app.task(name="remote.charge", shared=False)
    def charge(order_id: int, amount: int = 0) -> str:
        RUNS.append(("remote.charge", (order_id, amount)))
        return f"charged {order_id}"

    @app.task(name="remote.sync", shared=False)
    def sync(account: str, full: bool = False) -> str:
        RUNS.append(("remote.sync", (account, full)))
        return f"synced {account}"

    @app.task(name="other.ping", shared=False)
    def ping() -> str:
        return "pong"

    return app


def rows(alias: str) -> list[tuple[str, str, str]]:
    return list(
        PendingJob.objects.using(alias).order_by("id").values_list("task_id", "task_name", "key")
    )


def test_send_task_in_a_transaction__recorded_and_sent_on_commit(
    web: tuple[Celery, Celery, Broker], lease_db: str
) -> None:
    app, worker, broker = web
    assert "remote.charge" not in app.tasks  # this process does not import the task
    with transaction.atomic(using=lease_db):
        result = app.send_task("remote.charge", kwargs={"order_id": 7})
        assert rows(lease_db) == [(result.id, "remote.charge", "charge:7")]
        assert broker.sent("remote.charge") == []  # not before the commit
    headers, _ = broker.one("remote.charge")
    assert (headers["id"], headers[KEY_HEADER]) == (result.id, "charge:7")
    deliver(worker, broker.one("remote.charge"))
    assert status(lease_db, result.id) == (states.SUCCESS, '"charged 7"')
    assert Lease.objects.using(lease_db).get(task_id=result.id).key == "charge:7"
    assert rows(lease_db) == []  # the grant ended it
    assert RUNS == [("remote.charge", (7, 0))]


def test_send_task_rolled_back__nothing_recorded_nothing_sent(
    web: tuple[Celery, Celery, Broker], lease_db: str
) -> None:
    app, _, broker = web
    rolled_back(lease_db, lambda: app.send_task("remote.charge", kwargs={"order_id": 8}))
    assert rows(lease_db) == []
    assert broker.messages == []


def test_send_task_broker_down__the_row_stays_and_the_reclaimer_sends_it_once(
    web: tuple[Celery, Celery, Broker], lease_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    app, worker, broker = web
    real = app.amqp.send_task_message

    def down(*args: Any, **kwargs: Any) -> Any:
        raise BrokerDown("Error 111 connecting to localhost:6379. Connection refused.")

    monkeypatch.setattr(app.amqp, "send_task_message", down)
    with transaction.atomic(using=lease_db):
        result = app.send_task("remote.sync", args=["acme"])
    (row,) = PendingJob.objects.using(lease_db).all()
    assert (row.task_id, row.unsent) == (result.id, True)
    monkeypatch.setattr(app.amqp, "send_task_message", real)
    assert [o.action for o in resend_pending(app, using=lease_db)] == ["resent"]
    assert rows(lease_db) == [(result.id, "remote.sync", "")]  # not recorded a second time
    deliver(worker, broker.one("remote.sync"))
    assert status(lease_db, result.id) == (states.SUCCESS, '"synced acme"')
    assert rows(lease_db) == []
    assert RUNS == [("remote.sync", ("acme", False))]


def test_send_task_lost_by_the_broker__sent_again_by_the_reclaimer_and_run_once(
    web: tuple[Celery, Celery, Broker], lease_db: str
) -> None:
    app, worker, broker = web
    result = app.send_task("remote.charge", kwargs={"order_id": 9, "amount": 5})
    broker.messages.clear()  # lost: a worker killed between popping and recording it
    make_due(lease_db)
    assert [o.action for o in resend_pending(app, using=lease_db)] == ["resent"]
    headers, _ = broker.one("remote.charge")
    assert (headers["id"], headers[KEY_HEADER]) == (result.id, "charge:9")
    deliver(worker, broker.one("remote.charge"))
    deliver(worker, broker.one("remote.charge"))  # redelivered: a completed duplicate
    assert RUNS == [("remote.charge", (9, 5))]


def test_send_task_unique__a_second_copy_returns_the_first_ones_result(
    web: tuple[Celery, Celery, Broker], lease_db: str
) -> None:
    app, _, broker = web
    first = app.send_task("remote.charge", kwargs={"order_id": 10})
    second = app.send_task("remote.charge", kwargs={"order_id": 10, "amount": 1})
    assert second.id == first.id
    assert len(broker.sent("remote.charge")) == 1
    assert LeaseEvent.objects.using(lease_db).filter(kind="deduplicated").count() == 1
    other = app.send_task("remote.charge", kwargs={"order_id": 11})
    assert other.id != first.id


def test_send_task_key_not_decidable_by_name__the_worker_decides_it(
    web: tuple[Celery, Celery, Broker], lease_db: str
) -> None:
    """A key template field given positionally (or left to its default), or the default
    key (a hash over the named arguments, defaults applied): without the task's signature
    the publisher cannot decide it. The job is recorded without a key and not refused as a
    copy; the worker renders the key from the message."""
    app, worker, broker = web
    first = app.send_task("remote.charge", args=[12])
    second = app.send_task("remote.charge", args=[12])
    assert second.id != first.id
    synced = app.send_task("remote.sync", kwargs={"account": "acme"})
    assert [key for *_, key in rows(lease_db)] == ["", "", ""]
    assert not any(KEY_HEADER in headers for _, headers, _ in broker.messages)
    deliver(worker, broker.sent("remote.charge")[0])
    deliver(worker, broker.one("remote.sync"))
    assert Lease.objects.using(lease_db).get(task_id=first.id).key == "charge:12"
    named = {"account": "acme", "full": False}
    assert Lease.objects.using(lease_db).get(task_id=synced.id).key == default_key(
        "remote.sync", (), named
    )


def test_send_task_of_a_task_registered_here__published_by_its_apply_async(
    web: tuple[Celery, Celery, Broker], lease_db: str
) -> None:
    """The worker's app has the task (fenced through ``fenced_tasks``): its ``apply_async``
    decides the key from the task's signature, the default key included."""
    _, worker, broker = web
    with transaction.atomic(using=lease_db):
        result = worker.send_task("remote.sync", args=["acme"])
        assert broker.sent("remote.sync") == []
    named = {"account": "acme", "full": False}
    (headers, _) = broker.one("remote.sync")
    assert headers[KEY_HEADER] == default_key("remote.sync", (), named)
    assert rows(lease_db) == [(result.id, "remote.sync", headers[KEY_HEADER])]


def test_send_task_not_fenced_by_the_configuration__sent_as_celery_sends_it(
    web: tuple[Celery, Celery, Broker], lease_db: str
) -> None:
    app, _, broker = web
    with transaction.atomic(using=lease_db):
        result = app.send_task("other.ping")
        assert broker.one("other.ping")[0]["id"] == result.id  # at once, not on commit
    assert rows(lease_db) == []


@pytest.mark.parametrize("how", ["eager", "outbox off"])
def test_send_task_eager_or_outbox_off__sent_as_celery_sends_it(
    web: tuple[Celery, Celery, Broker], lease_db: str, how: str
) -> None:
    app, _, broker = web
    if how == "eager":
        app.conf.update(task_always_eager=True)
    else:
        app.conf.update(
            fenced_tasks={"remote.charge": {"key": "charge:{order_id}", "outbox": False}}
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AlwaysEagerIgnored)  # Celery's, for send_task
        with transaction.atomic(using=lease_db):
            result = app.send_task("remote.charge", kwargs={"order_id": 13})
            headers, _ = broker.one("remote.charge")
            assert headers["id"] == result.id
    assert rows(lease_db) == []
    if how == "outbox off":  # the key is decided all the same
        assert headers[KEY_HEADER] == "charge:13"


def test_callback_by_name_of_a_fenced_outcome__recorded_as_a_fenced_job(
    web: tuple[Celery, Celery, Broker], lease_db: str
) -> None:
    """A fenced execution's ``link`` to a task its worker does not have, fenced by name:
    recorded in the transaction that proves the outcome, as a fenced job (its row ends at
    its grant), not held as a plain one until started."""
    _, worker, broker = web
    result = worker.send_task(
        "remote.charge",
        kwargs={"order_id": 21},
        link=worker.signature("remote.audit", kwargs={"order_id": 21}),
    )
    deliver(worker, broker.one("remote.charge"))
    assert status(lease_db, result.id) == (states.SUCCESS, '"charged 21"')
    headers, _ = broker.one("remote.audit")
    assert PLAIN_HEADER not in headers
    assert rows(lease_db) == [(headers["id"], "remote.audit", "")]
