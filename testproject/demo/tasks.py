"""Demo tasks: one fenced by the base class, one plain task fenced through settings."""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

from celery import shared_task
from celery.worker.request import Request
from django.db.models import F, Value
from django.db.models.functions import Concat

from celery_fenced import FencedTask, acquire, current_lease, fenced_update
from celery_fenced.models import Lease
from testproject.demo.models import LedgerEntry, Report


def _worker() -> str:
    return os.environ.get("FENCED_WORKER_NAME", f"pid{os.getpid()}")


def _rebuild(task: Any, report_id: int, seconds: float) -> dict[str, Any]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.05)
    token = task.request.fencing_token
    worker = _worker()
    fenced_update(
        Report.objects.filter(pk=report_id),
        token=token,
        body=f"built by {worker} under token {token}",
        built_by=worker,
    )
    return {"worker": worker, "token": token, "lost": task.lease.lost}


@shared_task(bind=True, base=FencedTask, lease_key="report:{report_id}", lease_ttl=30)
def rebuild_report(self: Any, report_id: int, seconds: float = 0.0) -> dict[str, Any]:
    """Rebuild report ``report_id`` (taking ``seconds``) and write it fenced."""
    return _rebuild(self, report_id, seconds)


@shared_task(bind=True, base=FencedTask, lease_key="descend:{n}", lease_ttl=30)
def descend(self: Any, n: int, take_over: bool = False) -> dict[str, Any]:
    """Call itself directly on ``n - 1`` (for the tests); ``take_over``: then let another
    holder take this execution's key over, as if its grant had run out meanwhile."""
    if n > 0:
        descend(n - 1)
        if take_over:
            mine = Lease.objects.filter(key=self.request.lease_key)
            mine.update(expires_at=F("acquired_at"))
            acquire(self.request.lease_key, ttl=30, task_id="took-over")
    return {"n": n, "key": self.request.lease_key, "token": self.request.fencing_token}


@shared_task(
    bind=True, base=FencedTask, lease_key="report:{report_id}", lease_ttl=2, lease_reclaim=True
)
def rebuild_report_short(self: Any, report_id: int, seconds: float = 0.0) -> dict[str, Any]:
    """``rebuild_report`` with a 2-second lease: the tests pause workers past it."""
    return _rebuild(self, report_id, seconds)


@shared_task
def apply_effect(job: str, effect: str, seconds: float = 0.0) -> dict[str, Any]:
    """A plain task (no base class): fenced when CELERY_FENCED_TASKS names it."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.05)
    lease = current_lease()
    token = lease.token if lease is not None else 0
    if lease is not None:
        with lease.guard():
            LedgerEntry.objects.create(job=job, effect=effect, token=token, worker=_worker())
    else:
        LedgerEntry.objects.create(job=job, effect=effect, token=token, worker=_worker())
    return {"worker": _worker(), "token": token}


@shared_task(bind=True, base=FencedTask, lease_ttl=30)
def probe(self: Any, seconds: float = 0.0, marker: str = "") -> dict[str, Any]:
    """Report what the execution sees: token, key, lost state (for the tests)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.05)
    lost = False
    try:
        self.lease.check()
    except Exception:
        lost = True
    return {
        "worker": _worker(),
        "token": self.request.fencing_token,
        "key": self.request.lease_key,
        "current_token": current_lease().token if current_lease() else None,
        "lost": lost,
        "marker": marker,
    }


@shared_task(
    bind=True,
    base=FencedTask,
    lease_key="digest:{name}",
    lease_ttl=30,
    # lease_unique rests on the outbox: a run with it off (FENCED_OUTBOX=0) has none
    lease_unique=None if os.environ.get("FENCED_OUTBOX") == "0" else "until_done",
)
def send_digest(self: Any, name: str, until_file: str = "") -> dict[str, Any]:
    """A job queued once per name (``lease_unique``): it runs until ``until_file`` exists."""
    deadline = time.monotonic() + 60
    while until_file and not os.path.exists(until_file) and time.monotonic() < deadline:
        time.sleep(0.05)
    return {"worker": _worker(), "token": self.request.fencing_token, "name": name}


