"""An execution whose own grant expired with nobody taking over is retried, not failed.

The body finds out at its write (``guard()`` or ``fenced_update`` refuses the expired
token): the job is sent again at once under the same task id and the retry takes the key
with a higher token. Both ways of fencing a task (``FencedTask`` and ``fenced_tasks``),
through Celery's own tracer (:mod:`tests.integration.test_seams`).
"""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery, signals
from django.db import InterfaceError, OperationalError

from celery_fenced import FencedTask, current_lease, fenced_update
from celery_fenced import signals as fenced_signals
from celery_fenced.models import Lease, LeaseEvent
from celery_fenced.store import database_now
from celery_fenced.store.held import UNRENEWED
from testproject.demo.models import Report
from tests.conftest import WITH_MARIADB
from tests.integration.test_seams import (
    FAILING,
    GATES,
    RUNS,
    Broker,
    Execution,
    _gate,
    deliver,
    expire,
    granted,
    status,
)

pytestmark = [
    pytest.mark.django_db(transaction=True, databases=WITH_MARIADB),
    pytest.mark.timeout(120),
]

#: Celery's retry on a database error, as a task whose body writes says it may
RETRY: dict[str, Any] = {
    "autoretry_for": (OperationalError, InterfaceError),
    "retry_kwargs": {"max_retries": 20, "countdown": 1},
}


def make_app(ttl: float = 30) -> Celery:
    app = Celery("lostexp", set_as_current=False, broker="memory://")
    app.conf.update(
        result_backend="celery_fenced.backends:FencedDatabaseBackend",
        result_extended=True,
        task_default_queue="lostexp",
        fenced_duplicate_window=3600,
        fenced_tasks={"lostexp.configured": {"ttl": ttl}},
    )

    def write(how: str, name: str) -> str:
        lease = current_lease()
        assert lease is not None
        rows = Report.objects.filter(name=name)
        if how == "check" and threading.current_thread().name == "A":
            # as the renewer tells a body at its local deadline
            lease.mark_lost(UNRENEWED)
            lease.check()
        if how == "guard":
            with lease.guard():
                rows.update(body=f"guarded@{lease.token}")
        else:
            fenced_update(rows, token=lease.token, body=f"updated@{lease.token}")
        return f"{name}@{lease.token}"

    @app.task(name="lostexp.configured", bind=True, shared=False, **RETRY)
    def configured(self: Any, how: str, name: str) -> str:
        _gate("lostexp.configured", name)
        return write(how, name)

    @app.task(
        name="lostexp.classed",
        bind=True,
        base=FencedTask,
        shared=False,
        lease_ttl=ttl,
        lease_key="report:{name}",
        **RETRY,
    )
    def classed(self: Any, how: str, name: str) -> str:
        _gate("lostexp.classed", name)
        return write(how, name)

    return app


@pytest.fixture
def alias(alias_with_mariadb: str) -> str:
    """SQLite, PostgreSQL and MariaDB."""
    return alias_with_mariadb


@pytest.fixture
def lostexp(lease_db: str) -> Iterator[Broker]:
    recorded = Broker(make_app())
    signals.before_task_publish.connect(recorded.record, weak=False)
    GATES.clear()
    RUNS.clear()
    FAILING.clear()  # a former test's failing threads: its own bodies would raise
    yield recorded
    signals.before_task_publish.disconnect(recorded.record)
    for gate in GATES.values():
        gate.set()


@pytest.mark.parametrize("how", ["guard", "fenced_update"])
@pytest.mark.parametrize("task", ["lostexp.configured", "lostexp.classed"])
def test_own_grant_expired_unclaimed__the_write_refused_retries_the_job(
    lostexp: Broker, lease_db: str, task: str, how: str
) -> None:
    app = lostexp.app
    Report.objects.using(lease_db).create(name="r")
    app.signature(task, (how, "r")).apply_async()
    message = lostexp.one(task)
    task_id = message[0]["id"]
    a = Execution(app, message, "A")
    expire(lease_db, granted(lease_db, task_id, 1))  # paused past its ttl; nobody took it
    a.finish()
    assert status(lease_db, task_id)[0] == "RETRY"  # not FAILURE
    (retried,) = lostexp.sent(task)[1:]
    assert retried[0]["id"] == task_id
    deliver(app, retried)
    assert status(lease_db, task_id) == ("SUCCESS", '"r@2"')
    report = Report.objects.using(lease_db).get(name="r")
    assert (report.fencing_token if how == "fenced_update" else 2, report.body[-2:]) == (2, "@2")
    lease = Lease.objects.using(lease_db).get(task_id=task_id)
    assert (lease.token, lease.released_at is not None) == (2, True)
    assert LeaseEvent.objects.using(lease_db).filter(kind="lost", token=1).exists()


