"""What the dialects return and record: grants, holders, claims, event details."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from django.utils.dateparse import parse_datetime
from django_celery_results.models import TaskResult

from celery_fenced.models import Completion, Lease, LeaseEvent, PendingJob

LEASE = Lease._meta.db_table
EVENT = LeaseEvent._meta.db_table
COMPLETION = Completion._meta.db_table
PENDING = PendingJob._meta.db_table
RESULT = TaskResult._meta.db_table

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
#: the same columns as SQL text (the statements are built from fixed text only), and what
#: a write over an existing row changes: what ``DatabaseBackend`` writes, not the row's
#: creation or start time
SQL_RESULT_COLUMNS = (
    "task_id, periodic_task_name, task_name, task_args, task_kwargs, status, worker, "
    "content_type, content_encoding, result, date_created, date_started, date_done, "
    "traceback, meta"
)
SQL_RESULT_UPDATE = (
    "periodic_task_name = EXCLUDED.periodic_task_name, task_name = EXCLUDED.task_name, "
    "task_args = EXCLUDED.task_args, task_kwargs = EXCLUDED.task_kwargs, "
    "status = EXCLUDED.status, worker = EXCLUDED.worker, "
    "content_type = EXCLUDED.content_type, content_encoding = EXCLUDED.content_encoding, "
    "result = EXCLUDED.result, date_done = EXCLUDED.date_done, "
    "traceback = EXCLUDED.traceback, meta = EXCLUDED.meta"
)


def _result_row_is_known() -> bool:
    """Whether the installed ``TaskResult`` has exactly :data:`RESULT_COLUMNS`, by name."""
    fields = [f for f in TaskResult._meta.concrete_fields if not f.primary_key]
    columns = [f.column for f in fields]
    return columns == [f.name for f in fields] and sorted(map(str, columns)) == sorted(
        RESULT_COLUMNS
    )


#: another version of the model (a column added or renamed) is written the general way
RESULT_ROW_KNOWN = _result_row_is_known()


#: the event kinds and reclaim states the SQL dialects write, as SQL literals: written out
#: (the SQL checker of tests/acceptance/test_security.py accepts only fixed text), and checked
#: against the model's enums by tests/unit/test_kinds.py
SQL_ACQUIRED = "'acquired'"
SQL_RECLAIMED = "'reclaimed'"
SQL_RELEASED = "'released'"
SQL_BUSY = "'busy'"
SQL_FORCE_RELEASED = "'force_released'"
SQL_ABANDONED = "'abandoned'"
SQL_STATE_RESENT = "'resent'"
SQL_STATE_ABANDONED = "'abandoned'"


@dataclass(frozen=True)
class Grant:
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
    """What tells one job's deliveries apart from another job's: the completed-duplicate check.

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
    key: str
    token: int
    owner: str
    ttl: float


def aware(value: Any) -> dt.datetime:
    if isinstance(value, str):
        parsed = parse_datetime(value)
        if parsed is None:  # pragma: no cover - the database wrote it
            raise ValueError(f"unparseable timestamp {value!r}")
        value = parsed
    if not isinstance(value, dt.datetime):  # pragma: no cover - the database wrote it
        raise TypeError(f"expected a timestamp, got {value!r}")
    if value.tzinfo is None:
        return value.replace(tzinfo=dt.timezone.utc)
    return value


TOO_MANY = "the job expired unfinished after the maximum number of re-sends"


def abandoned_detail(claim: Claim, max_attempts: int) -> dict[str, Any]:
    return {
        "task": claim.task_name,
        "attempts": claim.attempts,
        "max": max_attempts,
        "reason": TOO_MANY,
    }


def released_detail(state: str, delivery: Delivery | None = None) -> dict[str, Any]:
    """The detail of a ``released`` event: the final state and the delivery it ended."""
    detail: dict[str, Any] = {"state": state} if state else {}
    if delivery is not None:
        detail["retries"] = delivery.retries
        detail["digest"] = delivery.digest
    return detail


def completes(state: str, delivery: Delivery | None) -> bool:
    """Whether a release in ``state`` marks ``delivery``'s job completed."""
    return delivery is not None and state in COMPLETED_STATES


def holder_of(rows: Sequence[Sequence[Any]]) -> Holder:
    if not rows:
        # The row was released between the two statements: report a zero wait.
        return Holder(0, "", dt.datetime.now(dt.timezone.utc), 0.0)
    token, owner, expires_at, remaining = rows[0]
    return Holder(token, owner, aware(expires_at), float(remaining))


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
