"""Tasks of the chaos runner (``python -m tests.chaos``): each job applies one fenced effect.

Loaded by the chaos workers with ``--include testproject.demo.chaos_tasks``. Two ways in:

- ``chaos.guarded``: a :class:`~celery_fenced.FencedTask` keyed ``chaos:{job}``; its effect
  is a :class:`~testproject.demo.models.ChaosEntry` row written inside ``self.lease.guard()``.
- ``chaos.configured``: a plain task, fenced through ``fenced_tasks`` (the runner names it
  in ``FENCED_TASKS_JSON``) with the default key; its effect is a ``fenced_update`` of the
  job's :class:`~testproject.demo.models.ChaosSlot` plus a ledger row, in one guard.

Both retry on database connection errors: a PostgreSQL restart cuts connections, and the
package does not retry a task body's database errors, so a job must say it may. Both
check, under the guard's lock, whether the job's effect is already in the ledger: a lease
gives at most one valid token at a time, not at-most-once execution, so a job that a
paused worker finished just before its lease expired is run again by the next holder,
which must find the effect applied and not apply it twice. A stale holder's write is refused by
the guard (``StaleToken``) before it reaches the table; the table itself enforces nothing.
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import shared_task
from django.db import InterfaceError, OperationalError, transaction
from django.db.models import Exists, F, Subquery
from django.db.models.functions import Now

from celery_fenced import FencedTask, current_lease, fenced_update
from celery_fenced.models import LeaseEvent
from celery_fenced.store import HeldLease
from testproject.demo.models import ChaosEntry, ChaosSlot

TTL = float(os.environ.get("FENCED_CHAOS_TTL", "2"))
#: ``python -m tests.chaos --sabotage``: write without fencing, to show the checker sees it
SABOTAGE = os.environ.get("FENCED_CHAOS_SABOTAGE") == "1"
#: a connection cut by the PostgreSQL restart is a transient error: the job is retried
#: (same task id; the retry takes a new grant and finds the effect applied or not)
RETRY = {
    "autoretry_for": (OperationalError, InterfaceError),
    "retry_kwargs": {"max_retries": 20, "countdown": 1},
}
GRANTS = ("acquired", "reclaimed")
ENDS = ("released", "force_released")


def _worker() -> str:
    return os.environ.get("FENCED_WORKER_NAME", f"pid{os.getpid()}")


def _work(seconds: float) -> None:
    """Take ``seconds`` of wall time in small steps, so a SIGSTOP lands inside the work."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(min(0.05, max(deadline - time.monotonic(), 0)))


def _append(job: str, lease: HeldLease, via: str, task_id: str) -> None:
    """Add the ledger row; the same statement reads the lease's events as the write sees them."""
    events = LeaseEvent.objects.filter(lease__key=lease.key)
    ChaosEntry.objects.create(
        job=job,
        lease_key=lease.key,
        token=lease.token,
        owner=lease.owner,
        worker=_worker(),
        task_id=task_id,
        via=via,
        written_at=Now(),
        grant_seen=Subquery(events.filter(kind__in=GRANTS).order_by("-token").values("token")[:1]),
        end_seen=Exists(events.filter(kind__in=ENDS, token=lease.token)),
    )


def _fenced(lease: HeldLease) -> Any:
    """The lease's guard; under ``--sabotage`` a plain transaction that proves nothing."""
    return transaction.atomic() if SABOTAGE else lease.guard()


def _outcome(job: str, lease: HeldLease, applied: bool) -> dict[str, Any]:
    return {
        "job": job,
        "key": lease.key,
        "token": lease.token,
        "worker": _worker(),
        "applied": applied,
    }


@shared_task(
    bind=True,
    base=FencedTask,
    name="chaos.guarded",
    lease_key="chaos:{job}",
    lease_ttl=TTL,
    lease_reclaim=True,
    **RETRY,
)
def guarded(self: Any, job: str, seconds: float = 0.0) -> dict[str, Any]:
    """Work for ``seconds``, then append the job's ledger row under the lease's guard."""
    _work(seconds)
    lease = self.lease
    with _fenced(lease):
        applied = not ChaosEntry.objects.filter(job=job).exists()
        if applied:
            _append(job, lease, "guard", self.request.id or "")
    return _outcome(job, lease, applied)


@shared_task(bind=True, name="chaos.configured", **RETRY)
def configured(self: Any, job: str, seconds: float = 0.0) -> dict[str, Any]:
    """Like ``guarded``, but fenced by configuration and writing with ``fenced_update``."""
    _work(seconds)
    lease = current_lease()
    if lease is None:
        raise RuntimeError("chaos.configured must run fenced: name it in FENCED_TASKS_JSON")
    with _fenced(lease):
        applied = not ChaosEntry.objects.filter(job=job).exists()
        if applied:
            slot = ChaosSlot.objects.filter(job=job)
            if SABOTAGE:
                slot.update(applied=F("applied") + 1, fencing_token=lease.token)
            else:
                fenced_update(slot, token=lease.token, applied=F("applied") + 1)
            _append(job, lease, "fenced_update", self.request.id or "")
    return _outcome(job, lease, applied)


@shared_task(bind=True, base=FencedTask, name="chaos.echo", lease_key="echo:{name}", lease_ttl=30)
def echo(self: Any, name: str, **extra: Any) -> dict[str, Any]:
    """What an execution sees; the security tests forge tokens in its headers and kwargs."""
    lease = current_lease()
    return {
        "token": self.request.fencing_token,
        "key": self.request.lease_key,
        "lease_token": lease.token if lease is not None else None,
        "extra": extra,
    }


@shared_task(
    bind=True,
    base=FencedTask,
    name="chaos.retry_then_fail",
    lease_key="chaos:{job}",
    lease_ttl=TTL,
)
def retry_then_fail(self: Any, job: str) -> dict[str, Any]:
    """First run: send the retry, then fail; the retry applies the effect.

    This is what a task does when the database goes away between its RETRY state write
    (which fails) and its FAILURE state write (which succeeds): the retry is already sent.
    """
    if not self.request.retries:
        self.retry(countdown=0.5, throw=False)
        raise RuntimeError("the retry is sent; this execution fails")
    lease = self.lease
    with lease.guard():
        _append(job, lease, "guard", self.request.id or "")
    return _outcome(job, lease, True)
