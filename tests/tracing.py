"""Run a fenced task through Celery's real tracer, as a worker's pool process does."""

from __future__ import annotations

from typing import Any

from celery import Celery
from celery.app.trace import build_tracer

BACKEND = "celery_fenced.backends:FencedDatabaseBackend"


def fenced_app(name: str) -> Celery:
    """A Celery app of its own whose results go to the fenced result backend."""
    app = Celery(name, set_as_current=False, broker="memory://", backend=BACKEND)
    app.conf.task_default_queue = name
    return app


def trace(task: Any, task_id: str, *args: Any, **kwargs: Any) -> Any:
    """Run ``task`` as the worker would: its request pushed, its result stored, released.

    Returns the tracer's ``(retval, info, ...)`` tuple; ``info`` is None on success.
    """
    tracer = build_tracer(task.name, task, app=task.app, hostname="w@tests")
    request = {"id": task_id, "delivery_info": {"routing_key": task.app.conf.task_default_queue}}
    return tracer(task_id, list(args), kwargs, request)
