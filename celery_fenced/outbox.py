"""The outbox: a fenced job is recorded in the lease database when it is published.

``apply_async`` (and ``delay``) of a fenced task writes a pending row
(:class:`~celery_fenced.models.PendingJob`) holding what is needed to send the job
again, in the caller's transaction when one is open on the lease database, and sends the
message when that transaction commits: a rolled-back transaction sends nothing and
leaves nothing. The statement that grants the job's lease deletes the row, so a job is
pending, granted or finished, never nowhere. The reclaimer sends again a row that no
worker granted ``fenced_outbox_resend_after`` seconds past its ETA (or its last sending),
with the same task id: a job lost by the broker (a worker killed between popping a
message and recording it, a broker restarted without persistence, a broker down at
publish time) still runs, once.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime as dt
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django.db import DatabaseError, connections
from django.utils import timezone
from kombu import serialization
from kombu.exceptions import OperationalError

from celery_fenced import keys, outages, reclaim, results, signals

#: set while the package sends a message that must not wait for a commit: a retry or a
#: replacement raised inside the caller's own transaction, which the raise rolls back
_at_once: contextvars.ContextVar[bool] = contextvars.ContextVar("fenced_outbox_at_once")


@contextlib.contextmanager
def at_once_in_transaction(alias: str) -> Iterator[None]:
    """Inside it, a publish sends at once, unrecorded, when a transaction is already open
    on ``alias``: its commit would never come (the exception that follows rolls it back),
    and the row and the message would go with it. Outside a transaction nothing changes."""
    # never turns off an outer at-once (``unrecorded``: the database is away)
    marker = _at_once.set(_at_once.get(False) or connections[alias].in_atomic_block)
    try:
        yield
    finally:
        _at_once.reset(marker)


@contextlib.contextmanager
def unrecorded() -> Iterator[None]:
    """Inside it, a publish is sent as Celery sends it, unrecorded: the worker's own
    re-send of a job after a database error before its grant (the database is away)."""
    marker = _at_once.set(True)
    try:
        yield
    finally:
        _at_once.reset(marker)


def sends_at_once() -> bool:
    return _at_once.get(False)


#: set while a task re-publishes the job it is running (its retry): a ``lease_unique``
#: job keeps its place rather than being refused as a copy of itself
_same_job: contextvars.ContextVar[bool] = contextvars.ContextVar("fenced_outbox_same_job")


def is_same_job() -> bool:
    """Whether a publish now is the running job again (inside :func:`same_job`)."""
    return _same_job.get(False)


@contextlib.contextmanager
def same_job() -> Iterator[None]:
    """Inside it, a publish is the running job again (a retry), not a new copy."""
    marker = _same_job.set(True)
    try:
        yield
    finally:
        _same_job.reset(marker)


#: the message header that marks a plain task's job the outbox holds: the worker that
#: starts it ends its row (:func:`plain_job_started`)
PLAIN_HEADER = "fenced_outbox"

#: the lease database alias whose open transaction records plain tasks' publishes
_recording_plain: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "fenced_outbox_recording_plain"
)


@contextlib.contextmanager
def plain_sends_recorded(alias: str) -> Iterator[None]:
    """Inside it, while a transaction is open on the lease database ``alias``, a plain
    (unfenced) task's publish — Celery's ``app.send_task``, which every plain
    ``apply_async`` ends in — is recorded in that transaction and sent when it commits,
    like a fenced job's.

    For what an execution's outcome sends on (callbacks, chain steps, errbacks, a chord
    body), inside the transaction that proves its token current: a message cannot be
    taken back, and a proof whose transaction never commits (the process paused in it
    while the database restarted, then resumed) is no proof — the grant may be
    another's by then. Sent on commit; its row ends when a worker starts the job (its
    message carries :data:`PLAIN_HEADER`), so the reclaimer sends it again if the
    process dies before the send or the broker loses the message — at least once.
    The app's ``send_task`` (:mod:`celery_fenced.sending`, given to every app) records.
    """
    from celery_fenced import store

    if alias != store.database_alias() or not connections[alias].in_atomic_block:
        yield
        return
    marker = _recording_plain.set(alias)
    try:
        yield
    finally:
        _recording_plain.reset(marker)


def plain_recording() -> str | None:
    """The lease database alias whose open transaction records a plain publish now
    (inside :func:`plain_sends_recorded`, that transaction still open), or None."""
    alias = _recording_plain.get(None)
    return alias if alias is not None and connections[alias].in_atomic_block else None


def record_plain(
    app: Any,
    original: Callable[..., Any],
    alias: str,
    name: str,
    args: Any,
    kwargs: Any,
    options: dict[str, Any],
) -> Any:
    from celery.utils import uuid

    from celery_fenced import store

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
    if send_now is not None and _recording_plain.get(None) != alias:
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
    from celery_fenced import conf
    from celery_fenced.execution import FencedExecution

    task = app.tasks.get(name)
    if task is None:
        return conf.load(app).options_for(name) is None
    return not isinstance(task, FencedExecution)


def _end_row(alias: str, task_id: str, done: str, job: str = "") -> None:
    """End ``task_id``'s outbox row once the job (named ``job`` in the log) is ``done``
    ("sent", "started"); the database away, it stands and the reclaimer may send the job
    again: at least once."""
    from celery_fenced import store

    try:
        store.forget_pending(alias, task_id)
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
    from celery_fenced import store

    if getattr(request, PLAIN_HEADER, None):
        _end_row(store.database_alias(), task_id, "started")


def _sent_or_marked_unsent(
    alias: str, name: str, task_id: str, publish: Callable[[], Any]
) -> bool:
    """``publish()`` a recorded job; refused (the broker down, an error), its row is
    marked unsent for the reclaimer's next sweep and the failure logged. Whether sent."""
    from celery_fenced import store

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