# a 6 s ttl, renewed while a body runs: a job refused as busy is retried when the first
# permit would expire, within 6 s (the permits test waited out 30)
@shared_task(bind=True, base=FencedTask, lease_key="tiles", lease_ttl=6, lease_limit=3)
def render_tile(self: Any, tile: int, until_file: str = "") -> dict[str, Any]:
    """Up to three tiles at once (``lease_limit=3``, each with a permit of the key "tiles"):
    returns how many bodies were running when it started; it runs until ``until_file``
    exists."""
    running = f"running:{self.request.id}"
    with self.lease.guard():
        LedgerEntry.objects.create(job="tiles", effect=running, token=self.request.fencing_token)
    at_once = LedgerEntry.objects.filter(job="tiles", effect__startswith="running:").count()
    deadline = time.monotonic() + 60
    while until_file and not os.path.exists(until_file) and time.monotonic() < deadline:
        time.sleep(0.05)
    with self.lease.guard():
        LedgerEntry.objects.filter(job="tiles", effect=running).delete()
    return {"tile": tile, "at_once": at_once, "token": self.request.fencing_token}


class AuditedRequest(Request):  # type: ignore[misc]
    """A project's own worker request class, as ``Request=`` on a fenced task."""


@shared_task(bind=True, base=FencedTask, lease_ttl=30, Request=AuditedRequest)
def probe_own_request(self: Any, seconds: float = 0.0, marker: str = "") -> dict[str, Any]:
    """``probe`` with a worker request class of its own."""
    return probe.run(seconds, marker)  # type: ignore[no-any-return]


@shared_task(
    bind=True,
    base=FencedTask,
    lease_key="batch:{ids}",
    lease_ttl=30,
    lease_unique=None if os.environ.get("FENCED_OUTBOX") == "0" else "until_done",
)
def sum_batch(self: Any, ids: Any) -> dict[str, Any]:
    """A job keyed by a collection argument, queued once per key: its key as it ran."""
    return {"key": self.request.lease_key, "token": self.request.fencing_token, "n": len(ids)}


@shared_task(bind=True, base=FencedTask, lease_ttl=30)
def poll(self: Any, label: str, until: int) -> Any:
    """The usual polling loop: it replaces itself with the same signature until it has
    polled ``until`` times (each poll a fenced ledger entry)."""
    with self.lease.guard():
        polls = LedgerEntry.objects.filter(job=label).count() + 1
        LedgerEntry.objects.create(
            job=label, effect=f"poll {polls}", token=self.request.fencing_token, worker=_worker()
        )
    if polls < until:  # on the queue it came from (a replacement takes the default's)
        queue = (self.request.delivery_info or {}).get("routing_key")
        return self.replace(poll.si(label, until).set(queue=queue))
    return {"label": label, "polls": polls}


@shared_task(bind=True)
def charge_invoice(self: Any, report_id: int, hold_dir: str = "") -> dict[str, Any]:
    """A plain task (no token in sight): a plain ``update()`` of the report and a plain
    child task. Fenced, and atomic, when CELERY_FENCED_TASKS says so. A worker named by a
    file ``hold-<worker>`` in ``hold_dir`` says it wrote (``wrote-<worker>``) and then
    waits in its body, its transaction open, until that file is gone."""
    worker = _worker()
    Report.objects.filter(pk=report_id).update(
        body=Concat(F("body"), Value(f"{worker};")), built_by=worker
    )
    queue = (self.request.delivery_info or {}).get("routing_key")
    record_charge.apply_async((report_id, worker), queue=queue)
    hold = os.path.join(hold_dir, f"hold-{worker}") if hold_dir else ""
    if hold and os.path.exists(hold):
        open(os.path.join(hold_dir, f"wrote-{worker}"), "w").close()
        deadline = time.monotonic() + 60
        while os.path.exists(hold) and time.monotonic() < deadline:
            time.sleep(0.05)
    return {"worker": worker}


@shared_task
def record_charge(report_id: int, by: str) -> None:
    """``charge_invoice``'s child: each run its own ledger row."""
    LedgerEntry.objects.create(
        job=f"charge:{report_id}", effect=f"child of {by} {uuid.uuid4().hex}", token=0
    )
