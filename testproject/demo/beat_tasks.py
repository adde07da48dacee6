"""The task the fenced beat's acceptance tests schedule: one ledger row per run."""

from __future__ import annotations

import os
import time
from typing import Any

from celery import shared_task
from django.db import DatabaseError, connection
from django.utils import timezone

from testproject.demo.models import ChaosEntry


@shared_task(bind=True, name="demo.beat_tick")
def beat_tick(self: Any) -> str:
    """Record this run of a beat tick: the tick, the leader's token and the task id."""
    tick = str(getattr(self.request, "fenced_beat_tick", "") or "")
    # the chaos runner restarts PostgreSQL: this run is recorded once it is back
    deadline = time.monotonic() + 60
    while True:
        try:
            _record(self, tick)
            return tick
        except DatabaseError:
            if time.monotonic() > deadline:
                raise
            connection.close()
            time.sleep(0.5)


def _record(self: Any, tick: str) -> None:
    ChaosEntry.objects.create(
        job=f"beat:{tick}",
        lease_key=str(getattr(self.request, "fenced_beat_key", "") or ""),
        token=int(getattr(self.request, "fenced_beat_token", 0) or 0),
        owner="",
        worker=os.environ.get("FENCED_WORKER_NAME", ""),
        task_id=self.request.id or "",
        via="beat",
        written_at=timezone.now(),
    )
