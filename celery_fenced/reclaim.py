"""Reclaim: send a job again when its lease expired before it finished, on any broker.

A broker gives an unacknowledged message to another worker only late (Redis after its
visibility timeout, an hour by default) or never (the filesystem transport while the
first worker lives; a worker killed whole loses the message). Leases expire in seconds.
So a fenced execution records, with its grant, what is needed to send the job again
(:func:`job_for`); the reclaimer (:func:`reclaim_expired`, the periodic task
``celery_fenced.reclaim``) finds the grants that expired unfinished and sends each job
again with the same task id. The new execution reclaims the lease with the next token;
the old holder, if it still runs, is fenced.

A job whose ``expires`` has passed is not sent again: a worker would discard it (and
RabbitMQ drops a message whose time to live ran out before any consumer took it, so the
job would never end). The reclaimer records its ``REVOKED`` outcome, as the worker does
for an expired message, and ends the expired grant: a holder that was only paused
changes nothing when it wakes.

The job is stored as JSON through kombu's serializer registry and read back accepting
JSON only: nothing read from the database is ever unpickled.
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from celery import shared_task, states
from celery.app.task import Context
from celery.utils.time import maybe_iso8601, maybe_make_aware
from kombu import serialization

from celery_fenced import context, signals
from celery_fenced.validators import validate_seconds

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from celery import Celery, Task
    from django.dispatch import Signal

    from celery_fenced import store
    from celery_fenced.store import Delivery


class RunningTask(Protocol):
    """What the reclaimer reads of a task that is running: its name, app and request."""

    name: str
    app: Celery
    request: Any


logger = logging.getLogger(__name__)

#: ``by`` of the force-release that ends an expired job's grant (its ``force_released``
#: event): the reclaimer recorded the job's ``REVOKED`` outcome instead of sending it
EXPIRED = "reclaimer: the job expired"

CONTENT_TYPE = "application/json"
VERSION = 1
#: options of the original message that are sent again with the job
OPTION_NAMES = frozenset(
    {
        "queue",
        "exchange",
        "routing_key",
        "priority",
        "root_id",
        "parent_id",
        "group_id",
        "group_index",
        "link",
        "link_error",
        "chain",
        "chord",
        "retries",
        "expires",
        "time_limit",
        "soft_time_limit",
        "headers",
        "shadow",
        "replaced_task_nesting",
    }
)
# request attribute -> send_task option, for the workflow a job belongs to
_REQUEST_OPTIONS = (
    ("root_id", "root_id"),
    ("parent_id", "parent_id"),
    ("group", "group_id"),
    ("group_index", "group_index"),
    ("callbacks", "link"),
    ("errbacks", "link_error"),
    ("chain", "chain"),
    ("chord", "chord"),
    ("expires", "expires"),
    ("retries", "retries"),
    ("replaced_task_nesting", "replaced_task_nesting"),
)


@dataclass(frozen=True)
class Job:
    """A job as recorded at acquire: enough to send it again."""

    task: str
    args: list[Any]
    kwargs: dict[str, Any]
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Reclaimed:
    """What the reclaimer did with one expired, unfinished grant."""

    key: str
    task_id: str
    task_name: str
    token: int  # the expired grant's token; the re-sent execution takes a higher one
    attempt: int  # re-sends of this task id so far (the maximum, when abandoned)
    #: "resent", "abandoned", "revoked" (expired: its REVOKED recorded, never sent),
    #: "skipped" (expired, its grant ended meanwhile), or "failed" (not sent; the next
    #: sweep retries)
    action: str
    reason: str = ""
    dry_run: bool = False


# -- recording (at acquire, in the worker) -----------------------------------------------
def encode_job(job: Job) -> str:
    """The JSON text of ``job`` (kombu's ``json`` serializer: dates, UUIDs, decimals)."""
    payload = {
        "v": VERSION,
        "task": job.task,
        "args": list(job.args),
        "kwargs": dict(job.kwargs),
        "options": job.options,
    }
    content_type, _, data = serialization.dumps(payload, serializer="json")
    if content_type != CONTENT_TYPE:  # pragma: no cover - kombu's registry was changed
        raise ValueError(f"the json serializer produced {content_type!r}")
    return data if isinstance(data, str) else data.decode()


def decode_job(text: str) -> Job:
    """Read a recorded job back, accepting JSON only; ``ValueError`` if it is not a job."""
    try:
        payload = serialization.loads(text, CONTENT_TYPE, "utf-8", accept={CONTENT_TYPE})
    except Exception as exc:
        raise ValueError(f"not a JSON job ({exc})") from None
    if not isinstance(payload, dict) or payload.get("v") != VERSION:
        raise ValueError("not a recorded job (unknown format)")
    task, args, kwargs, options = (payload.get(k) for k in ("task", "args", "kwargs", "options"))
    if not isinstance(task, str) or not task:
        raise ValueError(f"the task name must be a non-empty string, got {task!r}")
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        raise ValueError("args must be a list and kwargs a dict")
    if not isinstance(options, dict) or not set(options) <= OPTION_NAMES:
        raise ValueError(f"unexpected options {sorted(set(options or {}) - OPTION_NAMES)}")
    return Job(task, args, kwargs, options)


def job_for(
    task: RunningTask, args: Sequence[Any], kwargs: Mapping[str, Any], key: str
) -> str | None:
    """The job of the execution running ``task`` now under lease ``key``, encoded (a copy
    sent again runs under the same key); None if it cannot be re-sent.

    Eager and direct calls have no message to send again. Arguments that JSON cannot
    carry (a task using pickle) leave the job unrecorded, with a warning.
    """
    request = task.request
    if not request.id or getattr(request, "is_eager", False):
        return None
    from celery_fenced import keys  # its models need Django's app registry

    options = _options(task, request)
    options["headers"] = keys.key_headers(key, task.name, request.id)
    job = Job(task.name, list(args), dict(kwargs), options)
    try:
        return encode_job(job)
    except Exception as exc:
        logger.warning(
            "task %s[%s]: its job cannot be recorded as JSON (%s); it will not be reclaimed",
            task.name,
            request.id,
            exc,
            extra={"task_id": request.id},
        )
        return None


def _options(task: RunningTask, request: Context) -> dict[str, Any]:
    options: dict[str, Any] = {}
    info = request.delivery_info or {}
    exchange, routing_key = info.get("exchange"), info.get("routing_key")
    queue = _queue_name(task.app, exchange, routing_key)
    if queue:
        options["queue"] = queue
    elif routing_key:
        options["exchange"] = exchange or ""
        options["routing_key"] = routing_key
    if info.get("priority") is not None:
        options["priority"] = info["priority"]
    for attribute, option in _REQUEST_OPTIONS:
        value = getattr(request, attribute, None)
        if value:
            options[option] = value
    hard, soft = [*(request.timelimit or ()), None, None][:2]
    if hard:
        options["time_limit"] = hard
    if soft:
        options["soft_time_limit"] = soft
    return options


def _queue_name(app: Celery, exchange: str | None, routing_key: str | None) -> str | None:
    """The name of the queue the message came from, as this app knows its queues."""
    if not routing_key:
        return None
    if not exchange:  # the default exchange routes by queue name
        return routing_key
    try:
        queues = list(app.amqp.queues.values())
    except Exception:  # pragma: no cover - an app without routing configured
        return None
    for queue in queues:
        if getattr(queue.exchange, "name", None) == exchange and queue.routing_key == routing_key:
            return str(queue.name)
    return None


def expired(job: Job, now: dt.datetime) -> bool:
    """Whether ``job``'s ``expires`` is ``now`` or earlier (the database's time: every
    expiry decision is the database's, whatever the clocks of workers and reclaimers)."""
    value = job.options.get("expires")
    if not value:
        return False
    try:
        moment = maybe_iso8601(value)
    except (TypeError, ValueError):  # not a moment: the worker would not expire it either
        return False
    return moment is not None and maybe_make_aware(moment) <= now


def delivery_of(task_id: str, job: Job) -> Delivery:
    """The delivery a copy of ``job``'s message is (its task id, digest and retries)."""
    from celery_fenced import keys, store

    retries = int(job.options.get("retries") or 0)
    nesting = keys.replacements(job.options.get("replaced_task_nesting"))
    digest = keys.message_digest(task_id, job.task, job.args, job.kwargs, nesting)
    return store.Delivery(task_id, digest, retries, nesting)


def record_revoked(app: Celery, task_id: str, task_name: str, job: Job | None) -> None:
    """Record the ``REVOKED`` outcome of an expired job that will not be sent again, as
    the worker records it when an expired message arrives: in the result backend and in
    the workflow it belongs to (its chord counts it). Raises what the backend raises."""
    context: dict[str, Any] = {"id": task_id, "task": task_name}
    if job is not None:
        options = job.options
        context.update(
            args=job.args,
            kwargs=job.kwargs,
            group=options.get("group_id"),
            group_index=options.get("group_index"),
            chord=options.get("chord"),
            root_id=options.get("root_id"),
            parent_id=options.get("parent_id"),
        )
    request = Context(context)
    app.backend.mark_as_revoked(
        task_id, reason="expired", request=request, store_result=True, state=states.REVOKED
    )


def send_job(app: Celery, job: Job, task_id: str, **more: Any) -> None:
    """Send a recorded ``job`` again with its task id (``more``: options of this sending);
    recorded already, it is no new publish by task name."""
    with context.sending_decided():
        app.send_task(
            job.task,
            args=job.args,
            kwargs=job.kwargs,
            task_id=task_id,
            add_to_parent=False,
            **job.options,
            **more,
        )


# -- the reclaimer -----------------------------------------------------------------------
def reclaim_expired(
    app: Celery | None = None,
    *,
    grace: float | None = None,
    using: str | None = None,
    limit: int = 100,
    dry_run: bool = False,
) -> list[Reclaimed]:
    """Send again every job whose lease expired before it finished; return what was done.

    A grant is eligible when it is unreleased, has a recorded job, and expired more than
    ``grace`` seconds ago (default ``fenced_reclaim_grace``) by the database's clock. Each
    is claimed by one conditional statement, so concurrent reclaimers send at most one
    message per expiry; the job goes out with its task id, arguments and routing. After
    ``fenced_reclaim_max`` re-sends of the same task id the lease is abandoned instead
    (an ``abandoned`` event). ``dry_run`` claims nothing and sends nothing: it reports
    what a sweep would do. Claims are taken ``limit`` at a time until none is left.
    """
    from celery_fenced import conf, store

    if app is None:
        from celery import current_app

        app = current_app
    settings = conf.load(app)
    grace = settings.reclaim_grace if grace is None else validate_seconds(grace, "grace")
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit must be an integer of 1 or more, got {limit!r}")
    alias = store.database_alias(using)
    if dry_run:
        return _preview(alias, grace, settings.reclaim_resend_after, settings.reclaim_max, limit)
    outcomes: list[Reclaimed] = []
    while True:
        claims = store.claim_expired(
            alias,
            grace=grace,
            resend_after=settings.reclaim_resend_after,
            max_attempts=settings.reclaim_max,
            limit=limit,
        )
        now = store.database_now(alias) if claims else None
        batch = [_handle(app, alias, claim, settings.reclaim_max, now) for claim in claims]
        outcomes += batch
        if len(claims) < limit or any(o.action == "failed" for o in batch):
            return outcomes


def _handle(
    app: Celery, alias: str, claim: store.Claim, max_attempts: int, now: dt.datetime | None
) -> Reclaimed:
    from celery_fenced import store
    from celery_fenced.models import ReclaimState

    def outcome(action: str, reason: str = "") -> Reclaimed:
        return Reclaimed(
            claim.key, claim.task_id, claim.task_name, claim.token, claim.attempts, action, reason
        )

    def abandoned(reason: str) -> Reclaimed:
        _signal(signals.lease_abandoned, claim, reason=reason)
        return outcome("abandoned", reason)

    extra = {"lease_key": claim.key, "fencing_token": claim.token, "task_id": claim.task_id}
    try:
        job: Job | None = decode_job(claim.job)
        unreadable = ""
    except ValueError as exc:
        job, unreadable = None, f"unreadable job: {exc}"
    if job is not None and now is not None and expired(job, now):
        return _revoke(app, alias, claim, job, outcome)
    if claim.state == ReclaimState.ABANDONED:
        logger.error(
            "lease %r abandoned: task %s[%s] expired unfinished after %d re-sends",
            claim.key,
            claim.task_name,
            claim.task_id,
            claim.attempts,
            extra=extra,
        )
        return abandoned("too many re-sends")
    if job is None:
        logger.error("lease %r abandoned: %s", claim.key, unreadable, extra=extra)
        store.abandon(alias, claim, unreadable)
        return abandoned(unreadable)
    try:
        send_job(app, job, claim.task_id)
    except Exception as exc:
        logger.warning(
            "lease %r: could not send task %s[%s] again (%r); the next sweep retries",
            claim.key,
            job.task,
            claim.task_id,
            exc,
            extra=extra,
        )
        store.unclaim(alias, claim)
        return outcome("failed", repr(exc))
    detail = {
        "attempt": claim.attempts,
        "max": max_attempts,
        "previous_owner": claim.owner,
        "queue": job.options.get("queue") or job.options.get("routing_key", ""),
    }
    try:
        store.record_resent(alias, claim, detail)
    except Exception:  # the message is out; the event is best effort
        logger.info("could not record the resent event for %r", claim.key, exc_info=True)
    logger.warning(
        "lease %r expired unfinished under token %s (holder %s): sent task %s[%s] again "
        "(attempt %d of %d)",
        claim.key,
        claim.token,
        claim.owner,
        job.task,
        claim.task_id,
        claim.attempts,
        max_attempts,
        extra=extra,
    )
    _signal(signals.lease_resent, claim, attempt=claim.attempts)
    return outcome("resent")


def _revoke(
    app: Celery,
    alias: str,
    claim: store.Claim,
    job: Job,
    outcome: Callable[[str, str], Reclaimed],
) -> Reclaimed:
    """An expired job's claim: its expired grant ended and its ``REVOKED`` recorded, in
    one transaction of the lease database (the backend records nothing while the job's
    grant stands; an outcome that cannot be recorded leaves the grant to the next sweep).
    """
    from django.db import transaction

    from celery_fenced import store

    extra = {"lease_key": claim.key, "fencing_token": claim.token, "task_id": claim.task_id}
    try:
        with transaction.atomic(using=alias):
            ended = store.end_claimed(alias, claim, EXPIRED)
            if ended:
                record_revoked(app, claim.task_id, claim.task_name, job)
                # REVOKED is the job's outcome: a copy of its message that a worker runs
                # later (its clock behind the database's) is a completed duplicate
                store.mark_ended(alias, delivery_of(claim.task_id, job))
    except Exception as exc:
        logger.warning(
            "lease %r: task %s[%s] expired, but its REVOKED outcome could not be recorded "
            "(%r); the next sweep tries again",
            claim.key,
            claim.task_name,
            claim.task_id,
            exc,
            extra=extra,
        )
        store.unclaim(alias, claim)
        return outcome("failed", f"expired: {exc!r}")
    if not ended:  # released or taken over since the claim: its holder records the outcome
        return outcome("skipped", "its grant ended meanwhile")
    _signal(signals.lease_released, claim, forced=True)
    logger.warning(
        "lease %r expired unfinished under token %s (holder %s) after task %s[%s] expired: "
        "recorded REVOKED, not sent again",
        claim.key,
        claim.token,
        claim.owner,
        claim.task_name,
        claim.task_id,
        extra=extra,
    )
    return outcome("revoked", "expired")


def _signal(signal: Signal, claim: store.Claim, **extra: Any) -> None:
    from celery_fenced.models import Lease

    signals.send(
        signal,
        Lease,
        key=claim.key,
        token=claim.token,
        owner=claim.owner,
        task_id=claim.task_id,
        task_name=claim.task_name,
        **extra,
    )


def _preview(
    alias: str, grace: float, resend_after: float, max_attempts: int, limit: int
) -> list[Reclaimed]:
    from celery_fenced import store
    from celery_fenced.models import ReclaimState

    claims = store.expired_unfinished(
        alias, grace=grace, resend_after=resend_after, max_attempts=max_attempts, limit=limit
    )
    now = store.database_now(alias) if claims else None

    def action(claim: store.Claim) -> tuple[str, str]:
        try:
            job = decode_job(claim.job)
        except ValueError as exc:
            return "abandoned", f"unreadable job: {exc}"
        if now is not None and expired(job, now):
            return "revoked", "expired"
        if claim.state == ReclaimState.RESENT:
            return "resent", ""
        return claim.state, "too many re-sends"

    return [
        Reclaimed(c.key, c.task_id, c.task_name, c.token, c.attempts, *action(c), dry_run=True)
        for c in claims
    ]


@shared_task(name="celery_fenced.reclaim", bind=True, ignore_result=True)
def reclaim_task(self: Task[Any, Any]) -> int:
    """The periodic reclaimer: ``{"task": "celery_fenced.reclaim", "schedule": 5.0}``.

    It sends again the jobs whose lease expired unfinished, and the published jobs no
    worker ever started (the outbox: :func:`celery_fenced.outbox.resend_pending`).
    """
    from celery_fenced.outbox import resend_pending

    reclaimed = sum(1 for o in reclaim_expired(self.app) if o.action == "resent")
    return reclaimed + sum(1 for o in resend_pending(self.app) if o.action == "resent")
