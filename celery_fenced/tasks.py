"""Tasks of celery-fenced, found by Celery's ``autodiscover_tasks()``: the reclaimer."""

from __future__ import annotations

from celery_fenced.reclaim import reclaim_task

__all__ = ["reclaim_task"]
