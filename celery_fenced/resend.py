"""Sending claimed jobs again: the one path both sweeps (expired grants, outbox rows) take.

A sweep is a source of claimed rows (:class:`Claimed`): the reclaimer's expired,
unfinished grants (:mod:`celery_fenced.reclaim`) and the outbox's pending jobs that no
worker granted (:mod:`celery_fenced.pending`). Each claimed row is sent again with its
task id, abandoned after too many sendings or when its job cannot be read, or — its
``expires`` passed — given its ``REVOKED`` outcome instead, as the worker records it for
an expired message. What was done is one :class:`Resent` a row.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from celery import current_app, states
from celery.app.task import Context

from celery_fenced import conf, signals, store
from celery_fenced.jobs import Job, decode_job, send_job
from celery_fenced.models import Lease

if TYPE_CHECKING:
    from celery import Celery
    from django.dispatch import Signal

    from celery_fenced.conf import FencedSettings


@dataclass(frozen=True)
class Resent:
    """What a sweep did with one claimed job (an expired grant's, or a pending one's)."""

    key: str
    task_id: str
    task_name: str
    token: int | None  # the expired grant's token (None: a pending job, never granted)
    attempt: int  # sendings of this task id by the sweeps so far (the maximum, when abandoned)
    #: "resent", "abandoned", "revoked" (expired: its REVOKED recorded, never sent),
    #: "skipped" (expired, its grant ended meanwhile), or "failed" (not sent; the next
    #: sweep retries)
    action: str
    reason: str = ""
    dry_run: bool = False


#: a log line: its level and its %-style text over the fields of :meth:`Claimed.fields`
Message = tuple[int, str]


class Claimed:
    """One row a sweep claimed: what the re-sending needs of it, and its bookkeeping.

    A source sets the fields and its log lines (:data:`Message`: ``abandoned``,
    ``exhausted``, ``unsent``, ``resent``, ``unrevoked``, ``revoked``) and overrides
    what its store does.
    """

    logger: ClassVar[logging.Logger]
    abandoned_message: ClassVar[Message]
    exhausted_message: ClassVar[Message]
    unsent_message: ClassVar[Message]
    resent_message: ClassVar[Message]
    unrevoked_message: ClassVar[Message]
    revoked_message: ClassVar[Message]

    def __init__(
        self,
        *,
        key: str,
        task_id: str,
        task_name: str,
        token: int | None,
        owner: str,
        attempt: int,
        job: str,
        max_sends: int,
    ) -> None:
        self.key, self.task_id, self.task_name = key, task_id, task_name
        self.token, self.owner, self.attempt = token, owner, attempt
        self.job, self.max_sends = job, max_sends

    # -- what the source says ----------------------------------------------------------
    @property
    def extra(self) -> dict[str, Any]:
        """The ``extra`` of its log records."""
        return {"task_id": self.task_id, "lease_key": self.key}

    def exhausted(self) -> str:
        """Why it is abandoned without a sending (too many already), or ""."""
        return ""

    def expired(self, job: Job) -> bool:
        """Whether its job expired: its ``REVOKED`` is recorded, it is never sent."""
        return False

    def send_options(self) -> dict[str, Any]:
        """Options of this sending (an ETA not reached yet)."""
        return {}

    # -- what its store does -----------------------------------------------------------
    def abandon(self, reason: str) -> None:
        """Abandon it in the store (no sending will come)."""

    def unclaim(self) -> None:
        """Undo its claim: the next sweep tries again."""

    def end_revoked(self, app: Celery, job: Job | None) -> bool:
        """Record its ``REVOKED`` outcome and end it; False when it ended meanwhile."""
        raise NotImplementedError

    def revoked(self) -> None:
        """After its ``REVOKED`` was recorded and it ended."""

    def sent(self, job: Job) -> None:
        """After its job was sent again."""

    # -- helpers -----------------------------------------------------------------------
    def fields(self, **more: Any) -> dict[str, Any]:
        return {
            "key": self.key,
            "token": self.token,
            "owner": self.owner,
            "task_id": self.task_id,
            "task_name": self.task_name,
            "attempt": self.attempt,
            "max": self.max_sends,
            **more,
        }

    def log(self, message: Message, **more: Any) -> None:
        level, text = message
        self.logger.log(level, text, self.fields(**more), extra=self.extra)

    def outcome(self, action: str, reason: str = "") -> Resent:
        return Resent(
            self.key, self.task_id, self.task_name, self.token, self.attempt, action, reason
        )


def sweep_setup(
    app: Celery | None, limit: int, using: str | None
) -> tuple[Celery, FencedSettings, str]:
    """A sweep's app (the current one by default), settings and lease database alias;
    ``ValueError`` for a ``limit`` that is not an integer of 1 or more."""
    if app is None:
        app = current_app
    settings = conf.load(app)
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit must be an integer of 1 or more, got {limit!r}")
    return app, settings, store.database_alias(using)


def sweep(app: Celery, claim: Callable[[], tuple[list[Claimed], bool]]) -> list[Resent]:
    """Handle batches of ``claim()`` (its rows, and whether more may be due) until none
    is left or a sending failed (the next sweep retries it)."""
    outcomes: list[Resent] = []
    while True:
        claimed, more = claim()
        batch = [resend(app, row) for row in claimed]
        outcomes += batch
        if not more or any(o.action == "failed" for o in batch):
            return outcomes


def resend(app: Celery, row: Claimed) -> Resent:
    """Send ``row``'s job again — or revoke it (expired), or abandon it."""
    try:
        job: Job | None = decode_job(row.job)
        unreadable = ""
    except ValueError as exc:
        job, unreadable = None, f"unreadable job: {exc}"
    if job is not None and row.expired(job):
        return revoke(app, row, job)
    exhausted = row.exhausted()
    if exhausted:
        row.log(row.exhausted_message, reason=exhausted)
        return abandon(row, exhausted)
    if job is None:
        row.log(row.abandoned_message, reason=unreadable)
        return abandon(row, unreadable)
    try:
        send_job(app, job, row.task_id, **row.send_options())
    except Exception as exc:
        row.log(row.unsent_message, exc=exc)
        row.unclaim()
        return row.outcome("failed", repr(exc))
    row.sent(job)
    row.log(row.resent_message)
    signal(signals.lease_resent, row, attempt=row.attempt)
    return row.outcome("resent")


def abandon(row: Claimed, reason: str) -> Resent:
    """Abandon ``row`` (its ``lease_abandoned`` signal sent)."""
    row.abandon(reason)
    signal(signals.lease_abandoned, row, reason=reason)
    return row.outcome("abandoned", reason)


def revoke(app: Celery, row: Claimed, job: Job | None) -> Resent:
    """An expired job's row: its ``REVOKED`` outcome recorded and the row ended; an
    outcome that cannot be recorded leaves the row to the next sweep."""
    try:
        ended = row.end_revoked(app, job)
    except Exception as exc:
        row.log(row.unrevoked_message, exc=exc)
        row.unclaim()
        return row.outcome("failed", f"expired: {exc!r}")
    if not ended:  # released or taken over since the claim: its holder records the outcome
        return row.outcome("skipped", "its grant ended meanwhile")
    row.revoked()
    row.log(row.revoked_message)
    return row.outcome("revoked", "expired")


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


def signal(signal: Signal, row: Claimed, **extra: Any) -> None:
    """A lease signal for ``row`` (a pending job's has no token: it was never granted)."""
    signals.send(
        signal,
        Lease,
        key=row.key,
        token=row.token,
        owner=row.owner,
        task_id=row.task_id,
        task_name=row.task_name,
        **extra,
    )
