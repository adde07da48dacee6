"""Database faults with real workers: PostgreSQL stopped for longer than the ttl.

While four fenced jobs run (two workers: prefork and threads), PostgreSQL is stopped. Each
holder's renewer cannot reach the database; when the grant's ttl has passed it marks the
lease lost and logs it (the ``lost`` event itself cannot be written then). PostgreSQL is
started again: every holder's write is refused, the reclaimer sends each unfinished job
again, and every job's effect is applied exactly once, under a newer token, by the same
worker processes, which keep consuming afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from django.db import connections
from django_celery_results.models import TaskResult

from celery_fenced.models import LeaseEvent
from celery_fenced.store import UNRENEWED
from devtools.services import run_as_postgres
from devtools.workers import broker_url, configure, send, wait_for
from testproject.demo.models import ChaosEntry, ChaosSlot
from tests.conftest import DATABASE_ALIASES

pytestmark = [
    pytest.mark.django_db(transaction=True, databases=DATABASE_ALIASES),
    pytest.mark.workers,
    # the faults are the database's: what they show does not depend on the broker
    pytest.mark.broker("redis"),
    pytest.mark.timeout(180),
]

TTL = 2
INCLUDE = ["--include", "testproject.demo.chaos_tasks"]


def pg_ctl(*args: str) -> subprocess.CompletedProcess[bytes]:
    data = os.environ["FENCED_PG_DATA"]
    command = [str(Path(os.environ["FENCED_PG_BINDIR"]) / "pg_ctl"), "-D", data, *args]
    return run_as_postgres(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=120)


def postgres_running() -> bool:
    return pg_ctl("status").returncode == 0


def start_postgres() -> None:
    log = str(Path(os.environ["FENCED_PG_DATA"]).parent / "postgres.log")
    started = pg_ctl("-o", os.environ["FENCED_PG_OPTIONS"], "-l", log, "-w", "start")
    assert started.returncode == 0, started.stderr


def reclaimer() -> Any:
    try:
        from celery_fenced.reclaim import reclaim_expired
    except ImportError:  # pragma: no cover - the package before its reclaimer
        pytest.fail("celery_fenced.reclaim is missing: nothing sends the lost jobs again")
    from testproject.celery import app

    configure(app, broker_url=broker_url())
    return lambda: reclaim_expired(app, using="postgres")


@pytest.mark.parametrize("alias", ["postgres"])
def test_postgres_down_past_the_ttl__holders_lose_and_every_job_completes_once(
    alias: str, start_worker: Any
) -> None:
    env = {
        "FENCED_TASKS_JSON": json.dumps({"chaos.configured": {"ttl": TTL}}),
        "FENCED_CHAOS_TTL": str(TTL),
        "FENCED_EVENTS": "all",  # the grants are waited for by their events
    }
    workers = [
        start_worker(pool, pool=pool, concurrency=2, env=env, extra_args=INCLUDE)
        for pool in ("prefork", "threads")
    ]
    jobs = [f"down{n}" for n in range(4)]
    ChaosSlot.objects.using(alias).bulk_create([ChaosSlot(job=job) for job in jobs])
    ids = {
        job: send(
            "chaos.configured" if n % 2 else "chaos.guarded",
            queue=start_worker.queue,
            args=(job,),
            kwargs={"seconds": 9},  # still running when the outage has lasted a ttl
        )
        for n, job in enumerate(jobs)
    }
    grants = LeaseEvent.objects.using(alias).filter(kind="acquired", task_id__in=ids.values())
    wait_for(lambda: grants.count() == len(jobs), 60, "the four grants")
    keys = {event.task_id: event.lease.key for event in grants.select_related("lease")}

    def logs() -> str:
        return "".join(worker.output() for worker in workers)

    try:
        assert pg_ctl("-m", "fast", "-w", "stop").returncode == 0
        down = time.monotonic()
        # each holder learns it lost its lease while the database is still down: its
        # renewer gives up once the grant's ttl has passed since its last confirmed renewal
        wait_for(
            lambda: all(
                f"lease {key!r} lost under token 1: {UNRENEWED}: the last renewal attempt "
                "failed with OperationalError" in logs()
                for key in keys.values()
            ),
            30,
            "every holder to mark its lease lost",
        )
        assert "lease renewal failed" in logs()
        # the outage lasts well past the ttl (a deliberate length, not a wait for a condition)
        wait_for(lambda: time.monotonic() - down > 2 * TTL, 10, "the outage to last 2 ttl")
    finally:
        if not postgres_running():
            start_postgres()
        connections.close_all()

    reclaim = reclaimer()
    finished = TaskResult.objects.using(alias).filter(
        task_id__in=ids.values(), status__in=["SUCCESS", "FAILURE"]
    )

    def all_final() -> bool:
        reclaim()
        return finished.count() == len(jobs)

    wait_for(all_final, 90, "every job to complete after the recovery", every=0.5)
    assert set(finished.values_list("status", flat=True)) == {"SUCCESS"}
    events = LeaseEvent.objects.using(alias).filter(lease__key__in=keys.values())
    for job, task_id in ids.items():
        entries = list(ChaosEntry.objects.using(alias).filter(job=job))
        assert len(entries) == 1, (job, entries)
        assert entries[0].token >= 2  # written under a newer grant, not the lost one
        assert (entries[0].grant_seen, entries[0].end_seen) == (entries[0].token, False)
        # the lost holder's own write was refused once the database was back
        key = keys[task_id]
        assert events.filter(lease__key=key, kind="stale_write_rejected", token=1).exists()
    # the same processes keep consuming: no worker was restarted, none needs to be
    quick = [
        send("chaos.guarded", queue=start_worker.queue, args=(f"after{n}",), kwargs={"seconds": 1})
        for n in range(8)
    ]
    done = TaskResult.objects.using(alias).filter(task_id__in=quick, status="SUCCESS")
    wait_for(lambda: done.count() == len(quick), 60, "the jobs sent after the recovery")
    hosts = {row.split("@")[0] for row in done.values_list("worker", flat=True)}
    assert hosts == {worker.name for worker in workers}
    for worker in workers:
        assert worker.process.poll() is None
        assert "Unrecoverable error" not in worker.output()
        assert "CRITICAL" not in worker.output()


@pytest.mark.parametrize("alias", ["postgres"])
def test_retry_sent_before_a_failure__still_runs(alias: str, start_worker: Any) -> None:
    """The mechanism by which a PostgreSQL restart loses a job that asked to be retried."""
    start_worker(
        "a", env={"FENCED_CHAOS_TTL": str(TTL), "FENCED_EVENTS": "all"}, extra_args=INCLUDE
    )
    task_id = send("chaos.retry_then_fail", queue=start_worker.queue, args=("retry1",))
    events = LeaseEvent.objects.using(alias).filter(task_id=task_id)
    wait_for(
        lambda: events.filter(kind__in=["released", "duplicate"]).count() >= 2,
        60,
        "the failed execution and its retry",
    )
    result = wait_for(
        lambda: TaskResult.objects.using(alias).filter(task_id=task_id, status="SUCCESS").first(),
        10,
        "the retry to succeed",
    )
    assert json.loads(result.result)["applied"] is True
    assert ChaosEntry.objects.using(alias).filter(job="retry1").count() == 1


@pytest.mark.parametrize("alias", ["postgres"])
def test_database_down_when_a_job_arrives__job_still_completes(
    alias: str, start_worker: Any
) -> None:
    worker = start_worker("a", env={"FENCED_CHAOS_TTL": str(TTL)}, extra_args=INCLUDE)
    try:
        assert pg_ctl("-m", "fast", "-w", "stop").returncode == 0
        task_id = send("chaos.guarded", queue=start_worker.queue, args=("arrives",))
        # the worker takes the job and fails on the database before any grant
        wait_for(lambda: "OperationalError" in worker.output(), 30, "the job to be tried")
    finally:
        if not postgres_running():
            start_postgres()
        connections.close_all()
    reclaim = reclaimer()
    outcome = TaskResult.objects.using(alias).filter(task_id=task_id, status="SUCCESS")

    def succeeded() -> bool:
        reclaim()
        return outcome.exists()

    wait_for(succeeded, 60, "the job to complete once the database is back", every=0.5)
    assert ChaosEntry.objects.using(alias).filter(job="arrives").count() == 1
