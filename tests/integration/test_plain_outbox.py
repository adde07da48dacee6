"""Plain jobs a fenced outcome sends on, held by the outbox until a worker starts them:
expired in the queue, revoked twice, and a fenced callback whose outbox is off — through
Celery's own tracer (and its worker ``Request``) on SQLite and PostgreSQL."""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

import pytest
from celery import chain, chord, states
from django.db.models import F
from django.utils import timezone
from django_celery_results.models import ChordCounter, TaskResult

from celery_fenced import FencedTask, acquire
from celery_fenced.models import PendingJob
from celery_fenced.outbox import PLAIN_HEADER, resend_pending
from tests.conftest import WITH_MARIADB
from tests.integration.test_seams import Broker, deliver

pytestmark = [
    pytest.mark.django_db(transaction=True, databases=WITH_MARIADB),
    pytest.mark.timeout(120),
]


def discard_at_worker(app: Any, message: tuple[dict[str, Any], Any]) -> None:
    """What a worker does with a message whose ``expires`` has passed: Celery's own
    ``Request.revoked()`` (records REVOKED through the backend, counts the chord part,
    sends ``task_revoked``)."""
    from celery.worker import state
    from celery.worker.request import Request
    from kombu.message import Message

    headers, body = message
    msg = Message(
        body=body,
        headers=dict(headers),
        content_type="application/json",
        content_encoding="utf-8",
        delivery_info={"exchange": "", "routing_key": "seams"},
        properties={},
    )
    request = Request(msg, app=app, hostname="w@seams", decoded=True, body=body)
    try:
        assert request.revoked(), "the message was not expired at the worker"
    finally:
        state.revoked.discard(headers["id"])


def _chord_with_an_expiring_member(broker: Broker) -> tuple[Any, dict[tuple[str, ...], Any]]:
    """A fenced step whose chain sends on a chord of plain members a, b, c (a expires
    after 1 s), the step delivered: the chord's result and the members' messages."""
    app = broker.app
    header = [
        app.signature("seams.sink", ("a",), immutable=True).set(expires=1),
        app.signature("seams.sink", ("b",), immutable=True),
        app.signature("seams.sink", ("c",), immutable=True),
    ]
    result = chain(
        app.signature("seams.step", ("x",)), chord(header, app.signature("seams.sink"))
    ).apply_async()
    deliver(app, broker.one("seams.step"))
    return result, {tuple(m[1][0]): m for m in broker.sent("seams.sink")}


def test_plain_chord_member_expired_in_the_queue__counted_once__body_settled(
    broker: Broker, lease_db: str
) -> None:
    """A fenced step's chain sends on a chord of plain tasks; one header member has an
    ``expires`` and waits in a backlog past it, longer than
    ``fenced_outbox_resend_after``: the reclaimer records its REVOKED (counting the chord
    part); the worker that then takes the message discards it as expired — REVOKED is
    not recorded, nor the part counted, a second time. The chord body is settled (failed:
    a member was revoked), not lost."""
    app = broker.app
    result, members = _chord_with_an_expiring_member(broker)
    assert set(members) == {("a",), ("b",), ("c",)}
    assert PendingJob.objects.using(lease_db).count() == 3  # sent, not started
    time.sleep(1.5)  # "a" waits in the queue past its expires
    # ... longer than fenced_outbox_resend_after: the reclaimer records its REVOKED
    PendingJob.objects.using(lease_db).filter(expires_at__isnull=False).update(
        expires_at=timezone.now() - dt.timedelta(hours=1)
    )
    assert [o.action for o in resend_pending(app, using=lease_db)] == ["revoked"]
    discard_at_worker(app, members[("a",)])  # the worker reaches it: expired, discarded
    deliver(app, members[("b",)])
    deliver(app, members[("c",)])
    # every header member is final: the chord body has been sent (or failed, a member
    # being revoked) — as without the outbox row
    assert not ChordCounter.objects.using(lease_db).exists()
    body = TaskResult.objects.using(lease_db).filter(task_id=result.id)
    sent = [h["id"] for h, _ in broker.sent("seams.sink")]
    assert result.id in sent or body.values_list("status", flat=True).first() == states.FAILURE, (
        "the chord body was never sent and never failed"
    )


def test_plain_chord_member_expired_in_the_queue__discarded_by_the_worker__body_settled(
    broker: Broker, lease_db: str
) -> None:
    """The same member discarded by the worker first: the reclaimer then finds no
    expired row (the worker's ``task_revoked`` ended it) and records nothing; the body
    is failed with a ChordError once every member is final."""
    app = broker.app
    result, members = _chord_with_an_expiring_member(broker)
    time.sleep(1.5)
    discard_at_worker(app, members[("a",)])
    PendingJob.objects.using(lease_db).filter(expires_at__isnull=False).update(
        expires_at=timezone.now() - dt.timedelta(hours=1)
    )
    assert resend_pending(app, using=lease_db) == []
    deliver(app, members[("b",)])
    deliver(app, members[("c",)])
    body = TaskResult.objects.using(lease_db).filter(task_id=result.id)
    assert body.values_list("status", flat=True).first() == states.FAILURE


def make_due(alias: str) -> None:
    """As if ``fenced_outbox_resend_after`` had passed."""
    PendingJob.objects.using(alias).update(resend_at=F("published_at") - dt.timedelta(seconds=1))


def register_skipping(app: Any, runs: list[str], outbox: bool | None) -> Any:
    @app.task(
        name="r2.skipping",
        bind=True,
        base=FencedTask,
        shared=False,
        lease_key="skipping",
        lease_on_busy="skip",
        lease_outbox=outbox,
    )
    def skipping(self: Any, value: str) -> str:
        runs.append(value)
        return value

    return skipping


@pytest.mark.parametrize("outbox", [False, True], ids=["outbox-off", "outbox-on"])
def test_busy_skipped_link_callback__not_sent_again_and_never_runs(
    broker: Broker, lease_db: str, outbox: bool
) -> None:
    """A fenced step's ``link`` callback is a fenced task with ``lease_on_busy="skip"``.
    Its key is busy when it arrives: it is skipped (the job ends, as a completion). With
    ``lease_outbox = False`` it was recorded as a plain job (header ``fenced_outbox``) by
    the step's proof, and nothing ends that row (no grant; the prerun receiver passes
    fenced tasks by): the reclaimer sends it again and, the key free by then, the
    skipped job runs after all."""
    app = broker.app
    runs: list[str] = []
    register_skipping(app, runs, outbox)
    app.signature("seams.step", ("x",)).apply_async(
        link=app.signature("r2.skipping", ("cb",), immutable=True)
    )
    step = broker.sent("seams.step")[0]
    deliver(app, step)
    (callback,) = broker.sent("r2.skipping")
    holder = acquire("skipping", ttl=30, task_id="another-job", using=lease_db)
    deliver(app, callback)  # busy: skipped
    holder.release()
    assert runs == []
    rows = list(PendingJob.objects.using(lease_db).values_list("task_id", "plain"))
    make_due(lease_db)
    resent = [o.action for o in resend_pending(app, using=lease_db)]
    for message in broker.sent("r2.skipping")[1:]:
        deliver(app, message)  # the key is free now
    assert (callback[0].get(PLAIN_HEADER), rows, resent, runs) == (
        callback[0].get(PLAIN_HEADER),
        [],
        [],
        [],
    )


@pytest.fixture
def alias(alias_with_mariadb: str) -> str:
    """SQLite, PostgreSQL and MariaDB."""
    return alias_with_mariadb
