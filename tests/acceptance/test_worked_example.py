"""DESIGN.md's worked example with real processes: the broker itself redelivers to B.

Worker A takes ``report:<id>`` with token t and is stopped (SIGSTOP). Its lease expires;
the broker hands the unacked message to worker B (Redis: its visibility timeout; RabbitMQ:
``consumer_timeout`` closes A's channel), which reclaims the lease
with token t+1, writes the report and the result, and releases. A is resumed (SIGCONT):
its renewal fails, and its report write and its result write are both refused.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from django_celery_results.models import TaskResult

from celery_fenced.models import Lease, LeaseEvent
from devtools.workers import send, wait_for
from testproject.demo.models import Report
from tests.conftest import WITH_MARIADB

pytestmark = [
    pytest.mark.django_db(transaction=True, databases=WITH_MARIADB),
    pytest.mark.workers,
    pytest.mark.timeout(180),
]


TASK = "testproject.demo.tasks.rebuild_report_short"  # lease_ttl=2


# the fencing under it runs on all three databases in tests/integration/test_seams.py
@pytest.mark.parametrize("alias", ["postgres"])
def test_worked_example__stale_worker_is_fenced_out(
    alias: str, start_worker: Any, redelivery_after: Any
) -> None:
    report = Report.objects.using(alias).create(name="q3")
    # every grant and release an event too: the whole story, in order, in the trail
    redelivery = {**redelivery_after(4), "FENCED_EVENTS": "all"}
    worker_a = start_worker("A", env=redelivery)
    task_id = send(TASK, queue=start_worker.queue, args=(report.pk,), kwargs={"seconds": 5})
    key = f"report:{report.pk}"
    leases = Lease.objects.using(alias).filter(key=key)
    first = wait_for(lambda: leases.first(), 30, "worker A's grant")
    worker_a.pause()
    worker_b = start_worker("B", env=redelivery)
    # the broker redelivers the unacked message to B; B reclaims the expired lease
    wait_for(
        lambda: TaskResult.objects.using(alias).filter(task_id=task_id, status="SUCCESS").first(),
        90,
        "worker B to finish the redelivered job",
    )
    worker_a.resume()
    events = LeaseEvent.objects.using(alias).filter(lease__key=key).order_by("id")
    wait_for(
        lambda: events.filter(kind="stale_write_rejected", token=first.token).count() >= 2,
        60,
        "worker A's report write and result write to be refused",
    )
    worker_b.warm_shutdown()
    worker_a.warm_shutdown()

    t = first.token
    story = [(e.kind, e.token) for e in events if e.kind != "busy"]
    expected = [("acquired", t), ("reclaimed", t + 1), ("released", t + 1)]
    assert [s for s in story if s in expected] == expected, story
    assert story.index(("released", t + 1)) < story.index(("stale_write_rejected", t)), story
    assert ("lost", t) in story
    row = Report.objects.using(alias).get(pk=report.pk)
    assert (row.fencing_token, row.built_by) == (t + 1, "B")
    result = TaskResult.objects.using(alias).get(task_id=task_id)
    assert result.status == "SUCCESS"
    assert json.loads(result.result) == {"worker": "B", "token": t + 1, "lost": False}
    assert json.loads(result.meta)["fencing_token"] == t + 1
    lease = Lease.objects.using(alias).get(key=key)
    assert (lease.token, lease.released_at is not None) == (t + 1, True)
