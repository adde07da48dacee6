"""PostgreSQL: every operation, its event included, in one statement."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, ClassVar

from celery_fenced.store.dialects.records import (
    COMPLETION,
    EVENT,
    LEASE,
    PENDING,
    RESULT,
    RESULT_COLUMNS,
    SQL_ABANDONED,
    SQL_ACQUIRED,
    SQL_BUSY,
    SQL_FORCE_RELEASED,
    SQL_RECLAIMED,
    SQL_RELEASED,
    SQL_RESULT_COLUMNS,
    SQL_RESULT_UPDATE,
    SQL_STATE_ABANDONED,
    TOO_MANY,
    Claim,
    Completed,
    Ending,
    Grant,
    GrantRequest,
    Holder,
    Pending,
    aware,
    holder_of,
    released_detail,
)
from celery_fenced.store.dialects.sql import SQLDialect, Statements
from celery_fenced.store.dialects.statements import postgresql as sql

#: where permits' tokens come from (migration 0007_permits)
SEQUENCE = "celery_fenced_permit_token"
#: the values of a result row written by the releasing statement
RESULT_WIDTH = len(RESULT_COLUMNS)


def result_lock(task_id: str) -> str:
    """The name of ``task_id``'s advisory result lock."""
    return f"celery_fenced.result:{task_id}"


