"""Tasks of the chaos runner (``python -m tests.chaos``).

Loaded by the chaos workers with ``--include testproject.demo.chaos_tasks``. The single-task
jobs apply one fenced effect each; two ways in:

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

The jobs at Celery's seams (chains, chords, ``link``/``link_error`` callbacks, time limits,
``track_started``, ``expires``, two jobs on one key: ``tests/chaos_workload.py``) run
``chaos.step`` and friends, which leave their evidence in an append-only trace table,
``demo_chaos_trace`` (created by :func:`create_trace_table`, raw SQL: it is the chaos runner's,
not the demo app's): a ``run`` row each time a body starts (task id, job, step, the fencing
token, the value received) and a ``sent`` row each time an execution publishes a message
(a chain step, a callback, an errback, a chord body, a retry), naming the sending execution
and its token.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass
from typing import Any

from celery import shared_task, signature
from celery._state import get_current_task
from celery.exceptions import Retry
from celery.signals import after_task_publish
from django.db import InterfaceError, OperationalError, connections, transaction
from django.db.models import Exists, F, Subquery
from django.db.models.functions import Now

from celery_fenced import (
    FencedTask,
    LeaseBusy,
    LeaseLost,
    StaleToken,
    current_lease,
    fenced_update,
    force_release,
)
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
def guarded(self: Any, job: str, seconds: float = 0.0, nested: bool = False) -> dict[str, Any]:
    """Work for ``seconds``, then append the job's ledger row under the lease's guard.

    ``nested``: first call itself directly, as a body may, for a job of its own
    (``<job>.nested``): that call runs under a grant of its own key, and this execution's
    write and result stay under its own grant. The nested job's outcome is not checked,
    only that nothing it wrote was stale; a pause that fences it out ends it alone.
    """
    if nested:
        with contextlib.suppress(LeaseBusy, LeaseLost, StaleToken, Retry):
            guarded(f"{job}.nested")
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


# -- the seams: chains, chords, callbacks, time limits, expires, one key for two jobs ------
TRACE = "demo_chaos_trace"
#: how long a ``sent`` row waits for the database (a PostgreSQL restart) before giving up
SENT_PATIENCE = 60.0
#: set by the chaos runner, which creates the table (other tests load these tasks too)
TRACING = os.environ.get("FENCED_CHAOS_TRACE") == "1"
#: the ``owner`` of a ``sent`` row published by a worker's main process (no execution)
MAIN_PROCESS = "main-process"


@dataclass(frozen=True)
class Trace:
    """A row of the trace table: a body run, or a message sent by an execution.

    ``run``: ``task_id`` is the execution's task id, ``parent_id`` its request's parent,
    ``token`` its fencing token (None for a plain task), ``value`` what it received.
    ``sent``: ``task_id`` is the message's id and ``name`` its task, ``parent_id`` the
    sending execution's task id and ``token`` that execution's token, ``value`` the
    message's first argument, ``retries`` the message's retry count.
    """

    id: int
    kind: str
    name: str
    job: str
    step: int
    task_id: str
    parent_id: str
    token: int | None
    owner: str
    worker: str
    retries: int
    value: Any
    written_at: Any


def create_trace_table(using: str = "default") -> None:
    """Create the trace table (PostgreSQL for the runner; SQLite too, for the checker's tests)."""
    connection = connections[using]
    if connection.vendor == "postgresql":
        ident, stamp = "BIGSERIAL PRIMARY KEY", "TIMESTAMPTZ DEFAULT statement_timestamp()"
    else:
        ident, stamp = "INTEGER PRIMARY KEY AUTOINCREMENT", "TEXT DEFAULT CURRENT_TIMESTAMP"
    with connection.cursor() as cursor:
        cursor.execute(
            f"CREATE TABLE IF NOT EXISTS {TRACE} (id {ident}, kind VARCHAR(10) NOT NULL, "
            "name VARCHAR(100) NOT NULL, job VARCHAR(100) NOT NULL, step INTEGER NOT NULL, "
            "task_id VARCHAR(255) NOT NULL, parent_id VARCHAR(255) NOT NULL, token BIGINT, "
            "owner VARCHAR(255) NOT NULL, worker VARCHAR(255) NOT NULL, "
            f"retries INTEGER NOT NULL, value TEXT NOT NULL, written_at {stamp})"
        )


def record(trace: Trace, using: str = "default") -> None:
    """Append ``trace`` (its ``id`` and ``written_at`` are the database's)."""
    with connections[using].cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {TRACE} (kind, name, job, step, task_id, parent_id, token, owner, "
            "worker, retries, value) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
            [
                trace.kind,
                trace.name,
                trace.job,
                trace.step,
                trace.task_id,
                trace.parent_id,
                trace.token,
                trace.owner,
                trace.worker,
                trace.retries,
                json.dumps(trace.value, sort_keys=True),
            ],
        )


def read_trace(using: str = "default") -> list[Trace]:
    with connections[using].cursor() as cursor:
        cursor.execute(
            "SELECT id, kind, name, job, step, task_id, parent_id, token, owner, worker, "
            f"retries, value, written_at FROM {TRACE} ORDER BY id"
        )
        rows = cursor.fetchall()
    return [Trace(*row[:11], json.loads(row[11]), row[12]) for row in rows]


def _trace_run(task: Any, job: str, step: int, value: Any) -> None:
    """The body's first act: a ``run`` row (a database error here retries the task)."""
    request = task.request
    lease = current_lease()
    record(
        Trace(
            0,
            "run",
            task.name,
            job,
            step,
            request.id or "",
            request.parent_id or "",
            lease.token if lease is not None else None,
            lease.owner if lease is not None else "",
            _worker(),
            int(request.retries or 0),
            value,
            None,
        )
    )


@after_task_publish.connect(weak=False, dispatch_uid="chaos.trace_sent")
def _trace_sent(sender: Any = None, headers: Any = None, body: Any = None, **_: Any) -> None:
    """A ``sent`` row for every message a chaos execution publishes, naming its token.

    Runs in the sending thread right after the publish, while the tracer still has the
    sending task current (chain steps and ``link`` callbacks go out after the body, errbacks
    and chord bodies while its result is stored). Waits out a database restart.
    """
    task = get_current_task()
    if not TRACING or not headers:
        return
    args = body[0] if isinstance(body, (list, tuple)) and body else []
    if task is None:
        # no execution sending: the worker's main process reporting the end of a pool
        # process (a hard time limit), which sends the errbacks on its behalf
        sending, token, owner = headers.get("parent_id"), None, MAIN_PROCESS
        sent_task = str(headers.get("task", sender))
        if not (os.environ.get("FENCED_WORKER_NAME") and sent_task.startswith("chaos.")):
            return  # a producer's own send (the runner, the reclaimer)
    else:
        if not str(getattr(task, "name", "")).startswith("chaos."):
            return
        request = task.request
        lease = getattr(task, "lease", None)  # a fenced task's held lease (the public handle)
        sending, token = request.id, getattr(request, "fencing_token", None)
        owner = lease.owner if lease is not None else ""
    if not sending:
        return
    trace = Trace(
        0,
        "sent",
        str(headers.get("task", sender)),
        "",
        0,
        str(headers.get("id", "")),
        str(sending),
        token,
        owner,
        _worker(),
        int(headers.get("retries") or 0),
        args[0] if args else None,
        None,
    )
    deadline = time.monotonic() + SENT_PATIENCE
    while True:
        try:
            with transaction.atomic():  # a savepoint inside the chord counter's transaction
                record(trace)
            return
        except (OperationalError, InterfaceError):
            if connections["default"].in_atomic_block or time.monotonic() > deadline:
                raise
            with contextlib.suppress(Exception):
                connections["default"].close()
            time.sleep(0.5)


def _returned(task: Any, job: str, step: int) -> dict[str, Any]:
    """What a step returns: who it was, so a successor can tell which execution sent it."""
    lease = current_lease()
    return {
        "job": job,
        "step": step,
        "task_id": task.request.id,
        "token": lease.token if lease is not None else None,
    }


def _sabotage(task: Any, value: dict[str, Any]) -> None:
    """``--sabotage``: drive what a stale or finished execution must not, for the checker.

    A chain step sends its successor a second time, a ``link`` parent sends its errback
    although it succeeds, a chord header sends the body early, and a step of a time-limit
    or ``expires`` job ends its own grant as a worker's revoke would, then goes on.
    """
    request = task.request
    if request.chain:
        signature(request.chain[-1], app=task.app).apply_async((value,))
    if request.errbacks:
        signature(request.errbacks[0], app=task.app).apply_async((request.id,))
    if request.chord:
        signature(request.chord, app=task.app).apply_async(([value],))
    if str(value["job"]).endswith(("-limit", "-expires")) and task.lease is not None:
        force_release(task.lease.key, by="worker:revoked")


def _step(task: Any, value: Any, job: str, step: int, seconds: float, fail: bool) -> Any:
    _trace_run(task, job, step, value)
    _work(seconds)
    if fail:
        raise ValueError(f"{job} step {step} fails on purpose (its errback must fire)")
    returned = _returned(task, job, step)
    if SABOTAGE:
        _sabotage(task, returned)
    return returned


FENCED_STEP: dict[str, Any] = {
    "bind": True,
    "base": FencedTask,
    "lease_ttl": TTL,
    "lease_reclaim": True,
    **RETRY,
}


#: plain tasks acknowledge late too: a worker killed while running one loses no message
PLAIN: dict[str, Any] = {"bind": True, "acks_late": True, "reject_on_worker_lost": True, **RETRY}


@shared_task(name="chaos.step", lease_key="step:{job}:{step}", **FENCED_STEP)
def step(
    self: Any, value: Any, job: str, step: int, seconds: float = 0.0, fail: bool = False
) -> Any:
    """A fenced step: a chain link, a chord header, a ``link`` parent, a time-limit job."""
    return _step(self, value, job, step, seconds, fail)


@shared_task(
    name="chaos.tracked_step", lease_key="tracked:{job}:{step}", track_started=True, **FENCED_STEP
)
def tracked_step(
    self: Any, value: Any, job: str, step: int, seconds: float = 0.0, fail: bool = False
) -> Any:
    """``chaos.step`` with ``track_started=True`` (a STARTED state written before the grant)."""
    return _step(self, value, job, step, seconds, fail)


#: lease_unique rests on the outbox: a run without it (``--no-outbox``) queues every copy
UNIQUE = None if os.environ.get("FENCED_OUTBOX") == "0" else "until_done"


@shared_task(
    name="chaos.unique_step", lease_key="unique:{job}:{parts}", lease_unique=UNIQUE, **FENCED_STEP
)
def unique_step(self: Any, value: Any, job: str, seconds: float = 0.0, parts: Any = ()) -> Any:
    """A fenced step queued once while a copy waits or runs (``lease_unique``); its key
    names ``parts``, a tuple the runner passes (a list once the message is decoded)."""
    return _step(self, value, job, 0, seconds, False)


#: how many times a replace job's task runs: it replaces itself until then
POLLS = 3


@shared_task(name="chaos.poll_step", lease_key="poll:{job}", **FENCED_STEP)
def poll_step(self: Any, value: Any, job: str, seconds: float = 0.0) -> Any:
    """A polling loop: replaces itself with its own signature (the same task id, name and
    arguments) until Celery has counted ``POLLS - 1`` replacements; its value names the
    last one's count (its ``step``)."""
    nesting = int(getattr(self.request, "replaced_task_nesting", 0) or 0)
    _trace_run(self, job, nesting, value)
    _work(seconds)
    if nesting < POLLS - 1:  # on the queue it came from (a replacement takes the default's)
        queue = (self.request.delivery_info or {}).get("routing_key")
        return self.replace(self.si(value, job, seconds).set(queue=queue))
    return _returned(self, job, nesting)


#: permits of one key in the permits workload (``lease_limit``)
PERMITS = 2


@shared_task(
    name="chaos.permit_step", lease_key="permits:{group}", lease_limit=PERMITS, **FENCED_STEP
)
def permit_step(self: Any, value: Any, group: str, job: str, seconds: float = 0.0) -> Any:
    """A fenced step holding one of the ``PERMITS`` permits of its group's key."""
    return _step(self, value, job, 0, seconds, False)


@shared_task(name="chaos.fenced_body", lease_key="body:{job}", **FENCED_STEP)
def fenced_body(self: Any, results: Any, job: str) -> Any:
    """A fenced chord body: receives the header's results."""
    return _step(self, results, job, 99, 0.0, False)


@shared_task(name="chaos.body", **PLAIN)
def body(self: Any, results: Any, job: str) -> Any:
    """A plain chord body."""
    return _step(self, results, job, 99, 0.0, False)


@shared_task(name="chaos.callback", **PLAIN)
def callback(self: Any, value: Any, job: str) -> Any:
    """A plain ``link`` callback: receives the parent's return value."""
    return _step(self, value, job, 100, 0.0, False)


@shared_task(name="chaos.errback", **PLAIN)
def errback(self: Any, task_id: str, *, job: str = "") -> Any:
    """A plain ``link_error`` callback, called the old way (one positional: the task id)."""
    return _step(self, task_id, job, 101, 0.0, False)


# -- atomic jobs: a task fenced by configuration alone, its body in one transaction --------
def atomic_child_id(parent_id: str, token: int) -> str:
    """The task id of the child an atomic execution publishes: one per execution (a stale
    execution's child, were it ever sent, has an id of its own, never the current one's)."""
    return f"{parent_id}-child-{token}"


@shared_task(bind=True, name="chaos.atomic", **RETRY)
def atomic(
    self: Any, job: str, slot: str, seconds: float = 0.0, cut: bool = False
) -> dict[str, Any]:
    """Fenced by configuration with ``"atomic": True`` and never naming its token for a
    write: a plain ``QuerySet.update()`` of the job's :class:`ChaosSlot`, a ledger row
    (``via="atomic"``, the execution's token) and a plain child task, published. Only an
    execution whose token is current when the body's transaction commits leaves any of it.

    ``cut``: the first grant's execution (token 1) has its database session ended as it
    returns, so that its settle meets the ended session (a dropped link at that instant):
    nothing of it commits, and the job must run again.
    """
    _work(seconds)
    lease = current_lease()
    if lease is None:
        raise RuntimeError("chaos.atomic must run fenced: name it in FENCED_TASKS_JSON")
    ChaosSlot.objects.filter(job=slot).update(applied=F("applied") + 1)
    _append(job, lease, "atomic", self.request.id or "")
    parent_id = self.request.id or ""
    atomic_child.apply_async(
        ({"parent": parent_id, "token": lease.token}, job),
        task_id=atomic_child_id(parent_id, lease.token),
        queue=(self.request.delivery_info or {}).get("routing_key"),
    )
    if cut and lease.token == 1:
        _end_own_session()
    return _outcome(job, lease, True)


def _end_own_session() -> None:
    """The server ends this thread's PostgreSQL session (from a connection of its own);
    returns once it is gone."""
    import psycopg

    connection = connections["default"]
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        (pid,) = cursor.fetchone()
    info = connection.connection.info
    with psycopg.connect(
        host=info.host,
        port=info.port,
        user=info.user,
        password=info.password or None,
        dbname=info.dbname,
        autocommit=True,
    ) as side:
        side.execute("SELECT pg_terminate_backend(%s)", [pid])
        deadline = time.monotonic() + 10
        while side.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", [pid]).fetchone():
            if time.monotonic() > deadline:
                raise RuntimeError(f"session {pid} was not ended")
            time.sleep(0.01)


@shared_task(name="chaos.atomic_child", **PLAIN)
def atomic_child(self: Any, value: Any, job: str) -> Any:
    """The plain child of an atomic job: its ``run`` row names the sending execution."""
    return _step(self, value, job, 1, 0.0, False)
