"""An atomic task body with real workers: a task fenced by configuration alone, whose
body does a plain ``update()`` and publishes a plain child, never naming a token.

Worker A writes the row and publishes its child inside its body's open transaction, and is
stopped (SIGSTOP) there, past its lease. The broker redelivers the message to worker B,
which takes the lease over; A's row lock does not stall it (the server ends A's session,
idle in its transaction for about its ttl): B's update and child commit, and its child
runs, while A is still stopped. A is resumed: its write and its child are gone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from django_celery_results.models import TaskResult

from devtools.workers import send, wait_for
from testproject.demo.models import LedgerEntry, Report
from tests.conftest import DATABASE_ALIASES

pytestmark = [
    pytest.mark.django_db(transaction=True, databases=DATABASE_ALIASES),
    pytest.mark.workers,
    pytest.mark.timeout(120),
]

TASK = "testproject.demo.tasks.charge_invoice"


@pytest.mark.broker("redis")
@pytest.mark.parametrize("alias", ["postgres"])
def test_atomic_body_paused_past_its_lease__its_writes_and_child_are_gone(
    alias: str, start_worker: Any, redelivery_after: Any, tmp_path: Path
) -> None:
    report = Report.objects.using(alias).create(name="inv-1")
    env = {
        **redelivery_after(4),
        "FENCED_TASKS_JSON": json.dumps(
            {TASK: {"ttl": 2, "key": "invoice:{report_id}", "atomic": True}}
        ),
    }
    (tmp_path / "hold-A").touch()
    worker_a = start_worker("A", env=env)
    task_id = send(TASK, queue=start_worker.queue, args=(report.pk, str(tmp_path)))
    wait_for((tmp_path / "wrote-A").exists, 30, "worker A's write and child, uncommitted")
    worker_a.pause()
    try:
        worker_b = start_worker("B", env=env)
        done = TaskResult.objects.using(alias).filter(task_id=task_id, status="SUCCESS")
        wait_for(done.exists, 60, "worker B to finish the redelivered job")
        children = LedgerEntry.objects.using(alias).filter(job=f"charge:{report.pk}")
        wait_for(children.exists, 30, "B's child to run")
        row = Report.objects.using(alias).get(pk=report.pk)
        assert (row.body, row.built_by) == ("B;", "B")  # while A is still stopped
        (tmp_path / "hold-A").unlink()
    finally:
        worker_a.resume()
    wait_for(
        lambda: "succeeded" in worker_a.output() or "raised" in worker_a.output(),
        60,
        "worker A's task to end",
    )
    worker_b.warm_shutdown()
    worker_a.warm_shutdown()
    row = Report.objects.using(alias).get(pk=report.pk)
    assert (row.body, row.built_by) == ("B;", "B")
    assert [e.effect.split()[:3] for e in children] == [["child", "of", "B"]]
    result = TaskResult.objects.using(alias).get(task_id=task_id)
    assert (result.status, json.loads(result.result)) == ("SUCCESS", {"worker": "B"})
