"""The outbox: a fenced job is recorded in the lease database when it is published.

``apply_async`` (and ``delay``) of a fenced task writes a pending row
(:class:`~celery_fenced.models.PendingJob`) holding what is needed to send the job
again, in the caller's transaction when one is open on the lease database, and sends the
message when that transaction commits: a rolled-back transaction sends nothing and
leaves nothing. The statement that grants the job's lease deletes the row, so a job is
pending, granted or finished, never nowhere. The reclaimer's sweep of the rows no worker
granted (:mod:`celery_fenced.pending`, through :mod:`celery_fenced.resend`) sends them
again with the same task id: a job lost by the broker (a worker killed between popping a
message and recording it, a broker restarted without persistence, a broker down at
publish time) still runs, once. How a publish is sent now (at once, recorded on commit,
as the running job again) is :mod:`celery_fenced.publish_modes`.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from celery.utils import uuid
from django.db import DatabaseError, connections
from kombu.exceptions import OperationalError

from celery_fenced import conf, jobs, keys, outages, results, signals, store
from celery_fenced.jobs import PLAIN_HEADER as PLAIN_HEADER
from celery_fenced.models import Lease
from celery_fenced.pending import Resent as Resent
from celery_fenced.pending import resend_pending as resend_pending
from celery_fenced.publish_modes import at_once_in_transaction as at_once_in_transaction
from celery_fenced.publish_modes import in_workflow, recording_plain_alias
from celery_fenced.publish_modes import is_same_job as is_same_job
from celery_fenced.publish_modes import plain_recording as plain_recording
from celery_fenced.publish_modes import plain_sends_recorded as plain_sends_recorded
from celery_fenced.publish_modes import same_job as same_job
from celery_fenced.publish_modes import sends_at_once as sends_at_once
from celery_fenced.publish_modes import unrecorded as unrecorded
from celery_fenced.roles import is_fenced_task

if TYPE_CHECKING:
    from celery.result import AsyncResult

logger = logging.getLogger(__name__)


def record_plain(
    app: Any,
    original: Callable[..., Any],
    alias: str,
    name: str,
    args: Any,
    kwargs: Any,
    options: dict[str, Any],
) -> Any:

    task_id = options.pop("task_id", None) or uuid()
    to_parent = options.pop("add_to_parent", True)
    args, kwargs = list(args or ()), dict(kwargs or {})
    held = _held_until_started(app, name)
    if held:
        headers = options.get("headers")
        options["headers"] = {**(headers if isinstance(headers, Mapping) else {}), PLAIN_HEADER: 1}
    pending = _row(app, name, args, kwargs, task_id, options, plain=True)
    # what the caller lent (a group's producer) is back in its pool by the commit
    kept = {k: v for k, v in options.items() if k not in ("producer", "result_cls")}
    handle = results.aware(options.get("result_cls") or app.AsyncResult)(task_id)
    if pending is None:  # JSON cannot carry it: sent on the commit, unrecorded
        result = _unrecorded(
            alias,
            name,
            handle,
            lambda: original(name, args, kwargs, task_id=task_id, add_to_parent=False, **kept),
        )
        return in_trail(app, result, to_parent)
    store.record_pending(alias, pending)

    # bounded publish retries, as Celery's tracer sends a task's callbacks
    retry_publish = getattr(app.amqp, "_retry_publish", None)

    def publish() -> None:
        if retry_publish is not None:
            retry_publish(
                original, name, args, kwargs, task_id=task_id, add_to_parent=False, **kept
            )
        else:
            original(name, args, kwargs, task_id=task_id, add_to_parent=False, **kept)

    def send() -> None:
        # held: its row stays until a worker starts the job (or, not started, the
        # reclaimer sends it again after ``fenced_outbox_resend_after``)
        if _sent_or_marked_unsent(alias, name, task_id, publish) and not held:
            _end_row(alias, task_id, "sent", f"{name}[{task_id}]")

    deferred = results.on_commit(alias, task_id, name, send)
    return in_trail(app, results.hold(handle, deferred), to_parent)


def in_trail(app: Any, result: Any, to_parent: bool) -> Any:
    """``result``, added to the sending task's children as Celery's ``send_task`` does:
    now, not at the commit."""
    if to_parent:
        parent = app.current_worker_task
        if parent is not None:
            parent.add_trail(result)
    return result


def _unrecorded(
    alias: str,
    name: str,
    result: Any,
    send_later: Callable[[], Any],
    send_now: Callable[[], Any] | None = None,
) -> Any:
    """A job that JSON cannot carry (pickled arguments), so the outbox cannot hold it.

    Inside the transaction that proves an execution's outcome (:func:`plain_sends_recorded`)
    it is sent when that transaction commits, as a recorded one is: an outcome settled
    again after a database restart sends it once, and a proof that never commits sends
    nothing — but a process that dies between the commit and the send loses it. Elsewhere
    ``send_now()``, as Celery sends it. Returns ``result``, the job's handle.
    """
    if send_now is not None and recording_plain_alias() != alias:
        return send_now()

    def send() -> None:
        try:
            send_later()
        except Exception:
            logger.exception(
                "task %s: not sent (the outbox could not hold it)",
                result.id,
                extra={"task_id": result.id},
            )

    return results.hold(result, results.on_commit(alias, result.id, name, send))


def _held_until_started(app: Any, name: str) -> bool:
    """Whether a recorded plain sending of task ``name`` stays in the outbox until a worker
    starts it: a plain task's (the worker's ``task_prerun`` ends it). A fenced task whose
    outbox is off (``fenced_outbox``/``lease_outbox``) reaches Celery's ``send_task``
    too: sent on the commit, its row ends once it is sent, as its own publishes keep none
    — fenced by its class here, or by ``fenced_tasks`` when this process does not have it
    registered (the worker that runs it fences it)."""
    task = app.tasks.get(name)
    if task is None:
        return conf.load(app).options_for(name) is None
    return not is_fenced_task(task)


def _end_row(alias: str, task_id: str, done: str, job: str = "") -> None:
    """End ``task_id``'s outbox row once the job (named ``job`` in the log) is ``done``
    ("sent", "started"), riding out a database that is away for a moment (a restart):
    a row left standing is a job the reclaimer sends again. Away for longer, it stands
    and the job may be sent again: at least once."""
    try:
        outages.attempt_through(
            lambda: store.forget_pending(alias, task_id),
            [alias],
            f"task {job or task_id}: {done}, its outbox row not ended yet",
            extra={"task_id": task_id},
        )
    except DatabaseError:
        logger.warning(
            "task %s: %s, but its outbox row could not be ended; the reclaimer may send it again",
            job or task_id,
            done,
            exc_info=True,
            extra={"task_id": task_id},
        )


def plain_job_started(task_id: str, request: Any) -> None:
    """A worker starts a plain task's job the outbox holds (its message carries
    :data:`PLAIN_HEADER`): its row ends — it is not sent again. Not ended (the database
    away), the reclaimer may send it again: a plain job is at least once."""
    if getattr(request, PLAIN_HEADER, None):
        _end_row(store.database_alias(), task_id, "started")


def _sent_or_marked_unsent(
    alias: str, name: str, task_id: str, publish: Callable[[], Any]
) -> bool:
    """``publish()`` a recorded job; refused (the broker down, an error), its row is
    marked unsent for the reclaimer's next sweep and the failure logged. Whether sent."""
    try:
        publish()
    except Exception as exc:
        refused = isinstance(exc, OperationalError | ConnectionError | TimeoutError)
        (logger.warning if refused else logger.error)(
            "task %s[%s]: recorded, but not sent (%r); the reclaimer sends it",
            name,
            task_id,
            exc,
            extra={"task_id": task_id},
        )
        try:
            store.mark_unsent(alias, task_id)
        except DatabaseError:
            logger.info("could not mark %s unsent", task_id, exc_info=True)
        return False
    return True


