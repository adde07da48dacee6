"""The worker's request of a fenced task: it tells the backend which process ended.

The worker's main process reports the end of an execution it did not run (a hard time
limit, a lost pool child, a revoke) to the result backend with the request's context.
That context names the worker but not the pool process; this request class adds it, as
an object a message cannot forge (the ``process`` of the context's
:class:`~celery_fenced.request_state.RequestState`), so the backend ends only that
process's grant.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field, replace
from typing import Any

from celery.utils.imports import symbol_by_name
from celery.worker.request import Request

from celery_fenced import owners
from celery_fenced.request_state import carry, state_of

_claims = threading.Lock()


@dataclass(frozen=True)
class EndedProcess:
    """The pool process an execution ran in, as the prefix of its lease owners
    (``host:boot:pid:``, see :mod:`celery_fenced.owners`).

    ``owner_prefix`` is None for a delivery that never started (expired, revoked before
    it ran): it held no grant; and for an execution of an in-process pool (threads,
    solo), which ends its own grant.

    One per worker request: Celery reports a hard time limit twice (billiard's
    ``TimeoutHandler.on_hard_timeout`` sets the job's result, which calls
    ``Request.on_failure``, then runs ``Request.on_timeout``; both call
    ``mark_as_failure``), and one execution has one end — see :meth:`first_report`.
    """

    owner_prefix: str | None
    _reported: list[bool] = field(default_factory=list, compare=False, repr=False)

    def first_report(self) -> bool:
        """True the first time only: the report of this end that records it (the result,
        the errbacks, the chord count); a later one changes nothing."""
        with _claims:
            if self._reported:
                return False
            self._reported.append(True)
            return True


class FencedRequestMixin:
    """Adds the executing process to the context the main process reports with."""

    worker_pid: int | None
    hostname: str

    @property
    def _context(self) -> Any:
        context = Request._context.__get__(self, type(self))  # type: ignore[attr-defined]
        pid = self.worker_pid
        # A pool that runs executions in this very process (threads, solo) reports this
        # process's pid, which names every execution of the worker: there the execution
        # ends its grant itself, and the report ends none.
        separate = bool(pid) and pid != os.getpid()
        # the process of this worker start (see celery_fenced.owners): a process of
        # another worker of the same node name, or of this one's previous start, may have
        # the same pid
        prefix = owners.process_prefix(self.hostname, pid) if separate and pid else None
        # the same object for every report of this request's end (see EndedProcess),
        # kept in this request's own state
        ended = state_of(self).process
        if ended is None or ended.owner_prefix != prefix:
            ended = EndedProcess(prefix)
            carry(self, replace(state_of(self), process=ended))
        carry(context, replace(state_of(context), process=ended))
        return context


class FencedRequest(FencedRequestMixin, Request):  # type: ignore[misc]
    """Celery's worker request, for fenced tasks."""


def request_class_for(base: Any) -> Any:
    """The fenced request class over a task's own ``Request`` (a class or its path)."""
    cls = symbol_by_name(base)
    if cls is Request:
        return FencedRequest
    if issubclass(cls, FencedRequestMixin):
        return cls
    return type(f"Fenced{cls.__name__}", (FencedRequestMixin, cls), {})


def fence_request_class(task: Any) -> None:
    """Give a fenced task the fenced request over its own ``Request`` (at worker start).

    A task of the base class that names its own ``Request`` (``@app.task(base=FencedTask,
    Request=MyRequest)``) would otherwise lose the fenced one: the main process's reports
    of its hard time limits and lost children could then not tell which grant ended, and
    would record nothing.
    """
    cls = type(task)
    current = getattr(cls, "Request", None) or Request
    fenced = request_class_for(current)
    if fenced is not current:
        cls.Request = fenced
