"""What a lease was about: its job's task and arguments, from wherever they are kept.

A default key is a hash, so the key alone does not tell an operator which record a job
worked on. The lease row keeps its job (``Lease.job``, for the reclaimer) only while
its grant is unreleased and re-sendable; afterwards the arguments are kept, if at all,
by the outbox (a job waiting to be sent again, or a ``lease_unique`` job kept until it
is done) or by the task's result (django-celery-results with ``result_extended``). The
lease events do not record arguments.
"""

from __future__ import annotations

import ast
import json
import reprlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from django.apps import apps

from celery_fenced import operations, reclaim
from celery_fenced.models import Lease

#: where a job's arguments were found
FROM_LEASE = "recorded with the grant"
FROM_OUTBOX = "pending in the outbox"
FROM_RESULT = "from its task result"

#: the longest call shown (the lease page, a tooltip); a list column shows less
CALL_LIMIT = 300
#: the longest argument repr read back from a task result (``ast.literal_eval``)
LITERAL_LIMIT = 4096

NOT_KEPT = (
    "not kept: the lease row keeps its job only while the grant is held (with reclaim "
    "on); keep the arguments of finished tasks in their results with result_extended"
)

_repr = reprlib.Repr()
_repr.maxstring = 40
_repr.maxother = 40
_repr.maxlist = _repr.maxtuple = _repr.maxdict = _repr.maxset = 6
_repr.maxlevel = 3


@dataclass(frozen=True)
class JobSummary:
    """A job as an operator reads it: ``billing.tasks.send(2024, 7, dry_run=False)``."""

    task: str
    arguments: str  # inside the parentheses, values cut by reprlib
    source: str  # where they were found: FROM_LEASE, FROM_OUTBOX or FROM_RESULT

    @property
    def call(self) -> str:
        return cut(f"{self.task}({self.arguments})", CALL_LIMIT)

    def short_call(self, limit: int) -> str:
        """The call with the task's last name only (``send(2024, 7)``), cut at ``limit``."""
        return cut(f"{self.task.rsplit('.', 1)[-1]}({self.arguments})", limit)


def cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[: limit - 1]}…"


def arguments(args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
    """``1, 'a', flag=True``: each value's repr, long ones cut."""
    parts = [_repr.repr(value) for value in args]
    parts += [f"{name}={_repr.repr(value)}" for name, value in kwargs.items()]
    return ", ".join(parts)


def from_job(text: str | None, source: str) -> JobSummary | None:
    """The summary of a recorded job (``Lease.job``, ``PendingJob.job``), or None."""
    if not text:
        return None
    try:
        job = reclaim.decode_job(text)
    except ValueError:
        return None
    return JobSummary(job.task, arguments(job.args, job.kwargs), source)


def from_result(task: str, task_args: str | None, task_kwargs: str | None) -> JobSummary | None:
    """The summary of a task result's arguments (``TaskResult.task_args`` and
    ``task_kwargs``: JSON of Celery's ``argsrepr``/``kwargsrepr``), or None when the
    result kept none (no ``result_extended``) or in a serialization other than JSON."""
    if task_args is None and task_kwargs is None:
        return None
    args, kwargs = _decoded(task_args), _decoded(task_kwargs)
    if args is _UNREADABLE or kwargs is _UNREADABLE:
        return None
    parts = [text for text in (_inside(args, False), _inside(kwargs, True)) if text]
    return JobSummary(task, ", ".join(parts), FROM_RESULT)


_UNREADABLE = object()


def _decoded(text: str | None) -> Any:
    """A stored repr read back as Python values when it is a literal, else the repr."""
    if text is None:
        return ()
    try:
        value = json.loads(text)
    except ValueError:
        return _UNREADABLE
    if value is None:
        return ()
    if isinstance(value, str) and len(value) <= LITERAL_LIMIT:
        try:
            return ast.literal_eval(value)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return value
    return value


def _inside(value: Any, named: bool) -> str:
    """What goes inside the call's parentheses for decoded args (``named``: kwargs)."""
    if named and isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return arguments((), value)
    if not named and isinstance(value, (list, tuple)):
        return arguments(value, {})
    text = str(value).strip()  # a repr that is no literal (an object's, a cut one)
    if len(text) >= 2 and text[0] + text[-1] in ("()", "[]", "{}"):
        text = text[1:-1]
    return cut(text, CALL_LIMIT)


def summaries(leases: Iterable[Lease]) -> dict[int, JobSummary]:
    """The job of each lease whose job is known, by primary key, in at most three reads
    for a page of leases: the rows' own jobs, then the outbox, then the task results."""
    found: dict[int, JobSummary] = {}
    unknown: dict[str, list[Lease]] = {}
    alias = None
    for lease in leases:
        alias = lease._state.db
        summary = from_job(lease.job, FROM_LEASE)
        if summary is not None:
            found[lease.pk] = summary
        elif lease.task_id:
            unknown.setdefault(lease.task_id, []).append(lease)
    if unknown:
        for task_id, text in operations.pending_jobs(unknown, using=alias).items():
            summary = from_job(text, FROM_OUTBOX)
            if summary is not None:
                found.update((lease.pk, summary) for lease in unknown.pop(task_id))
    if unknown and apps.is_installed("django_celery_results"):
        model = apps.get_model("django_celery_results", "TaskResult")
        rows = model._default_manager.filter(task_id__in=sorted(unknown)).values_list(
            "task_id", "task_name", "task_args", "task_kwargs"
        )
        for task_id, task_name, task_args, task_kwargs in rows:
            for lease in unknown.get(task_id, ()):
                summary = from_result(task_name or lease.task_name, task_args, task_kwargs)
                if summary is not None:
                    found[lease.pk] = summary
    return found


#: where :func:`attach` leaves a lease's job (None: not known)
_ATTRIBUTE = "_fenced_job_summary"


def attach(leases: Sequence[Lease]) -> None:
    """Look the jobs of a page of leases up at once (:func:`summaries`) for :func:`of`."""
    found = summaries(leases)
    for lease in leases:
        setattr(lease, _ATTRIBUTE, found.get(lease.pk))


def of(lease: Lease) -> JobSummary | None:
    """The job of ``lease`` (looked up now unless :func:`attach` did), or None."""
    if not hasattr(lease, _ATTRIBUTE):
        attach([lease])
    summary: JobSummary | None = getattr(lease, _ATTRIBUTE)
    return summary