@dataclass(frozen=True)
class Publisher:
    """The fenced task a job is published for, as the outbox needs it: known by its task
    object (its ``apply_async``), or only by its name and the ``fenced_tasks`` setting
    (``app.send_task`` in a process that does not import it)."""

    app: Any
    name: str
    #: its ``lease_unique`` rule (None: none)
    unique: str | None
    #: the result handle of one of its jobs, by task id
    result: Callable[[str], AsyncResult[Any]]


def publish(
    task: Publisher,
    args: Sequence[Any] | None,
    kwargs: Mapping[str, Any] | None,
    task_id: str,
    options: Mapping[str, Any],
    send: Callable[[bool], AsyncResult[Any]],
    *,
    key: str,
) -> AsyncResult[Any]:
    """Record the job of ``task`` and ``send(deferred)`` it when the lease database commits.

    ``key``: the job's lease key, decided by the caller once for every copy of the job
    (empty when its arguments give none).

    ``deferred``: the send waits for the caller's transaction (what the call lent, a
    producer, may be gone by then).

    Returns the job's result handle at once — for a ``lease_unique`` job whose key has a
    copy queued (or running, ``until_done``), that copy's handle instead, and nothing is
    recorded or sent (a ``deduplicated`` event says so). A lease database that cannot be written
    (after an outage's retries) raises its error. A broker that refuses the message does
    not lose the job: the row stands, the failure is logged, and the reclaimer's next sweep
    sends it (the caller is not told with an error: in a web request the transaction that
    recorded the job has committed, and a retried request would publish it twice).
    """
    alias = store.database_alias()
    pending = _pending(task, args, kwargs, task_id, options, key)
    if pending is None:
        sent: AsyncResult[Any] = _unrecorded(
            alias, task.name, task.result(task_id), lambda: send(True), lambda: send(False)
        )
        return sent
    in_transaction = connections[alias].in_atomic_block
    # the database away for a moment (a restart, a failover) is waited out, as a result
    # write waits; then, or inside the caller's transaction, its error is the caller's:
    # a job sent unrecorded could be lost by the broker with nothing to send it again
    standing = outages.attempt_through(
        lambda: store.record_pending(alias, pending),
        [alias],
        f"could not record task {task.name}[{task_id}] in the outbox",
        extra={"task_id": task_id},
    )
    if isinstance(standing, store.Deduplicated):
        return _deduplicated(task, pending, standing)

    # remembered while it waits: a result handle of the job, waited for in this thread
    # before the commit, raises UncommittedJob rather than wait for its timeout
    deferred = results.on_commit(
        alias,
        task_id,
        task.name,
        lambda: _sent_or_marked_unsent(alias, task.name, task_id, lambda: send(in_transaction)),
    )
    return results.hold(task.result(task_id), deferred)


