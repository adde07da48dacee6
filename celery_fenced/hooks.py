"""Config-driven fencing: tasks named in ``fenced_tasks`` are fenced without code changes."""

from __future__ import annotations


def connect() -> None:
    """Connect the Celery signal receivers (called from ``AppConfig.ready``)."""
