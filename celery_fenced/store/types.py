"""The values the lease store takes and returns: grants, holders, claims, pending jobs.

Plain frozen dataclasses, read and built by the store's callers (the backend, the
reclaimer, the outbox) and by its dialects; :mod:`celery_fenced.store` re-exports the ones
its callers name.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

#: django-celery-results' result row as a fenced success writes it in the statement that
#: releases the lease (PostgreSQL): every column but the id, in this order
RESULT_COLUMNS = (
    "task_id",
    "periodic_task_name",
    "task_name",
    "task_args",
    "task_kwargs",
    "status",
    "worker",
    "content_type",
    "content_encoding",
    "result",
    "date_created",
    "date_started",
    "date_done",
    "traceback",
    "meta",
)


@dataclass(frozen=True)
class Grant:
    """A grant made: the lease row, its token and expiry, and whose grant it took over."""

    lease_id: int
    token: int
    expires_at: dt.datetime
    reclaimed_from: str
    #: the row's completion marker as the grant left it (None: not read)
    marker: str | None = None
    #: the granted row's key when it is not the requested one: a permit's
    key: str = ""
    #: a takeover's: when the grant it took over had expired (the database's clock)
    previous_expires_at: dt.datetime | None = None


@dataclass(frozen=True)
class Holder:
    """The grant that holds a busy key: its token, owner, expiry and seconds left."""

    token: int
    owner: str
    expires_at: dt.datetime
    remaining: float


@dataclass(frozen=True)
class Completed:
    """The grant was refused: this task id already completed (a duplicate delivery)."""

    task_id: str
    retries: int


@dataclass(frozen=True)
class Delivery:
    """What tells one job's deliveries apart from another job's (completed duplicates).

    ``digest`` hashes the task id with the message (task name and arguments), so a task id
    reused for a new job with other arguments is not a duplicate; ``retries`` is the
    delivery's retry count as the body sees it (re-sends of the package's own — busy,
    lost grant, database error — keep it), so a retry the body asked for before its
    execution ended still runs.
    """

    task_id: str
    digest: str
    retries: int
    #: Celery's ``replaced_task_nesting`` of the message: a task that replaced itself keeps
    #: its task id, and only a delivery of this replacement or a later one ends the
    #: outbox row of a replacement
    nesting: int = 0


@dataclass(frozen=True)
class Displaced:
    """The grant a takeover replaces, as its lease row held it before."""

    key: str
    task_id: str
    task_name: str
    job: str | None
    released: bool
    reclaim_state: str
    reclaim_attempts: int


@dataclass(frozen=True)
class GrantRequest:
    """What a grant asks for: the key, for how long, for whom, and the job behind it.

    ``job`` is the encoded message the reclaimer re-sends if the grant expires unfinished;
    with a ``delivery`` nothing is granted when its job completed within ``window`` seconds.
    """

    key: str
    ttl: float
    owner: str
    task_id: str
    task_name: str
    job: str | None = None
    delivery: Delivery | None = None
    window: float = 0.0
    #: record an ``acquired`` event (``fenced_events="all"``); a takeover is always recorded
    routine_events: bool = False
    #: the grant (or a busy key) ends the task id's pending row (the outbox)
    ends_pending: bool = False
    #: the task is ``lease_unique="until_done"``: the grant stamps its row instead
    stamps_started: bool = False
    #: ``lease_limit``: grant one of this many permits of the key (None: the key itself)
    limit: int | None = None

    @property
    def nesting(self) -> int:
        """The delivery's replacement count: it ends no outbox row of a later replacement
        of its task (one that task sent when it replaced itself keeps the task id)."""
        return self.delivery.nesting if self.delivery is not None else 0


@dataclass(frozen=True)
class Ending:
    """The end of one grant: whose it is, the state it ends in, the delivery it ends."""

    key: str
    token: int
    owner: str
    task_id: str
    state: str = ""
    delivery: Delivery | None = None
    #: record a ``released`` event (``fenced_events="all"``)
    routine_events: bool = False
    #: whether the row holds another job's completion marker, which a completing release
    #: moves to the ``Completion`` table (None: not known, the statement finds out)
    displaces: bool | None = None


#: the release state of an execution that replaced itself (``Task.replace``): the
#: replacement, sent in the same transaction, does the rest of the job
REPLACED = "REPLACED"
#: the states of a release that mark its delivery's attempt finished: a
#: RETRY release comes after the retry message (retries + 1) was sent, so only that one,
#: not a copy of this attempt's message, runs the job on
COMPLETED_STATES = ("SUCCESS", "FAILURE", REPLACED, "RETRY")


@dataclass(frozen=True)
class Claim:
    """An expired, unfinished grant claimed by one reclaimer (or abandoned by it)."""

    lease_id: int
    key: str
    token: int
    owner: str
    task_id: str
    task_name: str
    job: str
    attempts: int
    state: str  # "resent": send the job again; "abandoned": too many attempts

    @classmethod
    def of_lease(cls, row: Any, attempts: int, state: str) -> Claim:
        """The claim of a ``Lease`` row (as the ORM reads it)."""
        return cls(
            row.pk,
            row.key,
            row.token,
            row.owner,
            row.task_id,
            row.task_name,
            row.job or "",
            attempts,
            state,
        )


@dataclass(frozen=True)
class Renewal:
    """One held lease to renew: its key, token and owner, and its new time to live."""

    key: str
    token: int
    owner: str
    ttl: float


@dataclass(frozen=True)
class Deduplicated:
    """A ``lease_unique`` publish refused, its ``deduplicated`` event written.

    A copy of its key stands (``standing``, its task id); the event is written by the
    statement that refused it where the database can (PostgreSQL), else in its
    transaction. ``token`` and ``owner``: the key's current token (None before any
    grant) and owner.
    """

    standing: str
    token: int | None
    owner: str


@dataclass(frozen=True)
class Pending:
    """What a publish records: the job and when it is due to be sent again."""

    task_id: str
    task_name: str
    key: str
    job: str
    #: seconds from now the job may run (its countdown), or None
    countdown: float | None
    #: the job's absolute ETA, or None
    eta: dt.datetime | None
    #: seconds from now after which it is never sent again, or an absolute time, or None
    expires: float | dt.datetime | None
    resend_after: float
    #: ``lease_unique`` ("until_started", "until_done"), or None
    unique: str | None = None
    #: a re-publish of the job running now (its retry): it keeps its place
    same_job: bool = False
    #: a plain task's job (no lease): its row ends when a worker starts it, not at a grant
    plain: bool = False
    #: Celery's ``replaced_task_nesting`` of the message (see :class:`Delivery`)
    nesting: int = 0
