"""What the SQL dialects share: the operations whose statements each dialect's statements
module (:mod:`.statements`) gives under the same names."""

from __future__ import annotations

import abc
import datetime as dt
import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from celery_fenced.store.dialects.records import (
    COMPLETION,
    LEASE,
    SQL_STATE_ABANDONED,
    SQL_STATE_RESENT,
    Delivery,
    GrantRequest,
    Pending,
    Renewal,
    aware,
    completes,
)
from celery_fenced.store.dialects.shared import PortableOperations

if TYPE_CHECKING:
    from typing_extensions import LiteralString


class Statements(Protocol):
    """What a statements module gives the shared operations (see each module)."""

    @property
    def SELECT_NOW(self) -> LiteralString: ...
    @property
    def RECORD_PENDING(self) -> LiteralString: ...
    @property
    def COMPLETED(self) -> LiteralString: ...
    @property
    def RENEW(self) -> LiteralString: ...
    @property
    def RECORD_EVENT(self) -> LiteralString: ...
    @property
    def IS_CURRENT(self) -> LiteralString: ...
    @property
    def CURRENT_TOKEN(self) -> LiteralString: ...


class SQLDialect(PortableOperations):
    """Shared shape of the single-statement dialects; subclasses give the clock SQL."""

    #: the dialect's statements module
    SQL: ClassVar[Statements]
    NOW: str
    JSON: str

    @abc.abstractmethod
    def expiry(self, ttl_sql: str) -> str:
        """SQL for the database's clock plus ``ttl_sql`` seconds."""

    def record_pending(self, pending: Pending) -> None:
        """The outbox's row of a published job: one ``INSERT … ON CONFLICT DO UPDATE``.

        Its times by the database's clock: ``resend_at`` is the ETA (absolute, or now
        plus the countdown) plus ``resend_after``; a re-publish of the task id (a retry)
        starts the row afresh.
        """
        self._fetch(self.SQL.RECORD_PENDING, self._pending_fields(pending, unique=False))

    def _pending_fields(self, pending: Pending, *, unique: bool) -> dict[str, Any]:
        """The parameters of a pending row's ``INSERT``: its ETA, expiry and resend time
        given (``*_at``) or in seconds from now (``*_in``); ``unique``: with its key in
        ``unique_key`` and its mode (``lease_unique``)."""
        adapt = self.connection.ops.adapt_datetimefield_value
        expires, eta = pending.expires, pending.eta
        after = pending.resend_after
        return {
            "task_id": pending.task_id,
            "task_name": pending.task_name[:255],
            "key": pending.key,
            "job": pending.job,
            "eta_at": adapt(eta) if eta is not None else None,
            "eta_in": self.ttl_param(pending.countdown)
            if eta is None and pending.countdown
            else None,
            "expires_at": None if isinstance(expires, int | float) else adapt(expires),
            "expires_in": self.ttl_param(expires) if isinstance(expires, int | float) else None,
            "resend_at": adapt(eta + dt.timedelta(seconds=after)) if eta is not None else None,
            "resend_in": None
            if eta is not None
            else self.ttl_param((pending.countdown or 0.0) + after),
            "unsent": False,
            "unique_key": pending.key if unique else None,
            "unique_until": (pending.unique or "") if unique else "",
            "plain": pending.plain,
            "nesting": pending.nesting,
        }

    def _pending_params(self, pending: Pending, *, unique: bool) -> list[Any]:
        """The parameters of a pending row's ``INSERT … VALUES``; ``unique``: with its key
        in ``unique_key`` and its mode (``lease_unique``)."""
        adapt = self.connection.ops.adapt_datetimefield_value
        expires, eta = pending.expires, pending.eta
        expiry_param = (
            self.ttl_param(expires) if isinstance(expires, int | float) else adapt(expires)
        )
        return [
            pending.task_id,
            pending.task_name[:255],
            pending.key,
            pending.job,
            adapt(eta)
            if eta is not None
            else self.ttl_param(pending.countdown)
            if pending.countdown
            else None,
            expiry_param,
            adapt(eta + dt.timedelta(seconds=pending.resend_after))
            if eta is not None
            else self.ttl_param((pending.countdown or 0.0) + pending.resend_after),
            False,
            *([pending.key, pending.unique or ""] if unique else []),
            pending.plain,
            pending.nesting,
        ]

    @staticmethod
    def _pending_reset() -> str:
        """The ``SET`` list starting a conflicting pending row afresh from ``excluded``."""
        return """task_name = excluded.task_name, key = excluded.key, job = excluded.job,
                    published_at = excluded.published_at, eta = excluded.eta,
                    expires_at = excluded.expires_at, resend_at = excluded.resend_at,
                    sends = 0, unsent = excluded.unsent, abandoned_at = NULL,
                    abandoned_reason = '', nesting = excluded.nesting"""

    def _fetch(self, sql: str, params: Sequence[Any] | Mapping[str, Any]) -> list[tuple[Any, ...]]:
        with self.connection.cursor() as cursor:
            cursor.execute(sql, params)
            return list(cursor.fetchall())

    def now(self) -> dt.datetime:
        return aware(self._fetch(self.SQL.SELECT_NOW, {})[0][0])

    def _upsert(
        self, unless_completed: bool = False, *, routine: bool = False, unchanged: bool = False
    ) -> str:
        """The grant: one ``INSERT … ON CONFLICT DO UPDATE … WHERE … RETURNING``.

        Parameters: key, owner, task id, task name, ttl, job; with ``unless_completed``
        then those of :meth:`_completed_sql`, :meth:`_marked_sql` and
        :meth:`_unchanged_sql`: nothing is granted when the delivery's job already
        completed. The lease row's completion marker is tested in the conflict clause,
        which PostgreSQL evaluates on the row's latest version under its lock: a
        completion committing while this statement waits for the row is seen (a subquery
        reads the statement's snapshot: see :meth:`_unchanged_sql`).

        ``routine``: the grant of the common case — a new key, or one its last holder
        released — without what a takeover needs; it grants nothing otherwise (a takeover,
        a held key, a duplicate: then the full statement decides). The head of a key's
        permits (``lease_limit``: :mod:`celery_fenced.permits`) is never granted here.

        ``unchanged``: only over the row the statement's snapshot read (one more
        parameter, the key, last): a grant committed while this statement waited for the
        row is not taken over blind — what the statement reads of the row before it
        (the job it hands to the outbox) is that row's.
        """
        now = self.NOW
        # a re-delivery of the same unfinished task keeps its reclaim count
        same = "l.released_at IS NULL AND excluded.task_id <> '' AND l.task_id = excluded.task_id"
        values = (
            f"%s, 1, %s, %s, %s, {now}, {now}, {self.expiry('%s')}, NULL, '', %s, 0, '', NULL, "
            "'', '', 0"
        )
        proposed = (
            f"SELECT {values} WHERE NOT EXISTS ({self._completed_sql()})"
            if unless_completed
            else f"VALUES ({values})"
        )
        unmarked = (
            f"AND NOT {self._marked_sql('l')} {self._unchanged_sql()}" if unless_completed else ""
        )
        free = (
            "l.released_at IS NOT NULL"
            if routine
            else f"(l.released_at IS NOT NULL OR l.expires_at <= {now})"
        )
        return f"""
            INSERT INTO {LEASE} AS l (key, token, owner, task_id, task_name, acquired_at,
                                      renewed_at, expires_at, released_at, reclaimed_from,
                                      job, reclaim_attempts, reclaim_state, reclaim_claimed_at,
                                      completed_digest, release_state, permits)
            {proposed}
            ON CONFLICT (key) DO UPDATE SET
                token = l.token + 1, owner = excluded.owner, task_id = excluded.task_id,
                task_name = excluded.task_name, {self._conflict_times()},
                released_at = NULL, release_state = '',
                reclaimed_from = CASE WHEN l.released_at IS NULL THEN l.owner ELSE '' END,
                job = excluded.job,
                reclaim_attempts = CASE WHEN {same} THEN l.reclaim_attempts ELSE 0 END,
                reclaim_state = '',
                reclaim_claimed_at = CASE WHEN {same} THEN l.reclaim_claimed_at END
            WHERE {free} AND l.permits = 0 {unmarked}{
            f" AND l.token = (SELECT s.token FROM {LEASE} s WHERE s.key = %s)" if unchanged else ""
        }
            RETURNING id, token, expires_at, reclaimed_from, completed_digest"""

    def _conflict_times(self) -> str:
        """The conflict clause's times of a grant: the proposed row's, by default."""
        return (
            "acquired_at = excluded.acquired_at, renewed_at = excluded.renewed_at, "
            "expires_at = excluded.expires_at"
        )

    def _completed_sql(self) -> str:
        """The ``Completion`` rows that make a delivery a completed duplicate.

        Parameters: digest, retries, window (seconds). They reach back to jobs completed
        under this key before another job completed there since (see :meth:`_displaced`).
        """
        return f"""SELECT 1 FROM {COMPLETION} c
                   WHERE c.digest = %s AND c.retries >= %s AND c.completed_at > {self.ago("%s")}"""

    def _marked_sql(self, alias: str) -> str:
        """The lease row's completion marker names the delivery's job.

        Parameters: digest, retries, window (seconds).
        """
        return f"""({alias}.completed_digest = %s AND {alias}.completed_retries >= %s
                    AND {alias}.completed_at > {self.ago("%s")})"""

    def _completed_params(self, delivery: Delivery, window: float) -> list[Any]:
        return [
            *self._marked_params(delivery, window),  # the Completion rows
            *self._marked_params(delivery, window),  # the lease row's marker
        ]

    def _unchanged_sql(self) -> str:
        """A condition on the conflicting lease row ``l``: unchanged since the snapshot.

        Empty here: SQLite runs one writer at a time, so the statement's reads are the
        latest. See the PostgreSQL dialect.
        """
        return ""

    def _unchanged_params(self, key: str) -> list[Any]:
        return []

    def _marked_params(self, delivery: Delivery, window: float) -> list[Any]:
        return [delivery.digest, delivery.retries, self.ttl_param(window)]

    def completed(self, key: str, delivery: Delivery, window: float) -> bool:
        return bool(self._fetch(self.SQL.COMPLETED, self._marked_fields(key, delivery, window)))

    def _marked_fields(self, key: str, delivery: Delivery, window: float) -> dict[str, Any]:
        """The parameters naming a completed job: the key, digest, retries, window."""
        return {
            "key": key,
            "digest": delivery.digest,
            "retries": delivery.retries,
            "window": self.ttl_param(window),
        }

    def _grant_params(self, request: GrantRequest) -> tuple[bool, list[Any]]:
        """Whether the grant checks for a completed duplicate, and its parameters."""
        params = [
            request.key,
            request.owner,
            request.task_id,
            request.task_name,
            self.ttl_param(request.ttl),
            request.job,
        ]
        delivery = request.delivery
        unless_completed = delivery is not None and bool(delivery.task_id)
        if delivery is not None and unless_completed:
            params += self._completed_params(delivery, request.window)
            params += self._unchanged_params(request.key)
        return unless_completed, params

    def _release_set(self) -> str:
        """The ``SET`` list of a release: its time and state. Parameter: the state."""
        return f"released_at = {self.NOW}, job = NULL, release_state = %s"

    def _completion_set(self) -> str:
        """What a completing release adds to :meth:`_release_set`: the completion marker.
        Parameters: the digest and the retry count (:meth:`_completion_params`)."""
        return f", completed_digest = %s, completed_retries = %s, completed_at = {self.NOW}"

    @staticmethod
    def _completion_params(state: str, delivery: Delivery | None) -> list[Any]:
        """The marker's parameters, or none when the release does not complete a job."""
        if delivery is None or not completes(state, delivery):
            return []
        return [delivery.digest, delivery.retries]

    def _busy_select(self) -> str:
        return f"""
            SELECT id, token, owner, expires_at, {self.remaining("expires_at")} AS remaining
            FROM {LEASE} WHERE key = %s"""

    @abc.abstractmethod
    def remaining(self, column: str) -> str:
        """SQL for the seconds from the database's clock until ``column``."""

    VALUES_ROW = "(%s, %s, %s, %s)"

    def _renew_sql(self, count: int) -> str:
        values = ", ".join([self.VALUES_ROW] * count)
        now = self.NOW
        return f"""
            WITH v(k, t, o, ttl) AS (VALUES {values})
            UPDATE {LEASE} SET renewed_at = {now}, expires_at = {self.expiry("v.ttl")}
            FROM v
            WHERE {LEASE}.key = v.k AND {LEASE}.token = v.t AND {LEASE}.owner = v.o
              AND {LEASE}.released_at IS NULL AND {LEASE}.expires_at > {now}
            RETURNING {LEASE}.key, {LEASE}.token, {LEASE}.expires_at"""

    def renew(self, leases: Sequence[Renewal]) -> dict[tuple[str, int], dt.datetime]:
        if not leases:
            return {}
        rows = self._fetch(self.SQL.RENEW, self._renew_fields(leases))
        return {(key, token): aware(expires) for key, token, expires in rows}

    def _renew_fields(self, leases: Sequence[Renewal]) -> dict[str, Any]:
        """The leases to renew, as the dialect's ``RENEW`` takes them."""
        return {
            "leases": json.dumps(
                [
                    [lease.key, lease.token, lease.owner, self.ttl_param(lease.ttl)]
                    for lease in leases
                ]
            )
        }

    def ttl_param(self, ttl: float) -> Any:
        return ttl

    @abc.abstractmethod
    def ago(self, seconds_sql: str) -> str:
        """SQL for the database's clock minus ``seconds_sql`` seconds."""

    LOCK_SKIP = ""

    def _claim_sql(self) -> tuple[str, list[str]]:
        """One conditional UPDATE … RETURNING that claims expired, unfinished grants.

        Returns the SQL and the names of its parameters, in order. The condition is
        repeated outside the batch subquery so that a row claimed by a concurrent
        reclaimer (whose claim committed first) is re-checked and skipped.
        """
        eligible = f"""released_at IS NULL AND job IS NOT NULL
                AND expires_at < {self.ago("%s")}
                AND (reclaim_state = '' OR (reclaim_state = {SQL_STATE_RESENT}
                     AND reclaim_claimed_at < {self.ago("%s")}))"""
        sql = f"""
            UPDATE {LEASE} SET
                reclaim_attempts = CASE WHEN reclaim_attempts < %s
                                   THEN reclaim_attempts + 1 ELSE reclaim_attempts END,
                reclaim_state = CASE WHEN reclaim_attempts < %s
                                THEN {SQL_STATE_RESENT} ELSE {SQL_STATE_ABANDONED} END,
                reclaim_claimed_at = {self.NOW}
            WHERE id IN (SELECT id FROM {LEASE} WHERE {eligible}
                         ORDER BY expires_at LIMIT %s {self.LOCK_SKIP})
              AND {eligible}
            RETURNING id, key, token, owner, task_id, task_name, job, reclaim_attempts,
                      reclaim_state"""
        names = ["max", "max", "grace", "resend_after", "limit", "grace", "resend_after"]
        return sql, names

    def _claim_params(
        self, grace: float, resend_after: float, max_attempts: int, limit: int
    ) -> list[Any]:
        values = {
            "max": max_attempts,
            "grace": self.ttl_param(grace),
            "resend_after": self.ttl_param(resend_after),
            "limit": limit,
        }
        return [values[name] for name in self._claim_sql()[1]]

    def record_event(
        self,
        key: str,
        kind: str,
        token: int | None,
        task_id: str,
        owner: str,
        detail: dict[str, Any],
    ) -> None:
        self._fetch(
            self.SQL.RECORD_EVENT,
            {
                "kind": kind,
                "token": token,
                "task_id": task_id,
                "owner": owner,
                "detail": json.dumps(detail),
                "key": key,
            },
        )

    def is_current(self, key: str, token: int, owner: str) -> bool:
        return bool(self._fetch(self.SQL.IS_CURRENT, {"key": key, "token": token, "owner": owner}))

    def _current_token(self, key: str) -> int | None:
        """The key's current (or last) token, for the report of a refused write."""
        rows = self._fetch(self.SQL.CURRENT_TOKEN, {"key": key})
        return rows[0][0] if rows else None
