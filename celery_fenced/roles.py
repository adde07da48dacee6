"""Whether a task or a result backend is celery-fenced's, asked without importing its class.

:class:`~celery_fenced.execution.FencedExecution` sets ``celery_fenced_task`` and
:class:`~celery_fenced.backends.FencedDatabaseBackend` sets ``celery_fenced_backend`` (class
attributes, so every subclass has them); the modules those classes import (the outbox,
the task's own parts, the startup checks) ask through these functions, so that no import
runs back up to the classes.
"""

from __future__ import annotations

from typing import Any


def is_fenced_task(task: Any) -> bool:
    """Whether ``task`` is a :class:`~celery_fenced.execution.FencedExecution`."""
    return getattr(task, "celery_fenced_task", False) is True


def is_fenced_backend(backend: Any) -> bool:
    """Whether ``backend`` (an instance or a class) is a
    :class:`~celery_fenced.backends.FencedDatabaseBackend`."""
    return getattr(backend, "celery_fenced_backend", False) is True
