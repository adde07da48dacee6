"""Reclaimers racing in separate OS processes on SQLite and PostgreSQL: every expiry is
claimed by exactly one of them, so exactly one message per expiry reaches the broker."""

from __future__ import annotations

import datetime as dt
import json
import os
import uuid
from collections import Counter

import pytest
from django.db.models import F

from celery_fenced import store
from celery_fenced.models import Lease, LeaseEvent
from celery_fenced.reclaim import Job, encode_job
from devtools.workers import reclaim_race
from tests.conftest import WITH_MARIADB
from tests.integration.test_store_concurrency import PROCESSES, run_processes

pytestmark = [
    pytest.mark.django_db(transaction=True, databases=WITH_MARIADB),
    pytest.mark.timeout(120),
]


@pytest.fixture
def alias(alias_with_mariadb: str) -> str:
    """SQLite, PostgreSQL and MariaDB."""
    return alias_with_mariadb


TASK = "app.tasks.job"
JOBS = 20
ROUNDS = 4  # three expiries re-sent (fenced_reclaim_max = 3), then the abandonment


def test_race__one_message_per_expiry_then_one_abandonment(alias: str) -> None:
    import redis

    url = os.environ["FENCED_REDIS_URL"]
    queue = f"race-{uuid.uuid4().hex[:8]}"
    keys = [f"race:{n}" for n in range(JOBS)]
    for n, key in enumerate(keys):
        job = encode_job(Job(TASK, [n], {}, {"queue": queue}))
        store.grant(key, ttl=60, task_id=f"task-{n}", task_name=TASK, job=job, using=alias)
    Lease.objects.using(alias).filter(key__in=keys).update(
        expires_at=F("acquired_at") - dt.timedelta(seconds=1),  # first: MySQL's UPDATE
        acquired_at=F("acquired_at") - dt.timedelta(seconds=2),  # reads what it set
    )

    collected = run_processes(reclaim_race, lambda i: (alias, url, keys, ROUNDS, i), PROCESSES)

    outcomes = [o for per_process in collected for o in per_process]
    by_round = Counter((round_no, key, action) for round_no, key, _, action, _ in outcomes)
    expected = Counter(
        (round_no, key, "resent" if round_no < ROUNDS - 1 else "abandoned")
        for round_no in range(ROUNDS)
        for key in keys
    )
    assert by_round == expected  # one claim per key and expiry, whoever made it
    client = redis.Redis.from_url(url)
    messages = [json.loads(raw) for raw in client.lrange(queue, 0, -1)]
    client.delete(queue)
    sent = Counter(m["headers"]["id"] for m in messages)
    assert sent == Counter({f"task-{n}": ROUNDS - 1 for n in range(JOBS)})
    events = LeaseEvent.objects.using(alias).filter(lease__key__in=keys)
    assert events.filter(kind="resent").count() == JOBS * (ROUNDS - 1)
    assert events.filter(kind="abandoned").count() == JOBS
    assert set(
        Lease.objects.using(alias)
        .filter(key__in=keys)
        .values_list("reclaim_state", "reclaim_attempts", "token")
    ) == {("abandoned", ROUNDS - 1, ROUNDS)}
