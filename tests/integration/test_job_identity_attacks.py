"""Attacks on a job's identity through Celery's own tracer: a lease key header that
belongs to another job, permits, replacement by a group, and publishing by task name.

Messages are captured with ``before_task_publish`` and delivered to Celery's
``build_tracer`` (see ``test_seams`` and ``test_job_identity``).
"""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery, group

from celery_fenced import FencedTask
from celery_fenced.keys import KEY_HEADER
from celery_fenced.models import Lease, LeaseEvent, PendingJob
from tests.conftest import WITH_MARIADB
from tests.integration.test_job_identity import RUNS, deliver_all, make_app, runs, status
from tests.integration.test_seams import deliver

pytestmark = [
    pytest.mark.django_db(transaction=True, databases=WITH_MARIADB),
    pytest.mark.timeout(120),
]


def with_parent_and_child(app: Celery) -> None:
    @app.task(
        name="identity.child",
        bind=True,
        base=FencedTask,
        shared=False,
        lease_ttl=30,
        lease_key="child:{n}",
    )
    def child(self: Any, n: int) -> str:
        RUNS.append(("identity.child", self.request.lease_key))
        return str(self.request.lease_key)

    @app.task(
        name="identity.parent",
        bind=True,
        base=FencedTask,
        shared=False,
        lease_ttl=30,
        lease_key="parent:{n}",
    )
    def parent(self: Any, n: int, how: str) -> str:
        """Publishes a child job, passing its own request's custom headers on (the usual
        way to propagate a correlation id)."""
        RUNS.append(("identity.parent", self.request.lease_key))
        headers = dict(self.request.headers or {})
        if how == "apply_async":
            child.apply_async(kwargs={"n": n + 100}, headers=headers)
        elif how == "signature":
            child.s(n=n + 100).set(headers=headers).apply_async()
        elif how == "send_task":
            app.send_task("identity.child", kwargs={"n": n + 100}, headers=headers)
        return str(self.request.lease_key)


# -- a key header that belongs to another job ----------------------------------------
@pytest.mark.parametrize("how", ["apply_async", "signature", "send_task"])
def test_a_child_published_with_its_parents_headers__runs_under_its_own_key(
    capture: Any, lease_db: str, how: str
) -> None:
    """A fenced task that passes its request's headers on to a job it publishes (a
    correlation id's propagation) hands the child its own ``fenced_lease_key``: the child,
    another job, must still run under the key of its own arguments, not the parent's."""
    app = make_app()
    with_parent_and_child(app)
    broker = capture(app)
    app.tasks["identity.parent"].delay(n=1, how=how)
    deliver(app, broker.one("identity.parent"))
    headers, body = broker.one("identity.child")
    assert headers[KEY_HEADER] == "child:101"
    deliver(app, (headers, body))
    assert runs("identity.child") == ["child:101"]
    assert Lease.objects.using(lease_db).get(task_id=headers["id"]).key == "child:101"


def test_a_message_carrying_another_jobs_key_header__runs_under_its_own_key(
    capture: Any, lease_db: str
) -> None:
    """The header reaches the worker by another way (a ``before_task_publish`` handler
    copying the parent's headers, an older publisher): a key decided for another task id
    is not this job's key."""
    app = make_app()
    with_parent_and_child(app)
    broker = capture(app)
    app.tasks["identity.parent"].delay(n=1, how="none")
    parent_headers, _ = broker.one("identity.parent")
    app.tasks["identity.child"].delay(n=7)
    headers, body = broker.one("identity.child")
    forged = {
        **headers,
        **{k: v for k, v in parent_headers.items() if k.startswith("fenced_lease_key")},
    }
    assert forged[KEY_HEADER] == "parent:1"
    deliver(app, (forged, body))
    assert runs("identity.child") == ["child:7"]


