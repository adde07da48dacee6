"""Reclaim: send a job again when its lease expired before it finished, on any broker.

A broker gives an unacknowledged message to another worker only late (Redis after its
visibility timeout, an hour by default) or never (the filesystem transport while the
first worker lives; a worker killed whole loses the message). Leases expire in seconds.
So a fenced execution records, with its grant, what is needed to send the job again
(:func:`job_for`); the reclaimer (:func:`reclaim_expired`, the periodic task
``celery_fenced.reclaim``) claims the grants that expired unfinished and hands them to
:mod:`celery_fenced.resend`, which sends each job again with the same task id. The new
execution reclaims the lease with the next token; the old holder, if it still runs, is
fenced.

A job whose ``expires`` has passed is not sent again: a worker would discard it (and
RabbitMQ drops a message whose time to live ran out before any consumer took it, so the
job would never end). The reclaimer records its ``REVOKED`` outcome, as the worker does
for an expired message, and ends the expired grant: a holder that was only paused
changes nothing when it wakes.

The job is recorded as JSON (:mod:`celery_fenced.jobs`): nothing read from the database
is ever unpickled.
"""

from __future__ import annotations

import datetime as dt
import logging
from typing import TYPE_CHECKING, Any, Protocol

from celery import shared_task
from celery.app.task import Context
from django.db import transaction

from celery_fenced import jobs, keys, resend, signals, store
from celery_fenced.jobs import CONTENT_TYPE as CONTENT_TYPE
from celery_fenced.jobs import OPTION_NAMES as OPTION_NAMES
from celery_fenced.jobs import VERSION as VERSION
from celery_fenced.jobs import Job as Job
from celery_fenced.jobs import decode_job as decode_job
from celery_fenced.jobs import delivery_of as delivery_of
from celery_fenced.jobs import encode_job as encode_job
from celery_fenced.jobs import expired as expired
from celery_fenced.jobs import send_job as send_job
from celery_fenced.models import ReclaimState
from celery_fenced.pending import resend_pending
from celery_fenced.resend import Resent
from celery_fenced.resend import record_revoked as record_revoked
from celery_fenced.validators import validate_seconds

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from celery import Celery, Task

    from celery_fenced import store


class RunningTask(Protocol):
    """What the reclaimer reads of a task that is running: its name, app and request."""

    name: str
    app: Celery
    request: Any


logger = logging.getLogger(__name__)

#: ``by`` of the force-release that ends an expired job's grant (its ``force_released``
#: event): the reclaimer recorded the job's ``REVOKED`` outcome instead of sending it
EXPIRED = "reclaimer: the job expired"

#: what the reclaimer did with one expired, unfinished grant
Reclaimed = Resent

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


# -- recording (at acquire, in the worker) -----------------------------------------------
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
    if grace is not None:
        grace = validate_seconds(grace, "grace")
    app, settings, alias = resend.sweep_setup(app, limit, using)
    grace = settings.reclaim_grace if grace is None else grace
    if dry_run:
        return _preview(alias, grace, settings.reclaim_resend_after, settings.reclaim_max, limit)

    def claim() -> tuple[list[resend.Claimed], bool]:
        claims = store.claim_expired(
            alias,
            grace=grace,
            resend_after=settings.reclaim_resend_after,
            max_attempts=settings.reclaim_max,
            limit=limit,
        )
        now = store.database_now(alias) if claims else None
        rows = [ExpiredGrant(alias, c, settings.reclaim_max, now) for c in claims]
        return list(rows), len(claims) >= limit

    return resend.sweep(app, claim)


class ExpiredGrant(resend.Claimed):
    """A grant that expired unfinished, claimed by this reclaimer (or abandoned by it)."""

    logger = logger
    exhausted_message = (
        logging.ERROR,
        "lease %(key)r abandoned: task %(task_name)s[%(task_id)s] expired unfinished "
        "after %(attempt)d re-sends",
    )
    abandoned_message = (logging.ERROR, "lease %(key)r abandoned: %(reason)s")
    unsent_message = (
        logging.WARNING,
        "lease %(key)r: could not send task %(task_name)s[%(task_id)s] again (%(exc)r); "
        "the next sweep retries",
    )
    resent_message = (
        logging.WARNING,
        "lease %(key)r expired unfinished under token %(token)s (holder %(owner)s): sent "
        "task %(task_name)s[%(task_id)s] again (attempt %(attempt)d of %(max)d)",
    )
    unrevoked_message = (
        logging.WARNING,
        "lease %(key)r: task %(task_name)s[%(task_id)s] expired, but its REVOKED outcome "
        "could not be recorded (%(exc)r); the next sweep tries again",
    )
    revoked_message = (
        logging.WARNING,
        "lease %(key)r expired unfinished under token %(token)s (holder %(owner)s) after "
        "task %(task_name)s[%(task_id)s] expired: recorded REVOKED, not sent again",
    )

    def __init__(
        self, alias: str, claim: store.Claim, max_attempts: int, now: dt.datetime | None
    ) -> None:
        super().__init__(
            key=claim.key,
            task_id=claim.task_id,
            task_name=claim.task_name,
            token=claim.token,
            owner=claim.owner,
            attempt=claim.attempts,
            job=claim.job,
            max_sends=max_attempts,
        )
        self.alias, self.claim, self.now = alias, claim, now

    @property
    def extra(self) -> dict[str, Any]:
        return {"lease_key": self.key, "fencing_token": self.token, "task_id": self.task_id}

    def exhausted(self) -> str:
        # abandoned by the claiming statement itself
        return "too many re-sends" if self.claim.state == ReclaimState.ABANDONED else ""

    def expired(self, job: Job) -> bool:
        return self.now is not None and jobs.expired(job, self.now)

    def abandon(self, reason: str) -> None:
        if self.claim.state != ReclaimState.ABANDONED:
            store.abandon(self.alias, self.claim, reason)

    def unclaim(self) -> None:
        store.unclaim(self.alias, self.claim)

    def end_revoked(self, app: Celery, job: Job | None) -> bool:
        """Its expired grant ended and its ``REVOKED`` recorded, in one transaction of the
        lease database (the backend records nothing while the job's grant stands)."""

        with transaction.atomic(using=self.alias):
            ended = store.end_claimed(self.alias, self.claim, EXPIRED)
            if ended and job is not None:
                resend.record_revoked(app, self.task_id, self.task_name, job)
                # REVOKED is the job's outcome: a copy of its message that a worker runs
                # later (its clock behind the database's) is a completed duplicate
                store.mark_ended(self.alias, jobs.delivery_of(self.task_id, job))
        return ended

    def revoked(self) -> None:
        resend.signal(signals.lease_released, self, forced=True)

    def sent(self, job: Job) -> None:
        detail = {
            "attempt": self.attempt,
            "max": self.max_sends,
            "previous_owner": self.owner,
            "queue": job.options.get("queue") or job.options.get("routing_key", ""),
        }
        try:
            store.record_resent(self.alias, self.claim, detail)
        except Exception:  # the message is out; the event is best effort
            logger.info("could not record the resent event for %r", self.key, exc_info=True)


def _preview(
    alias: str, grace: float, resend_after: float, max_attempts: int, limit: int
) -> list[Reclaimed]:

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
    worker ever started (the outbox: :func:`celery_fenced.pending.resend_pending`).
    """
    reclaimed = sum(1 for o in reclaim_expired(self.app) if o.action == "resent")
    return reclaimed + sum(1 for o in resend_pending(self.app) if o.action == "resent")