if TYPE_CHECKING:
    from celery import Celery
    from celery.result import AsyncResult

    from celery_fenced import store

logger = logging.getLogger(__name__)


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
    from celery_fenced import store

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
    if standing != task_id:
        return _deduplicated(task, alias, pending, standing)

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
        same_job=_same_job.get(False) or _in_workflow(options),
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
    from celery_fenced import conf, store

    expires = _expiry(options.get("expires"))
    job = _encoded(app, name, args, kwargs, task_id, options, expires)
    if job is None:
        return None
    return store.Pending(
        task_id=task_id,
        task_name=name,
        job=job,
        countdown=_seconds(options.get("countdown")),
        eta=_moment(options.get("eta")),
        expires=expires,
        resend_after=conf.load(app).outbox_resend_after,
        nesting=keys.replacements(options.get("replaced_task_nesting")),
        **{"key": "", **fields},
    )


def _deduplicated(
    task: Publisher, alias: str, pending: store.Pending, standing: str
) -> AsyncResult[Any]:
    """A ``lease_unique`` publish refused: the copy that stands is the caller's result."""
    from celery_fenced import store
    from celery_fenced.models import Lease

    token, owner = store.record_deduplicated(
        alias, pending.key, task.name, standing, pending.task_id
    )
    logger.info(
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
        token=token,
        owner=owner,
        task_id=standing,
        task_name=pending.task_name,
        refused_task_id=pending.task_id,
    )
    return task.result(standing)


#: options of a call that is a step of a workflow (chain, callbacks, group, chord)
WORKFLOW_OPTIONS = ("chain", "link", "link_error", "chord", "group_id")


def _in_workflow(options: Mapping[str, Any]) -> bool:
    return "chain" in options or any(options.get(name) for name in WORKFLOW_OPTIONS)


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
    kept = {
        option: value
        for option, value in options.items()
        if option in reclaim.OPTION_NAMES and value is not None and option != "expires"
    }
    if "headers" in kept:  # a retry carries its request's: only what JSON can carry
        kept["headers"] = _portable_headers(kept["headers"])
        if not kept["headers"]:
            del kept["headers"]
    if expires is not None:  # absolute: a later sending keeps the first one's deadline
        kept["expires"] = (
            expires
            if isinstance(expires, dt.datetime)
            else app.now() + dt.timedelta(seconds=expires)
        ).isoformat()
    try:
        return reclaim.encode_job(reclaim.Job(name, args, kwargs, kept))
    except Exception as exc:
        logger.warning(
            "task %s[%s]: its job cannot be recorded as JSON (%s); sent without the outbox",
            name,
            task_id,
            exc,
            extra={"task_id": task_id},
        )
        return None


def _portable_headers(headers: Any) -> dict[str, Any]:
    """The custom message headers a re-sending can carry: string keys, values kombu's
    ``json`` serializer can write (as the job's); none of a process's own
    (``_``-prefixed) attributes."""
    if not isinstance(headers, Mapping):
        return {}
    kept = {}
    for name, value in headers.items():
        if not isinstance(name, str) or name.startswith("_"):
            continue
        try:
            serialization.dumps(value, serializer="json")
        except Exception:
            continue
        kept[name] = value
    return kept


