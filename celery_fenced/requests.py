"""The worker's request of a fenced task: it tells the backend which process ended.

The worker's main process reports the end of an execution it did not run (a hard time
limit, a lost pool child, a revoke) to the result backend with the request's context.
That context names the worker but not the pool process; this request class adds it, as
an object a message cannot forge, so the backend ends only that process's grant.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from celery.worker.request import Request


@dataclass(frozen=True)
class EndedProcess:
    """The pool process an execution ran in, as the prefix of its lease owners.

    ``owner_prefix`` is None for a delivery that never started (expired, revoked before
    it ran): it held no grant.
    """

    owner_prefix: str | None


class FencedRequestMixin:
    """Adds the executing process to the context the main process reports with."""

    worker_pid: int | None
    hostname: str

    @property
    def _context(self) -> Any:
        context = Request._context.__get__(self, type(self))  # type: ignore[attr-defined]
        pid = self.worker_pid
        context._fenced_process = EndedProcess(f"{self.hostname}:{pid}:" if pid else None)
        return context


class FencedRequest(FencedRequestMixin, Request):  # type: ignore[misc]
    """Celery's worker request, for fenced tasks."""


def request_class_for(base: Any) -> Any:
    """The fenced request class over a task's own ``Request`` (a class or its path)."""
    from celery.utils.imports import symbol_by_name

    cls = symbol_by_name(base)
    if cls is Request:
        return FencedRequest
    if issubclass(cls, FencedRequestMixin):
        return cls
    return type(f"Fenced{cls.__name__}", (FencedRequestMixin, cls), {})
