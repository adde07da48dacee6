"""Permits (``lease_limit``) with real `celery worker` processes on Redis."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django_celery_results.models import TaskResult

from celery_fenced import LeaseBusy, acquire, permits
from celery_fenced.models import Lease, LeaseEvent
from devtools.workers import send, wait_for
from testproject.demo.models import LedgerEntry
from tests.acceptance.test_task_workers import result_of
from tests.conftest import WITH_MARIADB

pytestmark = [
    pytest.mark.django_db(transaction=True, databases=WITH_MARIADB),
    pytest.mark.workers,
    pytest.mark.timeout(240),
]


@pytest.fixture
def alias(alias_with_mariadb: str) -> str:
    """SQLite, PostgreSQL and MariaDB."""
    return alias_with_mariadb


TILE = "testproject.demo.tasks.render_tile"
EFFECT = "testproject.demo.tasks.apply_effect"


def held_permits(alias: str, key: str) -> int:
    from django.db.models.functions import Now

    return (
        Lease.objects.using(alias)
        .filter(key__startswith=key + permits.SEPARATOR, released_at__isnull=True)
        .filter(expires_at__gt=Now())
        .count()
    )


def test_limit_3__ten_jobs_on_one_key_across_two_workers__never_more_than_3_bodies(
    alias: str, start_worker: Any, tmp_path: Any
) -> None:
    start_worker("a", concurrency=3)
    start_worker("b", concurrency=3)
    done = tmp_path / "done"
    ids = [
        send(TILE, queue=start_worker.queue, args=(i,), kwargs={"until_file": str(done)})
        for i in range(10)
    ]
    # three bodies run (held at the file), the others find the key's 3 permits held
    running = LedgerEntry.objects.using(alias).filter(job="tiles")
    wait_for(
        lambda: (
            running.count() == 3 and LeaseEvent.objects.using(alias).filter(kind="busy").exists()
        ),
        60,
        "three bodies running and a fourth job refused as busy",
    )
    assert held_permits(alias, "tiles") == 3
    assert running.count() == 3  # a body starts only under a permit: no fourth
    done.touch()
    outcomes = [result_of(alias, task_id, timeout=180) for task_id in ids]
    assert [status for status, _ in outcomes] == ["SUCCESS"] * 10
    assert max(value["at_once"] for _, value in outcomes) == 3
    tokens = [value["token"] for _, value in outcomes]
    assert len(set(tokens)) == 10  # one sequence across the permits: never reused
    assert sorted(
        Lease.objects.using(alias)
        .filter(key__startswith="tiles" + permits.SEPARATOR)
        .values_list("key", flat=True)
    ) == [permits.permit_key("tiles", i) for i in range(3)]
    assert TaskResult.objects.using(alias).filter(task_id__in=ids).count() == 10


def test_paused_permit_holder__taken_over__its_late_write_refused(
    alias: str, start_worker: Any
) -> None:
    env = {"FENCED_TASKS_JSON": json.dumps({EFFECT: {"ttl": 2, "key": "job:{job}", "limit": 2}})}
    worker = start_worker("a", env=env)
    send(EFFECT, queue=start_worker.queue, args=("p1", "e1", 4))
    wait_for(lambda: held_permits(alias, "job:p1") == 1, 30, "the first permit's grant")
    worker.pause()
    (held,) = Lease.objects.using(alias).filter(
        key__startswith="job:p1" + permits.SEPARATOR, released_at__isnull=True
    )
    other = acquire("job:p1", ttl=300, limit=2, owner="test-other", using=alias)
    assert other.key != held.key  # the second permit: free, no takeover

    def take_over() -> Any:
        try:
            return acquire("job:p1", ttl=300, limit=2, owner="test-taker", using=alias)
        except LeaseBusy:
            return None

    taker = wait_for(take_over, 30, "the paused holder's permit to expire")
    assert (taker.key, taker.reclaimed_from) == (held.key, held.owner)
    assert taker.token > other.token > held.token
    worker.resume()
    wait_for(
        lambda: (
            LeaseEvent.objects.using(alias)
            .filter(lease__key=held.key, kind="stale_write_rejected", token=held.token)
            .exists()
        ),
        30,
        "the paused holder's write to be refused",
    )
    assert not LedgerEntry.objects.using(alias).filter(job="p1").exists()
    assert taker.release()
    assert other.release()