class PostgreSQL(SQLDialect):
    """One statement per operation: the state change and its event in one CTE."""

    SQL: ClassVar[Statements] = sql
    NOW = "statement_timestamp()"
    JSON = "%s::jsonb"

    def expiry(self, ttl_sql: str) -> str:
        return f"(statement_timestamp() + ({ttl_sql})::float8 * interval '1 second')"

    def _conflict_times(self) -> str:
        # the conflict clause runs once the row is locked: a release this grant waited for
        # committed before then, and ``statement_timestamp()`` (the proposed row's) is
        # older than that release; the grant starts now, its ttl unchanged
        return (
            "acquired_at = clock_timestamp(), renewed_at = clock_timestamp(), "
            "expires_at = excluded.expires_at + (clock_timestamp() - excluded.acquired_at)"
        )

    def remaining(self, column: str) -> str:
        return f"GREATEST(EXTRACT(EPOCH FROM {column} - statement_timestamp()), 0)::float8"

    # VALUES needs typed columns for the comparisons with bigint and the interval
    VALUES_ROW = "(%s, %s::bigint, %s, %s::float8)"
    # concurrent reclaimers take different rows instead of queueing on the same ones
    LOCK_SKIP = "FOR UPDATE SKIP LOCKED"

    def ago(self, seconds_sql: str) -> str:
        return f"(statement_timestamp() - ({seconds_sql})::float8 * interval '1 second')"

    def estimated_rows(self, table: str) -> int | None:
        rows = self._fetch(
            "SELECT reltuples FROM pg_class WHERE oid = to_regclass(%s)",
            [self.connection.ops.quote_name(table)],
        )
        estimate = rows[0][0] if rows else None
        return int(estimate) if estimate is not None and estimate > 0 else None

    def claim_expired(
        self, *, grace: float, resend_after: float, max_attempts: int, limit: int
    ) -> list[Claim]:
        """The claim and the ``abandoned`` events in one statement."""
        claim_sql, _ = self._claim_sql()
        rows = self._fetch(
            f"""WITH c AS ({claim_sql}),
                ev AS (
                    INSERT INTO {EVENT} (lease_id, kind, token, task_id, owner, at, detail)
                    SELECT id, {SQL_ABANDONED}, token, task_id, owner, statement_timestamp(),
                           jsonb_build_object('task', task_name, 'attempts', reclaim_attempts,
                                              'max', %s::int, 'reason', %s::text)
                    FROM c WHERE reclaim_state = {SQL_STATE_ABANDONED})
                SELECT * FROM c""",
            [
                *self._claim_params(grace, resend_after, max_attempts, limit),
                max_attempts,
                TOO_MANY,
            ],
        )
        return [Claim(*row) for row in rows]

    def acquire(self, request: GrantRequest) -> Grant | Holder | Completed:
        if request.limit is not None:
            return self._grant_permit(request)
        key, task_id, delivery = request.key, request.task_id, request.delivery
        granted = self._routine_grant(request)
        if granted is not None:
            return granted
        unless_completed, params = self._grant_params(request)
        grant = (
            self._upsert(unless_completed=True, unchanged=True)
            if unless_completed
            else self._upsert(unchanged=True)
        )
        for attempt in range(3):
            # a takeover is always recorded, and the job it displaces handed to the outbox
            rows = self._grant_with_event(grant, [*params, key], request, takeover=True)
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
            rows = self._busy(request, last=attempt == 2)
            if rows:
                return holder_of(rows)
        return holder_of([])

    def _busy(self, request: GrantRequest, *, last: bool) -> list[tuple[Any, ...]]:
        """The busy event and the end of the job's pending row, with the holder; none
        when the row is free by now (unless ``last``): the grant is tried again."""
        held = "TRUE" if last else "released_at IS NULL AND expires_at > statement_timestamp()"
        return self._fetch(
            f"""WITH holder AS (
                    SELECT id, token, owner, expires_at,
                           {self.remaining("expires_at")} AS remaining
                    FROM {LEASE} WHERE key = %s AND {held}),
                ev AS (
                    INSERT INTO {EVENT} (lease_id, kind, token, task_id, owner, at, detail)
                    SELECT id, {SQL_BUSY}, token, %s, %s, statement_timestamp(),
                           jsonb_build_object('holder', owner)
                    FROM holder){self._end_pending(granted=False) if request.ends_pending else ""}
                SELECT token, owner, expires_at, remaining FROM holder""",
            [
                request.key,
                request.task_id,
                request.owner,
                *self._end_pending_params(request, granted=False),
            ],
        )

    def record_unique_pending(self, pending: Pending) -> str:
        """:meth:`PortableOperations.record_unique_pending` without a lock on the copy
        that stands: the insert does nothing on a conflict (``ON CONFLICT DO NOTHING``
        locks no row, so a refused call in a transaction of its own never holds up the
        standing copy's grant); refused, a read of that copy tells whether it still
        stands; an ended copy's row is deleted by a conditional ``DELETE`` and the insert
        tried again. The recorded copy's key gets its lease row (token 0, never granted)
        in the same statement, before any worker can grant it, so a refused call only
        adds an event to it. A retry's publish, and a conflict on the task id (a row of
        the same job recorded without the key), take the portable path."""
        if pending.same_job:
            return super().record_unique_pending(pending)
        eta, relative_expiry = pending.eta, isinstance(pending.expires, int | float)
        values = f"""INSERT INTO {PENDING} (task_id, task_name, key, job, published_at, eta,
                    expires_at, resend_at, sends, unsent, abandoned_at, abandoned_reason,
                    unique_key, unique_until, started_token, plain, nesting)
                VALUES (%s, %s, %s, %s, {self.NOW},
                        {"%s" if eta is not None or not pending.countdown else self.expiry("%s")},
                        {self.expiry("%s") if relative_expiry else "%s"},
                        {"%s" if eta is not None else self.expiry("%s")},
                        0, %s, NULL, '', %s, %s, NULL, %s, %s)"""
        params = self._pending_params(pending, unique=True)
        ended = (
            self._ended_sql_until_done()
            if pending.unique == "until_done"
            else self._ended_sql_until_started()
        )
        for _attempt in range(8):
            rows = self._fetch(
                f"""WITH ins AS ({values} ON CONFLICT DO NOTHING RETURNING task_id, key),
                    head AS ({self._never_granted("key")} FROM ins
                             ON CONFLICT (key) DO NOTHING)
                    SELECT task_id FROM ins""",
                [*params, pending.task_name[:255]],
            )
            if rows:
                return str(rows[0][0])
            standing = self._fetch(
                f"SELECT task_id, {ended} FROM {PENDING} p WHERE unique_key = %s",
                [pending.key],
            )
            if not standing:
                break  # a conflict on the task id: the same job's row, without the key
            task_id, is_ended = standing[0]
            if not is_ended:
                return str(task_id)  # refused (or this very job, recorded before)
            self._fetch(
                f"DELETE FROM {PENDING} p WHERE unique_key = %s AND {ended} RETURNING id",
                [pending.key],
            )
        return super().record_unique_pending(pending)

    @staticmethod
    def _never_granted(key_sql: str) -> str:
        """``INSERT … SELECT`` of a key's lease row before any grant (token 0, released);
        ``key_sql``: the key's SQL (a parameter or a column); then the task name's
        parameter."""
        return f"""INSERT INTO {LEASE} (key, token, owner, task_id, task_name, acquired_at,
                                   renewed_at, expires_at, released_at, reclaimed_from, job,
                                   reclaim_attempts, reclaim_state, reclaim_claimed_at,
                                   completed_digest, release_state, permits)
                   SELECT {key_sql}, 0, '', '', %s, statement_timestamp(),
                          statement_timestamp(), statement_timestamp(),
                          statement_timestamp(), '', NULL, 0, '', NULL, '', '', 0"""

    def _ended_sql_until_done(self) -> str:
        """Whether pending row ``p`` no longer stands for an ``until_done`` copy (see
        :meth:`PortableOperations._ended_copies`): abandoned, expired before it started,
        or started under a grant that has ended (a newer grant, a release, an expiry)."""
        return f"""(p.abandoned_at IS NOT NULL
                    OR (p.expires_at <= statement_timestamp() AND p.started_token IS NULL)
                    OR (p.started_token IS NOT NULL AND EXISTS (
                        SELECT 1 FROM {LEASE} l WHERE l.key = p.key
                        AND (l.token > p.started_token
                             OR (l.token = p.started_token
                                 AND (l.released_at IS NOT NULL
                                      OR l.expires_at <= statement_timestamp()))))))"""

    @staticmethod
    def _ended_sql_until_started() -> str:
        """Whether pending row ``p`` no longer stands for an ``until_started`` copy:
        abandoned, expired before it started, or started (any start ends it)."""
        return """(p.abandoned_at IS NOT NULL
                    OR (p.expires_at <= statement_timestamp() AND p.started_token IS NULL)
                    OR p.started_token IS NOT NULL)"""

    def record_deduplicated(
        self, key: str, task_name: str, standing: str, refused: str
    ) -> tuple[int | None, str]:
        """The ``deduplicated`` event in one statement, the key's row created (token 0:
        never granted) when its first copy has not started yet."""
        rows = self._fetch(
            f"""WITH made AS ({self._never_granted("%s")}
                    ON CONFLICT (key) DO NOTHING
                    RETURNING id, token, owner),
                row AS (
                    SELECT id, token, owner FROM made
                    UNION ALL
                    SELECT id, token, owner FROM {LEASE}
                    WHERE key = %s AND NOT EXISTS (SELECT 1 FROM made)),
                ev AS (
                    INSERT INTO {EVENT} (lease_id, kind, token, task_id, owner, at, detail)
                    SELECT id, 'deduplicated', NULLIF(token, 0), %s, '', statement_timestamp(),
                           jsonb_build_object('refused_task_id', %s::text,
                                              'task_name', %s::text)
                    FROM row)
                SELECT token, owner FROM row""",
            [key, task_name[:255], key, standing, refused, task_name],
        )
        if not rows:  # the key's row is being created by a transaction not yet visible
            return super().record_deduplicated(key, task_name, standing, refused)
        token, owner = rows[0]
        return (int(token) or None), str(owner)

    def _end_pending(self, *, granted: bool) -> str:
        """CTEs ending the task id's pending row (the outbox; parameters:
        :meth:`_end_pending_params`).

        ``granted``: only if the statement's ``granted`` CTE granted — the job is then
        pending or granted, never neither; the row is deleted whatever it says (one of a
        ``lease_unique`` configuration since changed is not left for good). A busy key
        ends a row that has not started: the job is skipped, failed, or retried (and
        recorded again by its retry); a started row is the running copy's.
        """
        if not granted:  # only when the statement's ``holder`` CTE found the key held
            return f""",
                pend AS (DELETE FROM {PENDING} WHERE task_id = %s AND nesting <= %s
                         AND started_token IS NULL AND EXISTS (SELECT 1 FROM holder))"""
        return f""",
                pend AS (DELETE FROM {PENDING} WHERE task_id = %s AND nesting <= %s
                         AND EXISTS (SELECT 1 FROM granted))"""

    def _end_pending_stamping(self) -> str:
        """:meth:`_end_pending` of a granted ``lease_unique="until_done"`` task: its row
        is kept, stamped with the grant's token — it stands for the running copy until
        that grant ends (four parameters: the task id and the delivery's nesting, twice)."""
        return f""",
                pend AS (DELETE FROM {PENDING} WHERE task_id = %s AND nesting <= %s
                         AND unique_until <> 'until_done' AND EXISTS (SELECT 1 FROM granted)),
                began AS (UPDATE {PENDING} SET started_token = (SELECT token FROM granted)
                          WHERE task_id = %s AND nesting <= %s AND unique_until = 'until_done'
                          AND EXISTS (SELECT 1 FROM granted))"""

    @staticmethod
    def _end_pending_params(request: GrantRequest, *, granted: bool) -> list[Any]:
        if not request.ends_pending:
            return []
        ending = [request.task_id, request.nesting]
        return ending * (2 if granted and request.stamps_started else 1)

    def _routine_grant(self, request: GrantRequest) -> Grant | None:
        """The grant of a new or released key: the upsert alone, without the takeover's event.

        It is most grants, and the cheaper statement: the event table is not opened
        (planning work, most of it on a new connection: Celery opens one per task by
        default). None: not granted here — a takeover, a held key, a duplicate — and the
        full statement decides. With routine events its ``acquired`` event is written by
        the same statement.
        """
        unless_completed, params = self._grant_params(request)
        grant = (
            self._upsert(unless_completed=True, routine=True)
            if unless_completed
            else self._upsert(routine=True)
        )
        if request.routine_events:
            rows = self._grant_with_event(grant, params, request)
        elif request.ends_pending:
            rows = self._fetch(
                f"""WITH granted AS ({grant}){
                    self._end_pending_stamping()
                    if request.stamps_started
                    else self._end_pending(granted=True)
                }
                    SELECT id, token, expires_at, reclaimed_from, completed_digest
                    FROM granted""",
                [*params, *self._end_pending_params(request, granted=True)],
            )
        else:
            rows = self._fetch(grant, params)
        return _grant(rows[0]) if rows else None

    def release(self, ending: Ending) -> bool:
        return bool(self._release(ending, holder_only=True, lock_result=False))

    def force_release(
        self, key: str, by: str, task_id: str | None = None, token: int | None = None
    ) -> tuple[int, str] | None:
        only_task = "" if task_id is None else "AND task_id = %s"
        only_token = "" if token is None else "AND token = %s"
        rows = self._fetch(
            f"""WITH r AS (
                    UPDATE {LEASE} SET released_at = statement_timestamp(), job = NULL
                    WHERE key = %s AND released_at IS NULL {only_task} {only_token}
                    RETURNING id, token, owner, task_id, acquired_at),
                ev AS (
                    INSERT INTO {EVENT} (lease_id, kind, token, task_id, owner, at, detail)
                    SELECT id, {SQL_FORCE_RELEASED}, token, task_id, owner, statement_timestamp(),
                           jsonb_build_object('by', %s::text, 'acquired_at', acquired_at)
                    FROM r)
                SELECT token, owner FROM r""",
            [
                key,
                *([] if task_id is None else [task_id]),
                *([] if token is None else [token]),
                by,
            ],
        )
        return (rows[0][0], rows[0][1]) if rows else None

    def lock_for_result(self, task_id: str) -> None:
        """A transaction-scoped advisory lock on the task id (the row may not exist yet)."""
        self._fetch(
            "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", [result_lock(task_id)]
        )

    def prove_current(self, key: str, token: int) -> tuple[bool, int | None]:
        rows = self._fetch(
            f"""SELECT token, released_at IS NULL AND expires_at > statement_timestamp()
                FROM {LEASE} WHERE key = %s FOR UPDATE""",
            [key],
        )
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

    def _grant_with_event(
        self, grant: str, params: list[Any], request: GrantRequest, *, takeover: bool = False
    ) -> list[tuple[Any, ...]]:
        """``grant`` (an upsert of :meth:`_upsert`) with its event in the same statement.

        A takeover's ``reclaimed`` event always, an ``acquired`` one with routine events.
        The previous grant's start is read from the statement's snapshot: the row before it.
        ``takeover``: ``grant`` may take over an expired grant; another job's, unfinished,
        then goes to the outbox in the same statement (:meth:`_displaced`).
        """
        return self._fetch(
            f"""WITH granted AS ({grant}),
                ev AS (
                    INSERT INTO {EVENT} (lease_id, kind, token, task_id, owner, at, detail)
                    SELECT id, CASE WHEN reclaimed_from = ''
                                    THEN {SQL_ACQUIRED} ELSE {SQL_RECLAIMED} END,
                           token, %s, %s, clock_timestamp(),  -- after the grant's
                           CASE WHEN reclaimed_from = '' THEN '{{}}'::jsonb ELSE
                           jsonb_build_object(
                               'previous_owner', reclaimed_from,
                               'previous_token', token - 1,
                               'previous_acquired_at',
                               (SELECT p.acquired_at FROM {LEASE} p WHERE p.key = %s)) END
                    FROM granted WHERE reclaimed_from <> '' OR %s){
                self._displaced() if takeover else ""
            }{
                (
                    self._end_pending_stamping()
                    if request.stamps_started
                    else self._end_pending(granted=True)
                )
                if request.ends_pending
                else ""
            }
                SELECT id, token, expires_at, reclaimed_from, completed_digest,
                       (SELECT p.expires_at FROM {LEASE} p WHERE p.id = granted.id)
                FROM granted""",
            [
                *params,
                request.task_id,
                request.owner,
                request.key,
                request.routine_events,
                *([request.key, request.task_id] if takeover else []),
                *self._end_pending_params(request, granted=True),
            ],
        )

    @staticmethod
    def _displaced(*, by_id: bool = False) -> str:
        """A CTE handing the job of the grant taken over to the outbox, due at once, when
        it is another job's (parameters: the key, the new grant's task id).

        That grant expired unfinished, and its lease row's recorded job — what the
        reclaimer would send again — is replaced by the new grant's: without this, a job
        whose worker died and whose message the broker lost too would be lost. Its
        reclaim count goes with it (``sends``); a job already abandoned stays so. An
        ``until_done`` row stamped with that grant stands for it again, due at once. The
        row before the grant is read from the statement's snapshot. ``by_id``: the row is
        the granted one (a permit's: no parameter for the key).
        """
        return f""",
                displaced AS (
                    INSERT INTO {PENDING} AS q (task_id, task_name, key, job, published_at,
                        eta, expires_at, resend_at, sends, unsent, abandoned_at,
                        abandoned_reason, unique_key, unique_until, started_token, plain,
                        nesting)
                    SELECT p.task_id, p.task_name, p.key, p.job, statement_timestamp(), NULL,
                           NULL, statement_timestamp(), p.reclaim_attempts, false, NULL, '',
                           NULL, '', NULL, false, 0
                    FROM {LEASE} p, granted g
                    WHERE {"p.id = g.id" if by_id else "p.key = %s"}
                      AND g.reclaimed_from <> '' AND p.released_at IS NULL
                      AND p.job IS NOT NULL AND p.task_id NOT IN ('', %s)
                      AND p.reclaim_state <> {SQL_STATE_ABANDONED}
                    ON CONFLICT (task_id) DO UPDATE
                        SET started_token = NULL, resend_at = statement_timestamp()
                        WHERE q.started_token IS NOT NULL)"""

    def _grant_permit(self, request: GrantRequest) -> Grant | Holder | Completed:
        """A free permit of the key in one statement, its event and the end of the job's
        pending row with it; else (the key's permit rows not made yet, all held, a
        completed duplicate, a free permit locked by another statement) the portable
        transaction decides (:mod:`.permits`).

        Acquirers of one key's permits share no row: each locks the free permit it takes
        (``FOR UPDATE SKIP LOCKED``: one held by another acquirer is passed over), and the
        token is the head's floor plus the next value of a sequence — distinct, in the
        order the grants take them, above every token the key had before its permits.

        The grant's times (``acquired_at``, its expiry, its event) are the clock read once,
        after the statement took its snapshot: ``statement_timestamp()`` is older than the
        snapshot, and a release committed in between is seen — the grant must not start
        before it.
        """
        assert request.limit is not None
        delivery = request.delivery
        unless_completed = delivery is not None and bool(delivery.task_id)
        completed = (
            f"""AND NOT EXISTS ({self._completed_sql()})
                AND NOT EXISTS (SELECT 1 FROM {LEASE} mk
                                WHERE (mk.key = %s OR mk.key IN (SELECT name FROM names))
                                  AND {self._marked_sql("mk")})"""
            if unless_completed
            else ""
        )
        same = "l.released_at IS NULL AND l.task_id = %s AND l.task_id <> ''"
        rows = self._unless_conflicting(
            f"""WITH clock AS MATERIALIZED (  -- read after the snapshot (the docstring)
                    SELECT clock_timestamp() AS now),
                head AS (
                    SELECT token, permits FROM {LEASE}
                    WHERE key = %s AND permits >= %s AND released_at IS NOT NULL),
                names AS (
                    SELECT %s || chr(31) || g::text AS name, g < %s AS allowed
                    FROM head, generate_series(0, head.permits - 1) g),
                pick AS (
                    SELECT p.id FROM {LEASE} p
                    WHERE p.key IN (SELECT name FROM names WHERE allowed)
                      AND (p.released_at IS NOT NULL OR p.expires_at <= statement_timestamp())
                      AND NOT EXISTS (
                          SELECT 1 FROM {LEASE} x
                          WHERE x.key IN (SELECT name FROM names WHERE NOT allowed)
                            AND x.released_at IS NULL
                            AND x.expires_at > statement_timestamp())
                      {completed}
                      AND NOT EXISTS (  -- this job holds another permit of the key
                          SELECT 1 FROM {LEASE} s
                          WHERE s.permit_job = md5(%s || chr(31) || %s)
                            AND s.released_at IS NULL AND s.id <> p.id)
                    -- this job's own expired permit, else a released one before an
                    -- expired one (a paused holder is not displaced while one is free)
                    ORDER BY (p.released_at IS NULL AND p.task_id = %s) DESC,
                             p.released_at IS NULL, p.id
                    LIMIT 1 FOR UPDATE SKIP LOCKED),
                granted AS (
                    UPDATE {LEASE} l SET
                        token = (SELECT token FROM head) + nextval('{SEQUENCE}'),
                        owner = %s, task_id = %s, task_name = %s,
                        acquired_at = (SELECT now FROM clock),
                        renewed_at = (SELECT now FROM clock),
                        expires_at = (SELECT now FROM clock)
                                     + (%s)::float8 * interval '1 second',
                        released_at = NULL,
                        release_state = '',
                        reclaimed_from = CASE WHEN l.released_at IS NULL THEN l.owner ELSE '' END,
                        job = %s,
                        reclaim_attempts = CASE WHEN {same} THEN l.reclaim_attempts ELSE 0 END,
                        reclaim_state = '',
                        reclaim_claimed_at = CASE WHEN {same} THEN l.reclaim_claimed_at END,
                        permit_job = CASE WHEN %s <> '' THEN md5(%s || chr(31) || %s) END
                    FROM pick WHERE l.id = pick.id
                      AND (l.released_at IS NOT NULL OR l.expires_at <= statement_timestamp())
                      -- the row as this statement's snapshot read it: not a grant, nor a
                      -- completing release, committed since
                      AND l.xmin = (SELECT s.xmin FROM {LEASE} s WHERE s.id = pick.id)
                    RETURNING l.id, l.token, l.expires_at, l.reclaimed_from,
                              l.completed_digest, l.key),
                ev AS (
                    INSERT INTO {EVENT} (lease_id, kind, token, task_id, owner, at, detail)
                    SELECT g.id, CASE WHEN g.reclaimed_from = ''
                                      THEN {SQL_ACQUIRED} ELSE {SQL_RECLAIMED} END,
                           g.token, %s, %s, (SELECT now FROM clock),
                           CASE WHEN g.reclaimed_from = '' THEN '{{}}'::jsonb ELSE
                           jsonb_build_object('previous_owner', g.reclaimed_from,
                                              'previous_token', p.token,
                                              'previous_acquired_at', p.acquired_at) END
                    FROM granted g JOIN {LEASE} p ON p.id = g.id
                    WHERE g.reclaimed_from <> '' OR %s){self._displaced(by_id=True)}{
                (
                    self._end_pending_stamping()
                    if request.stamps_started
                    else self._end_pending(granted=True)
                )
                if request.ends_pending
                else ""
            }
                SELECT id, token, expires_at, reclaimed_from, completed_digest, key,
                       (SELECT p.expires_at FROM {LEASE} p WHERE p.id = granted.id)
                FROM granted""",
            [
                request.key,
                request.limit,
                request.key,
                request.limit,
                *(
                    [
                        *self._marked_params(delivery, request.window),
                        request.key,
                        *self._marked_params(delivery, request.window),
                    ]
                    if unless_completed and delivery is not None
                    else []
                ),
                request.key,
                request.task_id,
                request.task_id,
                request.owner,
                request.task_id,
                request.task_name,
                self.ttl_param(request.ttl),
                request.job,
                request.task_id,
                request.task_id,
                request.task_id,
                request.key,
                request.task_id,
                request.task_id,
                request.owner,
                request.routine_events,
                request.task_id,
                *self._end_pending_params(request, granted=True),
            ],
        )
        if rows:
            lease_id, token, expires_at, reclaimed_from, marker, key, before = rows[0]
            previous = aware(before) if reclaimed_from and before is not None else None
            return Grant(lease_id, token, aware(expires_at), reclaimed_from, marker, key, previous)
        return super().acquire(request)

    def _unless_conflicting(self, sql: str, params: list[Any]) -> list[tuple[Any, ...]]:
        """``sql``'s rows; none when it broke a unique constraint — a delivery of the same
        job granted another permit of the key meanwhile (the transaction then decides).
        In a transaction of the caller's, the statement runs in a savepoint."""
        from django.db import IntegrityError

        connection = self.connection
        savepoint = connection.savepoint() if connection.in_atomic_block else None
        try:
            rows = self._fetch(sql, params)
        except IntegrityError:
            if savepoint is not None:
                connection.savepoint_rollback(savepoint)
            return []
        if savepoint is not None:
            connection.savepoint_commit(savepoint)
        return rows

    def _permit_token(self, head: Any, rows: Any) -> int:
        """The head's floor plus the sequence's next value (see :meth:`_grant_permit`)."""
        return int(self._fetch(f"SELECT %s + nextval('{SEQUENCE}')", [head.token])[0][0])

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
        by_owner = "AND owner = %s" if holder_only else ""
        completion = self._completion_set() if marker else ""
        # known from the grant: the row holds no other job's marker, nothing to move
        move = bool(marker) and ending.displaces is not False
        old = (
            f"""old AS (SELECT completed_digest, completed_retries, completed_at
                        FROM {LEASE} WHERE key = %s),"""
            if move
            else ""
        )
        moved = (
            f""", moved AS (
                    INSERT INTO {COMPLETION} (digest, retries, completed_at)
                    SELECT o.completed_digest, o.completed_retries, o.completed_at
                    FROM old o, r WHERE o.completed_digest NOT IN ('', %s))"""
            if move
            else ""
        )
        event = (
            f""", ev AS (
                    INSERT INTO {EVENT} (lease_id, kind, token, task_id, owner, at, detail)
                    SELECT id, {SQL_RELEASED}, token, %s, %s, statement_timestamp(), %s::jsonb
                    FROM r)"""
            if ending.routine_events
            else ""
        )
        lock = (
            ", lk AS (SELECT pg_advisory_xact_lock(hashtextextended(%s, 0)) FROM r)"
            if lock_result
            else ""
        )
        write = (
            f""", res AS (
                    INSERT INTO {RESULT} ({SQL_RESULT_COLUMNS})
                    SELECT {", ".join(["%s"] * RESULT_WIDTH)} FROM lk
                    ON CONFLICT (task_id) DO UPDATE SET {SQL_RESULT_UPDATE})"""
            if lock_result and result is not None
            else ""
        )
        return self._fetch(
            f"""WITH {old} r AS (
                    UPDATE {LEASE} SET {self._release_set()} {completion}
                    WHERE key = %s AND token = %s {by_owner} AND released_at IS NULL
                    RETURNING id, token){moved}{event}{lock}{write}
                SELECT r.token FROM r{", lk" if lock_result else ""}""",
            [
                *([ending.key] if move else []),
                state[:16],
                *marker,
                ending.key,
                ending.token,
                *([ending.owner] if holder_only else []),
                *(marker[:1] if move else []),
                *(
                    [ending.task_id, ending.owner, json.dumps(released_detail(state, delivery))]
                    if ending.routine_events
                    else []
                ),
                *([result_lock(ending.task_id)] if lock_result else []),
                *(result if lock_result and result is not None else []),
            ],
        )

    def _unchanged_sql(self) -> str:
        """The conflicting row's marker is still the one in the statement's snapshot.

        The conflict clause sees the row's latest version, but the ``Completion`` rows
        only as of the snapshot: a completion that committed in between, moving this
        delivery's marker there, would go unseen. Then nothing is granted here, and the
        check after it (a new statement, a new snapshot) finds the job completed.
        Parameter: the key.
        """
        return (
            f"AND l.completed_digest = (SELECT s.completed_digest FROM {LEASE} s WHERE s.key = %s)"
        )

    def _unchanged_params(self, key: str) -> list[Any]:
        return [key]


def _grant(row: tuple[Any, ...]) -> Grant:
    """A grant from its statement's row; a takeover's row also has the expiry of the grant
    it took over (read from the statement's snapshot: the row before it)."""
    lease_id, token, expires_at, reclaimed_from, marker, *previous = row
    before = (
        aware(previous[0]) if previous and previous[0] is not None and reclaimed_from else None
    )
    return Grant(lease_id, token, aware(expires_at), reclaimed_from, marker, "", before)