def test_a_signature_copied_with_other_arguments__runs_under_its_own_key(
    capture: Any, lease_db: str
) -> None:
    """A signature sent once, then ``clone()``d with other arguments and sent again: each
    job under the key of its own arguments."""
    app = make_app()
    with_parent_and_child(app)
    broker = capture(app)
    sig = app.tasks["identity.child"].s(n=1)
    sig.apply_async()
    sig.clone(kwargs={"n": 2}).apply_async()
    sig.set(headers={"trace": "x"}).clone(kwargs={"n": 3}).apply_async()
    sent = broker.sent("identity.child")
    assert [h[KEY_HEADER] for h, _ in sent] == ["child:1", "child:2", "child:3"]
    for message in sent:
        deliver(app, message)
    assert runs("identity.child") == ["child:1", "child:2", "child:3"]


# -- permits (a retry with other arguments: test_job_identity) ---------------------------
def test_a_permit_jobs_retry__runs_under_the_key_not_its_permit_row(
    capture: Any, lease_db: str
) -> None:
    app = make_app()
    broker = capture(app)

    @app.task(
        name="identity.permitted",
        bind=True,
        base=FencedTask,
        shared=False,
        lease_ttl=30,
        lease_key="permitted:{n}",
        lease_limit=2,
    )
    def permitted(self: Any, n: int) -> str:
        RUNS.append(("identity.permitted", self.request.lease_key))
        if self.request.retries == 0:
            raise self.retry(countdown=0)
        return str(self.request.lease_key)

    result = permitted.delay(n=1)
    deliver(app, broker.sent("identity.permitted")[0])
    retried = broker.sent("identity.permitted")[1]
    assert retried[0][KEY_HEADER] == "permitted:1"
    deliver(app, retried)
    assert runs("identity.permitted") == ["permitted:1", "permitted:1"]
    assert status(lease_db, result.id) == ("SUCCESS", '"permitted:1"')


# -- replaced by a group ------------------------------------------------------------
def test_replace_with_a_group__each_member_runs_once_and_a_late_copy_is_a_duplicate(
    capture: Any, lease_db: str
) -> None:
    app = make_app()
    with_parent_and_child(app)

    @app.task(name="identity.fan", bind=True, base=FencedTask, shared=False, lease_ttl=30)
    def fan(self: Any, n: int) -> Any:
        RUNS.append(("identity.fan", n))
        return self.replace(group(app.tasks["identity.child"].si(n=i) for i in range(n)))

    broker = capture(app)
    result = (fan.si(n=2) | app.signature("identity.sink")).apply_async()
    original = broker.one("identity.fan")
    deliver(app, original)
    deliver_all(app, broker, "identity.child")
    deliver(app, original)  # redelivered late: not replaced a second time
    assert runs("identity.fan") == [2]
    assert sorted(runs("identity.child")) == ["child:0", "child:1"]
    assert len(broker.sent("identity.child")) == 2
    (accumulate,) = broker.sent("celery.accumulate")
    deliver(app, accumulate)
    deliver(app, broker.one("identity.sink"))
    assert runs("identity.sink") == [(["child:0", "child:1"],)]
    assert result.id == broker.one("identity.sink")[0]["id"]
    assert LeaseEvent.objects.using(lease_db).filter(kind="duplicate").count() == 1


# -- by task name -------------------------------------------------------------------
def test_send_task_of_a_registered_fenced_task__one_row_one_message(
    capture: Any, lease_db: str
) -> None:
    app = make_app()
    app.finalize()
    broker = capture(app)
    sent = app.send_task("identity.batch", kwargs={"ids": [1]})
    assert PendingJob.objects.using(lease_db).filter(task_id=sent.id).count() == 1
    deliver(app, broker.one("identity.batch"))
    assert runs("identity.batch") == [[1]]
    again = app.send_task("identity.batch", kwargs={"ids": [1]})
    assert again.id != sent.id  # the job done, a new one is queued
    assert len(broker.sent("identity.batch")) == 2
    assert list(PendingJob.objects.using(lease_db).values_list("task_id", flat=True)) == [again.id]
