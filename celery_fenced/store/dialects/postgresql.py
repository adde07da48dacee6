"""PostgreSQL: every operation, its event included, in one statement."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from django.db import IntegrityError, NotSupportedError
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.utils import CursorWrapper

from celery_fenced import conf
from celery_fenced.models import Lease
from celery_fenced.store.dialects import prepared
from celery_fenced.store.dialects.rows import TOO_MANY, aware, holder_of, released_detail
from celery_fenced.store.dialects.sql import SQLDialect
from celery_fenced.store.dialects.statements import postgresql as sql
from celery_fenced.store.types import (
    RESULT_COLUMNS,
    Claim,
    Completed,
    Deduplicated,
    Ending,
    Grant,
    GrantRequest,
    Holder,
    Pending,
)

if TYPE_CHECKING:
    from typing_extensions import LiteralString


#: how many times a permit's one-statement grant runs while it loses races for free permits
PERMIT_RACES = 8


def result_lock(task_id: str) -> str:
    """The name of ``task_id``'s advisory result lock."""
    return f"celery_fenced.result:{task_id}"


class PostgreSQL(SQLDialect):
    """One statement per operation: the state change and its event in one CTE."""

    def __init__(self, alias: str, connection: BaseDatabaseWrapper | None = None) -> None:
        super().__init__(alias, connection, sql, next_token=self._permit_token)

    def _cursor(self) -> CursorWrapper:
        """On Django's connection, with ``fenced_prepare``, a cursor that prepares each
        statement (:mod:`.prepared`); a kept connection prepares its own (its ``OPTIONS``).
        """
        connection = self.connection
        if self._prepares(connection):
            return prepared.cursor(connection)
        return connection.cursor()

    def _prepares(self, connection: BaseDatabaseWrapper) -> bool:
        """Whether the store prepares its statements on Django's ``connection`` itself
        (``fenced_prepare``; a kept connection prepares by its own ``OPTIONS``)."""
        return self._connection is None and prepared.preparing(connection) and conf.load().prepare

    def _fetch(self, sql: str, params: Sequence[Any] | Mapping[str, Any]) -> list[tuple[Any, ...]]:
        """The statement's rows; run once more on a new session when a migration changed
        a column a prepared statement returns (its session's statement is stale for
        good), outside a transaction."""
        try:
            return self._send(sql, params)
        except NotSupportedError as exc:
            connection = self.connection
            if (
                self._connection is not None
                or not prepared.plan_changed(exc)
                or not prepared.replaceable(connection)
            ):
                raise
            prepared.end_session(connection)
            return self._send(sql, params)

    def _send(self, sql: str, params: Sequence[Any] | Mapping[str, Any]) -> list[tuple[Any, ...]]:
        """On a cursor kept with the session when nothing else looks at the connection's
        cursors (:func:`.prepared.fetch`), else on a cursor of Django's (:meth:`_cursor`)."""
        connection = self.connection
        prepare = self._prepares(connection)
        rows = (
            prepared.fetch(connection, sql, params, prepare=prepare)
            if prepare or self._connection is not None
            else None
        )
        return rows if rows is not None else super()._fetch(sql, params)

    def estimated_rows(self, table: str) -> int | None:
        rows = self._fetch(sql.ESTIMATED_ROWS, {"table": self.connection.ops.quote_name(table)})
        estimate = rows[0][0] if rows else None
        return int(estimate) if estimate is not None and estimate > 0 else None

    def claim_expired(
        self, *, grace: float, resend_after: float, max_attempts: int, limit: int
    ) -> list[Claim]:
        """The claim and the ``abandoned`` events in one statement."""
        fields = {
            "max": max_attempts,
            "grace": self.ttl_param(grace),
            "resend_after": self.ttl_param(resend_after),
            "limit": limit,
            "reason": TOO_MANY,
        }
        return [Claim(*row) for row in self._fetch(sql.CLAIM, fields)]

    def acquire(self, request: GrantRequest) -> Grant | Holder | Completed:
        if request.limit is not None:
            return self._grant_permit(request)
        key, task_id, delivery = request.key, request.task_id, request.delivery
        granted = self._routine_grant(request)
        if granted is not None:
            return granted
        unless_completed, fields = self._grant_fields(request)
        for attempt in range(3):
            # a takeover is always recorded, and the job it displaces handed to the outbox
            rows = self._fetch(sql.GRANT_TAKEOVER[_pending_end(request), unless_completed], fields)
            if rows:
                return _grant(rows[0])
            # not granted (rare): a completed duplicate, the key held, or the row changed
            # after this statement's snapshot (then granted again, from a new one)
            if (
                delivery is not None
                and unless_completed
                and self.completed(key, delivery, request.window)
            ):
                return Completed(task_id, delivery.retries)
            # the busy event and the end of the job's pending row, with the holder; none
            # when the row is free by now (unless the last attempt): granted again
            rows = self._fetch(sql.BUSY[request.ends_pending], {**fields, "last": attempt == 2})
            if rows:
                return holder_of(rows)
        return holder_of([])

    def _grant_fields(self, request: GrantRequest) -> tuple[bool, dict[str, Any]]:
        """Whether the grant checks for a completed duplicate, and the parameters of every
        grant statement (:data:`~.statements.postgresql.GRANT_ROUTINE`, ...)."""
        delivery = request.delivery
        unless_completed = delivery is not None and bool(delivery.task_id)
        fields = {
            "key": request.key,
            "owner": request.owner,
            "task_id": request.task_id,
            "task_name": request.task_name,
            "ttl": self.ttl_param(request.ttl),
            "job": request.job,
            "routine_events": request.routine_events,
            "nesting": request.nesting,
            "limit": request.limit,
            **(
                self._marked_fields(request.key, delivery, request.window)
                if delivery is not None and unless_completed
                else {}
            ),
        }
        return unless_completed, fields

    def _routine_grant(self, request: GrantRequest) -> Grant | None:
        """The grant of a new or released key: the upsert alone, without the takeover's event.

        It is most grants, and the cheaper statement: the event table is not opened
        (planning work, most of it on a new connection: Celery opens one per task by
        default). None: not granted here — a takeover, a held key, a duplicate — and the
        full statement decides. With routine events its ``acquired`` event is written by
        the same statement.
        """
        unless_completed, fields = self._grant_fields(request)
        rows = self._fetch(
            sql.GRANT_ROUTINE[request.routine_events, _pending_end(request), unless_completed],
            fields,
        )
        return _grant(rows[0]) if rows else None

    def record_unique_pending(self, pending: Pending) -> str | Deduplicated:
        """:meth:`.PendingRows.record_unique` in one statement, without a lock on the copy
        that stands: the insert does nothing on a conflict (``ON CONFLICT DO NOTHING``
        locks no row, so a refused call in a transaction of its own never holds up the
        standing copy's grant); refused, the same statement reads that copy and, if it
        still stands, writes the ``deduplicated`` event. An ended copy's row is deleted
        by a conditional ``DELETE`` and the insert tried again. The recorded copy's key
        gets its lease row (token 0, never granted) in the same statement, before any
        worker can grant it, so a refused call only adds an event to it. A retry's
        publish, a conflict on the task id (a row of the same job recorded without the
        key), and the same task id again (its row restarted, as on every database) take
        the portable path."""
        if pending.same_job:
            return self._record_unique_portably(pending)
        fields = {
            **self._pending_fields(pending, unique=True),
            "full_task_name": pending.task_name,
        }
        mode = "until_done" if pending.unique == "until_done" else "until_started"
        for _attempt in range(8):
            rows = self._fetch(sql.RECORD_UNIQUE_PENDING[mode], fields)
            if not rows:
                break  # a conflict on the task id: the same job's row, without the key
            recorded, task_id, is_ended, token, owner = rows[0]
            if recorded:
                return str(task_id)
            if task_id == pending.task_id:  # this very job, recorded before: started afresh
                return self._record_unique_portably(pending)
            if not is_ended:
                if owner is None:  # the key's row is being created, not yet visible
                    return Deduplicated(
                        str(task_id),
                        *self.events.record_deduplicated(
                            pending.key, pending.task_name, str(task_id), pending.task_id
                        ),
                    )
                return Deduplicated(str(task_id), int(token) or None, str(owner))
            self._fetch(sql.DELETE_ENDED_COPY[mode], {"key": pending.key})
        return self._record_unique_portably(pending)

    def _grant_permit(self, request: GrantRequest) -> Grant | Holder | Completed:
        """A free permit of the key in one statement, its event and the end of the job's
        pending row with it; else (the key's permit rows not made yet, all held, a
        completed duplicate, a free permit locked by another statement) the portable
        transaction decides (:mod:`.permits`).

        Acquirers of one key's permits share no row: each locks the free permit it takes
        (``FOR UPDATE SKIP LOCKED``: one held by another acquirer is passed over), and the
        token is the head's floor plus the next value of a sequence — distinct, in the
        order the grants take them, above every token the key had before its permits.

        A statement that grants none though its snapshot shows a permit this job may take
        lost a race for it (another statement locked it first, or changed it since the
        snapshot): it says so with a row of NULLs and runs again, from a new snapshot,
        up to :data:`PERMIT_RACES` times, rather than queue on the transaction's path,
        whose locks on every permit row would make the acquirers around it lose too.

        The grant's times (``acquired_at``, its expiry, its event) are the clock read once,
        after the statement took its snapshot: ``statement_timestamp()`` is older than the
        snapshot, and a release committed in between is seen — the grant must not start
        before it.
        """
        assert request.limit is not None
        unless_completed, fields = self._grant_fields(request)
        end = _pending_end(request)
        routine = request.routine_events, end, unless_completed
        for _attempt in range(PERMIT_RACES):
            rows = self._unless_conflicting(sql.GRANT_PERMIT_ROUTINE[routine], fields)
            if not rows:
                rows = self._unless_conflicting(sql.GRANT_PERMIT[end, unless_completed], fields)
            if not rows:
                break  # none free for this job as the snapshot shows it: the transaction
            lease_id, token, expires_at, reclaimed_from, marker, key, before = rows[0]
            if lease_id is None:
                continue  # lost a race for a free permit: a new snapshot may show another
            previous = aware(before) if reclaimed_from and before is not None else None
            return Grant(lease_id, token, aware(expires_at), reclaimed_from, marker, key, previous)
        return self.pending.ending_with_grant(request, self.permits.grant)

    def _unless_conflicting(
        self, statement: LiteralString, params: dict[str, Any]
    ) -> list[tuple[Any, ...]]:
        """``statement``'s rows; none when it broke a unique constraint — a delivery of the
        same job granted another permit of the key meanwhile (the transaction then
        decides). In a transaction of the caller's, the statement runs in a savepoint."""
        connection = self.connection
        savepoint = connection.savepoint() if connection.in_atomic_block else None
        try:
            rows = self._fetch(statement, params)
        except IntegrityError:
            if savepoint is not None:
                connection.savepoint_rollback(savepoint)
            return []
        if savepoint is not None:
            connection.savepoint_commit(savepoint)
        return rows

    def _permit_token(self, head: Lease, rows: Iterable[Lease]) -> int:
        """The head's floor plus the sequence's next value (see :meth:`_grant_permit`)."""
        return int(self._fetch(sql.PERMIT_TOKEN, {"floor": head.token})[0][0])

    RELEASES_WITH_RESULT = True

    def release_with_result(self, ending: Ending, row: Sequence[Any]) -> tuple[bool, int | None]:
        """:meth:`release_current` with an ``INSERT … ON CONFLICT`` of the result in its CTE.

        The insert reads the result lock's row, which exists only when the release held:
        refused, nothing is written.
        """
        if self._release(ending, holder_only=False, lock_result=True, result=row):
            return True, ending.token
        return False, self._current_token(ending.key)

    def _release(
        self,
        ending: Ending,
        *,
        holder_only: bool,
        lock_result: bool,
        result: Sequence[Any] | None = None,
    ) -> list[tuple[Any, ...]]:
        """The releasing ``UPDATE`` with what goes with it: the rows released.

        ``holder_only`` also requires the owner to match; ``lock_result`` takes
        ``ending.task_id``'s result lock in the same statement (:meth:`lock_for_result`).
        A completing release moves the row's previous completion marker, if another
        job's, to the ``Completion`` table (read from the snapshot: only this grant's
        release changes the marker, and this grant is held). The ``released`` event is
        written with routine events only. ``result`` (with ``lock_result``): the values of
        the task's result row, written under the result lock (:meth:`release_with_result`).
        """
        state, delivery = ending.state, ending.delivery
        marker = self._completion_params(state, delivery)
        # known from the grant: the row holds no other job's marker, nothing to move
        completion = ("move" if ending.displaces is not False else "complete") if marker else ""
        writes = "" if not lock_result else "lock" if result is None else "write"
        fields = {
            "key": ending.key,
            "token": ending.token,
            "only_owner": ending.owner if holder_only else None,
            "state": state[:16],
            "digest": marker[0] if marker else None,
            "retries": marker[1] if marker else None,
            "task_id": ending.task_id,
            "owner": ending.owner,
            "detail": json.dumps(released_detail(state, delivery)),
            "lock": result_lock(ending.task_id),
            **{
                f"result_{column}": value
                for column, value in zip(RESULT_COLUMNS, result or (), strict=result is not None)
            },
        }
        return self._fetch(sql.RELEASE[completion, ending.routine_events, writes], fields)

    def release(self, ending: Ending) -> bool:
        return bool(self._release(ending, holder_only=True, lock_result=False))

    def force_release(
        self, key: str, by: str, task_id: str | None = None, token: int | None = None
    ) -> tuple[int, str] | None:
        fields = {"key": key, "task_id": task_id, "token": token, "by": by}
        rows = self._fetch(sql.FORCE_RELEASE, fields)
        return (rows[0][0], rows[0][1]) if rows else None

    def lock_for_result(self, task_id: str) -> None:
        """A transaction-scoped advisory lock on the task id (the row may not exist yet)."""
        self._fetch(sql.LOCK_FOR_RESULT, {"lock": result_lock(task_id)})

    def prove_current(self, key: str, token: int) -> tuple[bool, int | None]:
        rows = self._fetch(sql.PROVE_CURRENT, {"key": key})
        if not rows:
            return False, None
        current, live = rows[0]
        return (current == token and bool(live)), current

    def release_current(self, ending: Ending) -> tuple[bool, int | None]:
        """One conditional ``UPDATE`` (it locks the row) with its event: proof and release.

        A grant that expired with no successor (still the key's token, never released)
        is still this execution's: nobody holds a newer token, and the row lock keeps it
        so until the result commits. The same statement takes ``task_id``'s result lock
        (see :meth:`lock_for_result`).
        """
        if self._release(ending, holder_only=False, lock_result=True):
            return True, ending.token
        return False, self._current_token(ending.key)


def _pending_end(request: GrantRequest) -> str:
    """What a grant does to the job's pending row: nothing, ``"end"`` it, or ``"stamp"``
    an ``until_done`` row with its token (it stands for the running copy until then)."""
    if not request.ends_pending:
        return ""
    return "stamp" if request.stamps_started else "end"


def _grant(row: tuple[Any, ...]) -> Grant:
    """A grant from its statement's row; a takeover's row also has the expiry of the grant
    it took over (read from the statement's snapshot: the row before it)."""
    lease_id, token, expires_at, reclaimed_from, marker, *previous = row
    before = (
        aware(previous[0]) if previous and previous[0] is not None and reclaimed_from else None
    )
    return Grant(lease_id, token, aware(expires_at), reclaimed_from, marker, "", before)
