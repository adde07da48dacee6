"""The lease held by the code running in this thread or context, and what it is sending."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from celery_fenced.store import HeldLease

#: the lease of the fenced task running in this context (set by the task while it runs)
current_lease_var: ContextVar[HeldLease | None] = ContextVar(
    "celery_fenced_current_lease", default=None
)
#: (alias, key, token) of the guard() transactions open in this context (set by the store)
open_guards: ContextVar[tuple[tuple[str, str, int], ...]] = ContextVar(
    "celery_fenced_guards", default=()
)

#: the lease whose atomic body runs in this context, its transaction open (set by
#: :func:`celery_fenced.atomic.run_body` around the body's call)
atomic_body_lease: ContextVar[HeldLease | None] = ContextVar(
    "celery_fenced_atomic_body", default=None
)


@contextlib.contextmanager
def in_atomic_body(lease: HeldLease) -> Iterator[None]:
    """Inside it, the body running in this context is ``lease``'s atomic body."""
    marker = atomic_body_lease.set(lease)
    try:
        yield
    finally:
        atomic_body_lease.reset(marker)


def current_lease() -> HeldLease | None:
    """The lease held by the fenced task running in this thread/context, or ``None``."""
    return current_lease_var.get()


#: set while the package sends a job whose publish it has already decided (a fenced
#: task's own ``apply_async``, a recorded job sent again): the app's ``send_task`` sends
#: it as Celery does, never taking it for a new publish by task name
_decided: ContextVar[bool] = ContextVar("celery_fenced_sending_decided", default=False)


@contextlib.contextmanager
def sending_decided() -> Iterator[None]:
    """Inside it, what reaches the app's ``send_task`` is a publish already decided."""
    marker = _decided.set(True)
    try:
        yield
    finally:
        _decided.reset(marker)


def is_sending_decided() -> bool:
    return _decided.get()
