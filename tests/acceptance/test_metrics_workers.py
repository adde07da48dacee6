"""A real prefork worker with ``fenced_metrics_port``: scraped over HTTP after
a takeover between its two pool processes, its counters add up across them."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import urllib.request
from typing import Any

import pytest

from celery_fenced.models import Lease, LeaseEvent
from devtools.workers import send, wait_for
from tests.conftest import DATABASE_ALIASES

pytestmark = [
    pytest.mark.django_db(transaction=True, databases=DATABASE_ALIASES),
    pytest.mark.workers,
    pytest.mark.timeout(180),
]

EFFECT = "testproject.demo.tasks.apply_effect"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def scrape(port: int) -> dict[str, float]:
    """Every sample of the worker's exporter, by its name and labels as written."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as page:
        text = page.read().decode()
    return {
        match[1]: float(match[2])
        for match in re.finditer(r"^(celery_fenced_\S+) (\S+)$", text, re.MULTILINE)
    }


# the exporter's counting across pool processes is under test, not the database
@pytest.mark.parametrize("alias", ["postgres"])
def test_takeover_between_pool_processes__counted_once_each_across_them(
    alias: str, start_worker: Any
) -> None:
    port = free_port()
    env = {
        "FENCED_TASKS_JSON": json.dumps({EFFECT: {"ttl": 2, "key": "job:{job}"}}),
        "FENCED_METRICS_PORT": str(port),
    }
    start_worker("a", concurrency=2, env=env)
    wait_for(lambda: _reachable(port), 30, "the worker's exporter")
    task = f'task="{EFFECT}"'
    send(EFFECT, queue=start_worker.queue, args=("m1", "e1", 6))
    first = wait_for(
        lambda: Lease.objects.using(alias).filter(key="job:m1", released_at__isnull=True).first(),
        30,
        "the first grant",
    )
    wait_for(  # renewed once: a renewal statement to count
        lambda: (
            Lease.objects.using(alias)
            .filter(pk=first.pk, token=1, renewed_at__gt=first.acquired_at)
            .exists()
        ),
        30,
        "a renewal of the first grant",
    )
    pid = int(first.owner.split(":")[-2])  # owner: hostname:boot:pid:thread
    os.kill(pid, signal.SIGSTOP)  # one pool process stalls holding the grant
    try:
        send(EFFECT, queue=start_worker.queue, args=("m1", "e2", 0))
        wait_for(
            lambda: Lease.objects.using(alias).filter(key="job:m1", token=2).exists(),
            60,
            "the other pool process's takeover",
        )
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_for(
        lambda: (
            LeaseEvent.objects.using(alias)
            .filter(lease__key="job:m1", kind="stale_write_rejected", token=1)
            .exists()
        ),
        60,
        "the stalled process's write to be refused",
    )

    def counted() -> dict[str, float] | None:
        samples = scrape(port)
        done = samples.get(f'celery_fenced_stale_writes_rejected_total{{{task},what="guard"}}')
        return samples if done else None

    samples = wait_for(counted, 30, "the refused write in the worker's metrics")
    assert samples[f'celery_fenced_grants_total{{kind="acquired",{task}}}'] == 1
    assert samples[f'celery_fenced_grants_total{{kind="reclaimed",{task}}}'] == 1
    assert samples[f'celery_fenced_stale_writes_rejected_total{{{task},what="guard"}}'] == 1
    lost = [v for name, v in samples.items() if name.startswith("celery_fenced_lost_total{")]
    assert sum(lost) == 1  # the stalled process learned it, whichever way first
    assert samples[f"celery_fenced_takeover_delay_seconds_count{{{task}}}"] == 1
    assert samples["celery_fenced_renewal_batch_size_count"] >= 1


def _reachable(port: int) -> bool:
    try:
        scrape(port)
    except OSError:
        return False
    return True
