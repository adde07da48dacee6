"""RabbitMQ's own redeliveries, with real `celery worker` processes, fenced.

RabbitMQ requeues every message a channel holds unacknowledged when that channel closes:
at once when the worker's connection is lost (a killed worker: its kernel closes the
socket), and when the broker's ``consumer_timeout`` expires on a delivery held too long
(it closes the channel; Celery 5.7 takes that for an unrecoverable error: the worker
stops once its running tasks have finished). Either way another worker gets the message
while the first execution's grant may still be current: the lease decides who may write.
(The paused worker whose channel the timeout closes is the worked example, which runs on
RabbitMQ too.)
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from django_celery_results.models import TaskResult

from celery_fenced.models import Lease, LeaseEvent
from devtools.workers import send, wait_for
from testproject.demo.models import LedgerEntry
from tests.acceptance.test_task_workers import result_of

pytestmark = [
    pytest.mark.django_db(transaction=True, databases=["default", "postgres"]),
    pytest.mark.workers,
    pytest.mark.broker("rabbitmq"),
    pytest.mark.timeout(180),
]

EFFECT = "testproject.demo.tasks.apply_effect"


@pytest.fixture
def alias() -> str:
    return "postgres"


def test_killed_holder__redelivered_at_once__next_worker_takes_over_with_the_next_token(
    alias: str, start_worker: Any
) -> None:
    """kill -9 of the worker that holds an acks_late job: RabbitMQ redelivers the message
    to the other worker at once (no visibility timeout to wait for; nothing re-sends it
    here), which waits out the dead holder's grant and runs the job under the next token."""
    env = {"FENCED_TASKS_JSON": json.dumps({EFFECT: {"ttl": 2, "key": "job:{job}"}})}
    worker_a = start_worker("a", env=env)
    task_id = send(EFFECT, queue=start_worker.queue, args=("k1", "e", 4))
    lease = wait_for(
        lambda: Lease.objects.using(alias).filter(key="job:k1").first(), 30, "A's grant"
    )
    assert lease.owner.startswith("a-")
    worker_a.pause()  # its body must not end while B starts (seconds on a busy machine)
    start_worker("b", env=env)
    worker_a.kill()  # SIGKILL to its process group: the pool child too, no ack ever
    status, value = result_of(alias, task_id, timeout=90)
    assert status == "SUCCESS"
    assert value["token"] == lease.token + 1
    assert value["worker"] == "b"
    entries = LedgerEntry.objects.using(alias).filter(job="k1")
    assert list(entries.values_list("token", "worker")) == [(lease.token + 1, "b")]
    taken = LeaseEvent.objects.using(alias).get(lease__key="job:k1", kind="reclaimed")
    assert (taken.token, taken.detail["previous_token"]) == (lease.token + 1, lease.token)


def test_long_task_past_consumer_timeout__lease_kept_by_renewal__body_runs_once(
    alias: str, start_worker: Any, redelivery_after: Any
) -> None:
    """A job runs longer than ``consumer_timeout``: RabbitMQ closes its worker's channel and
    redelivers the message to the other worker while the first execution still runs (its
    worker stops once it has finished). The first worker's renewals keep its lease, so the
    copy finds it held (busy, retried) and, once the job completed, a duplicate: the body
    runs once, under the first token."""
    env = {
        "FENCED_TASKS_JSON": json.dumps({EFFECT: {"ttl": 2, "key": "job:{job}"}}),
        **redelivery_after(3),
    }
    start_worker("a", env=env)
    task_id = send(EFFECT, queue=start_worker.queue, args=("long", "e", 8))
    lease = wait_for(
        lambda: Lease.objects.using(alias).filter(key="job:long").first(), 30, "A's grant"
    )
    start_worker("b", env=env)
    events = LeaseEvent.objects.using(alias).filter(lease__key="job:long")
    wait_for(
        lambda: events.filter(kind__in=["busy", "duplicate"]).exists(),
        60,
        "the redelivered copy to find the lease held",
    )
    status, value = result_of(alias, task_id, timeout=90)
    assert (status, value["token"], value["worker"]) == ("SUCCESS", lease.token, "a")
    entries = LedgerEntry.objects.using(alias).filter(job="long")
    assert list(entries.values_list("token", "worker")) == [(lease.token, "a")]
    assert Lease.objects.using(alias).get(key="job:long").token == lease.token
    assert not events.filter(kind__in=["reclaimed", "lost", "stale_write_rejected"]).exists()
    assert TaskResult.objects.using(alias).get(task_id=task_id).status == "SUCCESS"