def _seconds(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _moment(value: Any) -> dt.datetime | None:
    """An ETA or expiry time as an aware datetime (naive: UTC, as Celery reads it)."""
    if isinstance(value, str):
        try:
            value = dt.datetime.fromisoformat(value)
        except ValueError:
            return None
    if not isinstance(value, dt.datetime):
        return None
    return value if value.tzinfo is not None else value.replace(tzinfo=dt.timezone.utc)


def _expiry(value: Any) -> float | dt.datetime | None:
    moment = _moment(value)
    return _seconds(value) if moment is None else moment


# -- sending again (the reclaimer) -------------------------------------------------------
@dataclass(frozen=True)
class Resent:
    """What the reclaimer did with one pending job that no worker had granted."""

    task_id: str
    task_name: str
    key: str
    attempt: int  # sendings by the reclaimer so far (this one included)
    #: "resent", "abandoned", "revoked" (expired: its REVOKED recorded, never sent), or
    #: "failed" (not sent; the next sweep retries)
    action: str
    reason: str = ""


def resend_pending(
    app: Celery | None = None, *, using: str | None = None, limit: int = 100
) -> list[Resent]:
    """Send again every pending job due (``fenced_outbox_resend_after`` past its ETA or
    its last sending) with its task id; abandon it after ``fenced_reclaim_max`` sendings.

    Expired jobs (``expires`` passed ``fenced_outbox_resend_after`` ago, never started)
    get their ``REVOKED`` outcome, never a sending. Each row is claimed by a
    conditional statement, so several reclaimers send each due job once.
    """
    from celery_fenced import conf, store

    if app is None:
        from celery import current_app

        app = current_app
    settings = conf.load(app)
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit must be an integer of 1 or more, got {limit!r}")
    alias = store.database_alias(using)
    outcomes: list[Resent] = [
        _revoke_expired(app, alias, row)
        for row in store.expired_rows(alias, limit, grace=settings.outbox_resend_after)
    ]
    while True:
        claimed, more = store.claim_due(
            alias, resend_after=settings.outbox_resend_after, limit=limit
        )
        batch = [_send_again(app, alias, due, settings.reclaim_max) for due in claimed]
        outcomes += batch
        if not more or any(o.action == "failed" for o in batch):
            return outcomes


def _revoke_expired(app: Celery, alias: str, row: tuple[int, str, str, str]) -> Resent:
    """A pending job whose ``expires`` passed before any worker started it (its message
    lost, say): record its ``REVOKED`` outcome, as the worker does when an expired message
    arrives (the result backend, the workflow it belongs to), then end its row; never
    sent again."""
    from celery_fenced import store

    row_id, task_id, task_name, job = row
    recorded: reclaim.Job | None = None
    with contextlib.suppress(ValueError):
        recorded = reclaim.decode_job(job)
    try:
        reclaim.record_revoked(app, task_id, task_name, recorded)
    except Exception as exc:
        logger.warning(
            "pending job %s[%s] expired: its REVOKED outcome could not be recorded (%s); "
            "the next sweep tries again",
            task_name,
            task_id,
            exc,
            extra={"task_id": task_id},
        )
        return Resent(task_id, task_name, "", 0, "failed", f"expired: {exc}")
    store.forget_row(alias, row_id)
    logger.info(
        "pending job %s[%s] expired before any worker started it: recorded REVOKED",
        task_name,
        task_id,
        extra={"task_id": task_id},
    )
    return Resent(task_id, task_name, "", 0, "revoked", "expired")


def _send_again(app: Celery, alias: str, due: store.Due, max_sends: int) -> Resent:
    from celery_fenced import store

    extra = {"task_id": due.task_id, "lease_key": due.key}

    def outcome(action: str, reason: str = "") -> Resent:
        return Resent(due.task_id, due.task_name, due.key, due.sends, action, reason)

    def abandoned(reason: str) -> Resent:
        logger.error(
            "pending job %s[%s] abandoned: %s", due.task_name, due.task_id, reason, extra=extra
        )
        store.abandon_pending(alias, due, reason)
        _signal(signals.lease_abandoned, due, reason=reason)
        return outcome("abandoned", reason)

    if due.sends > max_sends:
        return abandoned(f"never started after {max_sends} re-sends")
    try:
        job = reclaim.decode_job(due.job)
    except ValueError as exc:
        return abandoned(f"unreadable job: {exc}")
    later: dict[str, Any] = (
        {"eta": due.eta} if due.eta is not None and due.eta > timezone.now() else {}
    )
    try:
        reclaim.send_job(app, job, due.task_id, **later)
    except Exception as exc:
        logger.warning(
            "pending job %s[%s]: could not send it again (%r); the next sweep retries",
            due.task_name,
            due.task_id,
            exc,
            extra=extra,
        )
        store.unclaim_due(alias, due)
        return outcome("failed", repr(exc))
    logger.warning(
        "pending job %s[%s] was never started: sent again (attempt %d of %d)",
        due.task_name,
        due.task_id,
        due.sends,
        max_sends,
        extra=extra,
    )
    if due.plain and not (job.options.get("headers") or {}).get(PLAIN_HEADER):
        store.forget_pending(alias, due.task_id)  # not held until started: sent, it ends
    _signal(signals.lease_resent, due, attempt=due.sends)
    return outcome("resent")


def _signal(signal: Any, due: store.Due, **extra: Any) -> None:
    """A lease signal for a pending job: its key, no token (it was never granted)."""
    from celery_fenced.models import Lease

    signals.send(
        signal,
        Lease,
        key=due.key,
        token=None,
        owner="",
        task_id=due.task_id,
        task_name=due.task_name,
        **extra,
    )