def _pending(
    task: Publisher,
    args: Sequence[Any] | None,
    kwargs: Mapping[str, Any] | None,
    task_id: str,
    options: Mapping[str, Any],
    key: str,
) -> store.Pending | None:
    """The outbox row of a fenced task's publish, or None when JSON cannot carry its job."""
    args, kwargs = list(args or ()), dict(kwargs or {})
    return _row(
        task.app,
        task.name,
        args,
        kwargs,
        task_id,
        options,
        key=key,
        unique=task.unique,
        # a retry is the same job; a call that carries a workflow (a chain's next steps,
        # callbacks, a chord or group it belongs to, a frozen id its caller holds) must
        # be sent: refused, its workflow would wait forever. Both take the key if free.
        same_job=is_same_job() or in_workflow(options),
    )


def _row(
    app: Any,
    name: str,
    args: list[Any],
    kwargs: dict[str, Any],
    task_id: str,
    options: Mapping[str, Any],
    **fields: Any,
) -> store.Pending | None:
    """The outbox row of a publish of task ``name`` (``fields``: the row's key,
    uniqueness, ...), or None when JSON cannot carry its job."""
    expires = jobs.expiry(options.get("expires"))
    job = _encoded(app, name, args, kwargs, task_id, options, expires)
    if job is None:
        return None
    return store.Pending(
        task_id=task_id,
        task_name=name,
        job=job,
        countdown=jobs.seconds(options.get("countdown")),
        eta=jobs.moment(options.get("eta")),
        expires=expires,
        resend_after=conf.load(app).outbox_resend_after,
        nesting=keys.replacements(options.get("replaced_task_nesting")),
        **{"key": "", **fields},
    )


def _deduplicated(
    task: Publisher, pending: store.Pending, refused: store.Deduplicated
) -> AsyncResult[Any]:
    """A ``lease_unique`` publish refused (its ``deduplicated`` event written by the
    statement that refused it): the copy that stands is the caller's result."""
    standing = refused.standing
    # DEBUG: the event's own record (``celery_fenced.events``, INFO) says it already
    logger.debug(
        "task %s: a copy of key %r is already %s (%s): not queued again (lease_unique=%s)",
        task.name,
        pending.key,
        "queued or running" if pending.unique == "until_done" else "queued",
        standing,
        pending.unique,
        extra={"task_id": standing, "lease_key": pending.key},
    )
    signals.send(
        signals.lease_deduplicated,
        Lease,
        key=pending.key,
        token=refused.token,
        owner=refused.owner,
        task_id=standing,
        task_name=pending.task_name,
        refused_task_id=pending.task_id,
    )
    return task.result(standing)


def _encoded(
    app: Any,
    name: str,
    args: list[Any],
    kwargs: dict[str, Any],
    task_id: str,
    options: Mapping[str, Any],
    expires: float | dt.datetime | None,
) -> str | None:
    """The job as the reclaimer sends it again, or None when JSON cannot carry it."""
    kept = jobs.recorded_options(app, options, expires)
    try:
        return jobs.encode_job(jobs.Job(name, args, kwargs, kept))
    except Exception as exc:
        logger.warning(
            "task %s[%s]: its job cannot be recorded as JSON (%s); sent without the outbox",
            name,
            task_id,
            exc,
            extra={"task_id": task_id},
        )
        return None