@pytest.mark.parametrize("how", ["guard", "fenced_update", "check"])
@pytest.mark.parametrize("task", ["lostexp.configured", "lostexp.classed"])
def test_grant_running_again_after_the_refusal__the_job_is_retried_not_failed(
    lostexp: Broker, lease_db: str, task: str, how: str
) -> None:
    """The body learns that its grant is gone, but the row says otherwise by the time it
    asks: a renewal sent before the expiry reached the row after the refusal (the
    renewer wakes from the same pause as the body), or the local deadline came a moment
    before the database's. Its token is still the key's and nobody took over: the job is
    retried, and the grant it still holds is ended so that the retry can take the key."""
    app = lostexp.app
    Report.objects.using(lease_db).create(name="r")
    app.signature(task, (how, "r")).apply_async()
    message = lostexp.one(task)
    task_id = message[0]["id"]
    a = Execution(app, message, "A")
    row = granted(lease_db, task_id, 1)
    if how != "check":
        expire(lease_db, row)

    def renewed_late(sender: Any, key: str, token: int, **_: Any) -> None:
        later = database_now(lease_db) + dt.timedelta(seconds=30)
        Lease.objects.using(lease_db).filter(key=key, token=token).update(expires_at=later)

    fenced_signals.lease_lost.connect(renewed_late, weak=False)
    try:
        a.finish()
    finally:
        fenced_signals.lease_lost.disconnect(renewed_late)
    assert status(lease_db, task_id)[0] == "RETRY"  # not FAILURE
    lease = Lease.objects.using(lease_db).get(task_id=task_id)
    assert (lease.token, lease.released_at) == (1, None)
    assert lease.expires_at <= database_now(lease_db)  # ended: the key is free
    (retried,) = lostexp.sent(task)[1:]
    deliver(app, retried)
    assert status(lease_db, task_id) == ("SUCCESS", '"r@2"')
    assert Report.objects.using(lease_db).get(name="r").body.endswith("@2")


def test_row_holding_a_newer_token__still_fails_while_the_grant_is_current(
    lostexp: Broker, lease_db: str
) -> None:
    """A row stamped by a newer token refuses the write of a current grant: that is no
    lost grant, the job fails with StaleToken (and is not retried)."""
    app = lostexp.app
    report = Report.objects.using(lease_db).create(name="r")
    Report.objects.using(lease_db).filter(pk=report.pk).update(fencing_token=100)
    app.signature("lostexp.configured", ("fenced_update", "r")).apply_async()
    message = lostexp.one("lostexp.configured")
    deliver(app, message)
    assert status(lease_db, message[0]["id"])[0] == "FAILURE"
    assert len(lostexp.sent("lostexp.configured")) == 1


def test_end_unclaimed__expiry_back_to_the_last_renewal__a_renewal_on_its_way_renews_nothing(
    lease_db: str,
) -> None:
    """The grant a holder gives up expires at its last renewal, not at the moment it is
    given up: a renewal sent after that last one — already on its way, its statement's
    time before this moment — finds it expired, so the retry's grant is not held off by
    the old token for another ttl."""
    from celery_fenced import acquire, store

    lease = acquire("lostexp:renewal-on-its-way", ttl=30, using=lease_db)
    assert store.end_unclaimed(lease)
    row = Lease.objects.using(lease_db).get(key=lease.key)
    assert row.released_at is None
    assert row.token == lease.token
    assert row.expires_at == row.renewed_at  # no instant after the last renewal is covered
