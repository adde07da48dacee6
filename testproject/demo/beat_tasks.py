"""The task the fenced beat's acceptance tests schedule: one ledger row per run."""

from __future__ import annotations

import os
from typing import Any

from celery import shared_task
from django.utils import timezone

from testproject.demo.models import ChaosEntry


@shared_task(bind=True, name="demo.beat_tick")
def beat_tick(self: Any) -> str:
    """Record this run of a beat tick: the tick, the leader's token and the task id."""
    tick = str(getattr(self.request, "fenced_beat_tick", "") or "")
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
    return tick
