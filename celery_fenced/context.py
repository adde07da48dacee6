"""The lease held by the code running in this thread or context."""

from __future__ import annotations

from contextvars import ContextVar
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from celery_fenced.store import HeldLease

_current: ContextVar[HeldLease | None] = ContextVar("celery_fenced_current_lease", default=None)
# (alias, key, token) of the guard() transactions open in this context
_guards: ContextVar[tuple[tuple[str, str, int], ...]] = ContextVar(
    "celery_fenced_guards", default=()
)


def current_lease() -> HeldLease | None:
    """The lease held by the fenced task running in this thread/context, or ``None``."""
    return _current.get()
