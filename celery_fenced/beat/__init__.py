"""Celery beat on several hosts: one leader by fenced lease, each tick sent once.

Run ``celery beat -S celery_fenced.beat:FencedScheduler`` (or
``celery_fenced.beat:FencedDatabaseScheduler`` with django-celery-beat) on any number of
hosts. One holds the lease ``fenced_beat_key`` and sends; the others stand by and take
over within ``fenced_beat_ttl`` seconds when it stops renewing. Each entry's last sent
tick is kept in the lease database (:class:`~celery_fenced.models.BeatEntry`) and
advanced only under the leader's proven token, in the transaction that records the
tick's job in the outbox: see :mod:`celery_fenced.beat.ticks`.
"""

from __future__ import annotations

from typing import Any

from celery_fenced.beat.scheduler import FencedScheduler

__all__ = ["FencedDatabaseScheduler", "FencedScheduler"]


def __getattr__(name: str) -> Any:
    if name == "FencedDatabaseScheduler":
        # django-celery-beat is optional: its scheduler is imported when asked for
        from celery_fenced.beat.database import FencedDatabaseScheduler

        return FencedDatabaseScheduler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
