"""The lease store's SQL: one implementation per database family.

This is the only module that knows SQL dialects. Every expiry decision is made inside a
statement with the database's own clock; no worker clock is ever compared with
``expires_at``. PostgreSQL does each operation, event included, in one statement (a
data-modifying CTE); SQLite does the state change in one ``INSERT … ON CONFLICT … DO
UPDATE … WHERE … RETURNING`` and writes the event in the same transaction; any other
database gets a transactional fallback through the ORM with row locks.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from django.db import connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import F, Q
from django.db.models.functions import Greatest
from django.utils.dateparse import parse_datetime

from celery_fenced.models import Lease, LeaseEvent

LEASE = Lease._meta.db_table
EVENT = LeaseEvent._meta.db_table


@dataclass(frozen=True)
class Grant:
    lease_id: int
    token: int
    expires_at: dt.datetime
    reclaimed_from: str


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


#: the states of a ``released`` event that mark its task id completed (and as SQL)
COMPLETED_STATES = ("SUCCESS", "FAILURE")
COMPLETED_STATES_SQL = "('SUCCESS', 'FAILURE')"
#: the retry count assumed for a ``released`` event recorded without one (before it was
#: recorded): any delivery of that task id counts as a duplicate, as it did then
UNRECORDED_RETRIES = 2147483647


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


@dataclass(frozen=True)
class Renewal:
    key: str
    token: int
    owner: str
    ttl: float


def _aware(value: Any) -> dt.datetime:
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


class Dialect:
    """Portable fallback: transactions with row locks through the ORM."""

    def __init__(self, alias: str) -> None:
        self.alias = alias

    @property
    def connection(self) -> BaseDatabaseWrapper:
        return connections[self.alias]

    # -- acquire ---------------------------------------------------------------------
    def acquire(
        self,
        key: str,
        ttl: float,
        owner: str,
        task_id: str,
        task_name: str,
        job: str | None = None,
        retries: int | None = None,
    ) -> Grant | Holder | Completed:
        """Grant ``key``, or tell who holds it.

        With a ``task_id`` and the delivery's ``retries``, a task id that already
        completed (see :meth:`completed`) is not granted: :class:`Completed`.
        """
        with transaction.atomic(using=self.alias):
            if task_id and retries is not None and self.completed(task_id, retries):
                return Completed(task_id, retries)
            manager = Lease._default_manager.using(self.alias)
            now = self.now()
            expires = now + dt.timedelta(seconds=ttl)
            row = manager.select_for_update().filter(key=key).first()
            if row is None:
                row = manager.create(
                    key=key,
                    token=1,
                    owner=owner,
                    task_id=task_id,
                    task_name=task_name,
                    acquired_at=now,
                    renewed_at=now,
                    expires_at=expires,
                    job=job,
                )
                reclaimed_from = ""
            elif row.released_at is None and row.expires_at > now:
                self._event(row.pk, "busy", row.token, task_id, owner, now, {"holder": row.owner})
                return Holder(
                    row.token, row.owner, row.expires_at, (row.expires_at - now).total_seconds()
                )
            else:
                reclaimed_from = row.owner if row.released_at is None else ""
                # a re-delivery of the same unfinished task keeps its reclaim count
                same_job = row.released_at is None and task_id != "" and row.task_id == task_id
                manager.filter(pk=row.pk).update(
                    token=F("token") + 1,
                    owner=owner,
                    task_id=task_id,
                    task_name=task_name,
                    acquired_at=now,
                    renewed_at=now,
                    expires_at=expires,
                    released_at=None,
                    reclaimed_from=reclaimed_from,
                    job=job,
                    reclaim_attempts=row.reclaim_attempts if same_job else 0,
                    reclaim_state="",
                    reclaim_claimed_at=row.reclaim_claimed_at if same_job else None,
                )
                row.refresh_from_db(fields=["token"])
            self._grant_event(row.pk, row.token, task_id, owner, now, reclaimed_from)
            return Grant(row.pk, row.token, expires, reclaimed_from)

    def now(self) -> dt.datetime:
        with self.connection.cursor() as cursor:
            cursor.execute("SELECT CURRENT_TIMESTAMP")
            row = cursor.fetchone()
        return _aware(row[0])

    def _grant_event(
        self,
        lease_id: int,
        token: int,
        task_id: str,
        owner: str,
        now: dt.datetime,
        reclaimed_from: str,
    ) -> None:
        if reclaimed_from:
            self._event(
                lease_id,
                "reclaimed",
                token,
                task_id,
                owner,
                now,
                {"previous_owner": reclaimed_from, "previous_token": token - 1},
            )
        else:
            self._event(lease_id, "acquired", token, task_id, owner, now, {})

    def _event(
        self,
        lease_id: int,
        kind: str,
        token: int | None,
        task_id: str,
        owner: str,
        at: dt.datetime | None,
        detail: dict[str, Any],
    ) -> None:
        LeaseEvent._default_manager.using(self.alias).create(
            lease_id=lease_id,
            kind=kind,
            token=token,
            task_id=task_id,
            owner=owner,
            at=at or self.now(),
            detail=detail,
        )

    # -- renew -----------------------------------------------------------------------
    def renew(self, leases: Sequence[Renewal]) -> dict[tuple[str, int], dt.datetime]:
        """Extend every lease in ``leases`` still held; return the new expiry of each."""
        renewed: dict[tuple[str, int], dt.datetime] = {}
        with transaction.atomic(using=self.alias):
            now = self.now()
            for lease in leases:
                expires = now + dt.timedelta(seconds=lease.ttl)
                count = (
                    Lease._default_manager.using(self.alias)
                    .filter(
                        key=lease.key,
                        token=lease.token,
                        owner=lease.owner,
                        released_at__isnull=True,
                        expires_at__gt=now,
                    )
                    .update(renewed_at=now, expires_at=expires)
                )
                if count:
                    renewed[(lease.key, lease.token)] = expires
        return renewed

    # -- release ---------------------------------------------------------------------
    def release(
        self,
        key: str,
        token: int,
        owner: str,
        task_id: str,
        state: str = "",
        retries: int | None = None,
    ) -> bool:
        with transaction.atomic(using=self.alias):
            now = self.now()
            manager = Lease._default_manager.using(self.alias)
            row = (
                manager.select_for_update()
                .filter(key=key, token=token, owner=owner, released_at__isnull=True)
                .first()
            )
            if row is None:
                return False
            manager.filter(pk=row.pk).update(released_at=now, job=None)
            self._event(row.pk, "released", token, task_id, owner, now, _state(state, retries))
            return True

    def force_release(
        self, key: str, by: str, task_id: str | None = None
    ) -> tuple[int, str] | None:
        """End the key's grant (only if it belongs to ``task_id``, when given)."""
        with transaction.atomic(using=self.alias):
            now = self.now()
            manager = Lease._default_manager.using(self.alias)
            rows = manager.select_for_update().filter(key=key, released_at__isnull=True)
            if task_id is not None:
                rows = rows.filter(task_id=task_id)
            row = rows.first()
            if row is None:
                return None
            manager.filter(pk=row.pk).update(released_at=now, job=None)
            self._event(
                row.pk, "force_released", row.token, row.task_id, row.owner, now, {"by": by}
            )
            return row.token, row.owner

    # -- reclaim ---------------------------------------------------------------------
    def claim_expired(
        self, *, grace: float, resend_after: float, max_attempts: int, limit: int
    ) -> list[Claim]:
        """Claim the expired, unfinished grants that have a job to re-send.

        A grant is claimed once per expiry: the claim sets ``reclaim_state``, which only
        the next grant clears (or ``resend_after`` seconds, when the re-sent job never
        started). A claim below ``max_attempts`` counts an attempt and is to be re-sent;
        one at the maximum abandons the lease with an ``abandoned`` event.
        """
        claims: list[Claim] = []
        with transaction.atomic(using=self.alias):
            now = self.now()
            manager = Lease._default_manager.using(self.alias)
            eligible = self._eligible(now, grace, resend_after)
            skip = self.connection.features.has_select_for_update_skip_locked
            rows = list(
                manager.select_for_update(skip_locked=skip)
                .filter(eligible)
                .order_by("expires_at")[:limit]
            )
            for row in rows:
                resend = row.reclaim_attempts < max_attempts
                attempts = row.reclaim_attempts + 1 if resend else row.reclaim_attempts
                state = "resent" if resend else "abandoned"
                if not manager.filter(eligible, pk=row.pk).update(
                    reclaim_attempts=attempts, reclaim_state=state, reclaim_claimed_at=now
                ):
                    continue
                claim = Claim(
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
                if not resend:
                    detail = _abandoned_detail(claim, max_attempts)
                    self._event(
                        row.pk, "abandoned", row.token, row.task_id, row.owner, now, detail
                    )
                claims.append(claim)
        return claims

    def expired_unfinished(
        self, *, grace: float, resend_after: float, max_attempts: int, limit: int
    ) -> list[Claim]:
        """What :meth:`claim_expired` would claim now, claiming nothing (a dry run)."""
        now = self.now()
        rows = (
            Lease._default_manager.using(self.alias)
            .filter(self._eligible(now, grace, resend_after))
            .order_by("expires_at")[:limit]
        )
        return [
            Claim(
                row.pk,
                row.key,
                row.token,
                row.owner,
                row.task_id,
                row.task_name,
                row.job or "",
                min(row.reclaim_attempts + 1, max_attempts),
                "resent" if row.reclaim_attempts < max_attempts else "abandoned",
            )
            for row in rows
        ]

    @staticmethod
    def _eligible(now: dt.datetime, grace: float, resend_after: float) -> Q:
        return Q(
            released_at__isnull=True,
            job__isnull=False,
            expires_at__lt=now - dt.timedelta(seconds=grace),
        ) & (
            Q(reclaim_state="")
            | Q(
                reclaim_state="resent",
                reclaim_claimed_at__lt=now - dt.timedelta(seconds=resend_after),
            )
        )

    def unclaim(self, claim: Claim) -> bool:
        """Undo a claim whose job could not be sent, so that the next sweep tries again."""
        return bool(
            Lease._default_manager.using(self.alias)
            .filter(pk=claim.lease_id, token=claim.token, reclaim_state="resent")
            .update(reclaim_state="", reclaim_attempts=Greatest(F("reclaim_attempts") - 1, 0))
        )

    def abandon(self, claim: Claim, reason: str) -> bool:
        """Abandon a claimed lease whose job cannot be sent again (e.g. unreadable)."""
        with transaction.atomic(using=self.alias):
            updated = (
                Lease._default_manager.using(self.alias)
                .filter(pk=claim.lease_id, token=claim.token, reclaim_state="resent")
                .update(reclaim_state="abandoned")
            )
            if updated:
                detail = {"task": claim.task_name, "attempts": claim.attempts, "reason": reason}
                self._event(
                    claim.lease_id,
                    "abandoned",
                    claim.token,
                    claim.task_id,
                    claim.owner,
                    None,
                    detail,
                )
        return bool(updated)

    def record_resent(self, claim: Claim, detail: dict[str, Any]) -> None:
        """The ``resent`` event of a claim whose job was sent again."""
        self._event(
            claim.lease_id, "resent", claim.token, claim.task_id, claim.owner, None, detail
        )

    # -- completed duplicates ----------------------------------------------------------
    def completed(self, task_id: str, retries: int) -> bool:
        """Whether ``task_id`` completed in a delivery retried at least ``retries`` times.

        Completed: released as SUCCESS or FAILURE under its lease. A delivery whose
        ``retries`` is above the completed one's is a retry sent before that execution
        ended (it asked to be retried, then failed): it is not a duplicate. Reaches back
        as far as ``released`` events are kept (``prune``).
        """
        return (
            LeaseEvent._default_manager.using(self.alias)
            .filter(
                task_id=task_id, kind=LeaseEvent.Kind.RELEASED, detail__state__in=COMPLETED_STATES
            )
            .filter(Q(detail__retries__gte=retries) | Q(detail__retries__isnull=True))
            .exists()
        )

    # -- fencing ---------------------------------------------------------------------
    def prove_current(self, key: str, token: int) -> tuple[bool, int | None]:
        """Lock the lease row and tell whether ``token`` is its current, unexpired grant.

        Must run inside a transaction: the lock is held until it ends, so no newer grant
        can be issued before the caller's writes commit. Returns ``(ok, current_token)``.
        """
        now = self.now()
        row = (
            Lease._default_manager.using(self.alias)
            .select_for_update()
            .filter(key=key)
            .values_list("token", "released_at", "expires_at")
            .first()
        )
        if row is None:
            return False, None
        current, released_at, expires_at = row
        return (current == token and released_at is None and expires_at > now), current

    def release_current(
        self,
        key: str,
        token: int,
        owner: str,
        task_id: str,
        state: str = "",
        retries: int | None = None,
    ) -> tuple[bool, int | None]:
        """Prove ``token`` current and end its grant, in one step; ``(ok, current_token)``.

        The rule of :meth:`prove_current` (the key's token, not released, not expired by
        the database's clock). When it holds, the grant is released and its ``released``
        event recorded, and the lease row stays locked until the caller's transaction
        ends: a write that fails after it rolls the release back too. Must run inside a
        transaction. The result write of a final state opens with it.
        """
        now = self.now()
        manager = Lease._default_manager.using(self.alias)
        row = (
            manager.select_for_update()
            .filter(key=key)
            .values_list("pk", "token", "released_at", "expires_at")
            .first()
        )
        if row is None:
            return False, None
        lease_id, current, released_at, expires_at = row
        if current != token or released_at is not None or expires_at <= now:
            return False, current
        manager.filter(pk=lease_id).update(released_at=now, job=None)
        self._event(lease_id, "released", token, task_id, owner, now, _state(state, retries))
        return True, current

    def record_event(
        self,
        key: str,
        kind: str,
        token: int | None,
        task_id: str,
        owner: str,
        detail: dict[str, Any],
    ) -> None:
        lease_id = (
            Lease._default_manager.using(self.alias)
            .filter(key=key)
            .values_list("pk", flat=True)
            .first()
        )
        if lease_id is not None:
            self._event(lease_id, kind, token, task_id, owner, None, detail)

    def is_current(self, key: str, token: int, owner: str) -> bool:
        now = self.now()
        return (
            Lease._default_manager.using(self.alias)
            .filter(
                key=key, token=token, owner=owner, released_at__isnull=True, expires_at__gt=now
            )
            .exists()
        )


class SQLDialect(Dialect):
    """Shared shape of the single-statement dialects; subclasses give the clock SQL."""

    NOW: str
    JSON: str

    def expiry(self, ttl_sql: str) -> str:
        raise NotImplementedError

    def _fetch(self, sql: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
        with self.connection.cursor() as cursor:
            cursor.execute(sql, params)
            return list(cursor.fetchall())

    def now(self) -> dt.datetime:
        return _aware(self._fetch(f"SELECT {self.NOW}", [])[0][0])

    def _upsert(self, unless_completed: bool = False) -> str:
        """The grant: one ``INSERT … ON CONFLICT DO UPDATE … WHERE … RETURNING``.

        Parameters: key, owner, task id, task name, ttl, job; with ``unless_completed``
        then the task id and the delivery's retries: no row is proposed (so none is
        granted) when :meth:`completed` holds, in the same statement.
        """
        now = self.NOW
        # a re-delivery of the same unfinished task keeps its reclaim count
        same = "l.released_at IS NULL AND excluded.task_id <> '' AND l.task_id = excluded.task_id"
        values = f"%s, 1, %s, %s, %s, {now}, {now}, {self.expiry('%s')}, NULL, '', %s, 0, '', NULL"
        proposed = (
            f"SELECT {values} WHERE NOT EXISTS ({self._completed_sql()})"
            if unless_completed
            else f"VALUES ({values})"
        )
        return f"""
            INSERT INTO {LEASE} AS l (key, token, owner, task_id, task_name, acquired_at,
                                      renewed_at, expires_at, released_at, reclaimed_from,
                                      job, reclaim_attempts, reclaim_state, reclaim_claimed_at)
            {proposed}
            ON CONFLICT (key) DO UPDATE SET
                token = l.token + 1, owner = excluded.owner, task_id = excluded.task_id,
                task_name = excluded.task_name, acquired_at = excluded.acquired_at,
                renewed_at = excluded.renewed_at, expires_at = excluded.expires_at,
                released_at = NULL,
                reclaimed_from = CASE WHEN l.released_at IS NULL THEN l.owner ELSE '' END,
                job = excluded.job,
                reclaim_attempts = CASE WHEN {same} THEN l.reclaim_attempts ELSE 0 END,
                reclaim_state = '',
                reclaim_claimed_at = CASE WHEN {same} THEN l.reclaim_claimed_at END
            WHERE l.released_at IS NOT NULL OR l.expires_at <= {now}
            RETURNING id, token, expires_at, reclaimed_from"""

    def _completed_sql(self) -> str:
        """The ``released`` events that make task id ``%s`` at retries ``%s`` a duplicate."""
        return f"""SELECT 1 FROM {EVENT} e
                   WHERE e.task_id = %s AND e.kind = 'released'
                     AND {self.json_text("e.detail", "state")} IN {COMPLETED_STATES_SQL}
                     AND COALESCE({self.json_int("e.detail", "retries")},
                                  {UNRECORDED_RETRIES}) >= %s"""

    def json_text(self, column: str, name: str) -> str:
        raise NotImplementedError

    def json_int(self, column: str, name: str) -> str:
        raise NotImplementedError

    def completed(self, task_id: str, retries: int) -> bool:
        return bool(self._fetch(self._completed_sql(), [task_id, retries]))

    def _grant_params(
        self,
        key: str,
        ttl: float,
        owner: str,
        task_id: str,
        task_name: str,
        job: str | None,
        retries: int | None,
    ) -> tuple[bool, list[Any]]:
        """Whether the grant checks for a completed duplicate, and its parameters."""
        params = [key, owner, task_id, task_name, self.ttl_param(ttl), job]
        unless_completed = bool(task_id) and retries is not None
        if unless_completed:
            params += [task_id, retries]
        return unless_completed, params

    def _busy_select(self) -> str:
        return f"""
            SELECT id, token, owner, expires_at, {self.remaining("expires_at")} AS remaining
            FROM {LEASE} WHERE key = %s"""

    def remaining(self, column: str) -> str:
        raise NotImplementedError

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
        params: list[Any] = []
        for lease in leases:
            params += [lease.key, lease.token, lease.owner, self.ttl_param(lease.ttl)]
        rows = self._fetch(self._renew_sql(len(leases)), params)
        return {(key, token): _aware(expires) for key, token, expires in rows}

    def ttl_param(self, ttl: float) -> Any:
        return ttl

    def ago(self, seconds_sql: str) -> str:
        """SQL for the database's clock minus ``seconds_sql`` seconds."""
        raise NotImplementedError

    LOCK_SKIP = ""

    def _claim_sql(self) -> tuple[str, list[str]]:
        """One conditional UPDATE … RETURNING that claims expired, unfinished grants.

        Returns the SQL and the names of its parameters, in order. The condition is
        repeated outside the batch subquery so that a row claimed by a concurrent
        reclaimer (whose claim committed first) is re-checked and skipped.
        """
        eligible = f"""released_at IS NULL AND job IS NOT NULL
                AND expires_at < {self.ago("%s")}
                AND (reclaim_state = '' OR (reclaim_state = 'resent'
                     AND reclaim_claimed_at < {self.ago("%s")}))"""
        sql = f"""
            UPDATE {LEASE} SET
                reclaim_attempts = CASE WHEN reclaim_attempts < %s
                                   THEN reclaim_attempts + 1 ELSE reclaim_attempts END,
                reclaim_state = CASE WHEN reclaim_attempts < %s
                                THEN 'resent' ELSE 'abandoned' END,
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
            f"""INSERT INTO {EVENT} (lease_id, kind, token, task_id, owner, at, detail)
                SELECT id, %s, %s, %s, %s, {self.NOW}, {self.JSON}
                FROM {LEASE} WHERE key = %s RETURNING id""",
            [kind, token, task_id, owner, json.dumps(detail), key],
        )

    def is_current(self, key: str, token: int, owner: str) -> bool:
        rows = self._fetch(
            f"""SELECT 1 FROM {LEASE} WHERE key = %s AND token = %s AND owner = %s
                AND released_at IS NULL AND expires_at > {self.NOW}""",
            [key, token, owner],
        )
        return bool(rows)

    def _current_token(self, key: str) -> int | None:
        """The key's current (or last) token, for the report of a refused write."""
        rows = self._fetch(f"SELECT token FROM {LEASE} WHERE key = %s", [key])
        return rows[0][0] if rows else None


class PostgreSQL(SQLDialect):
    """One statement per operation: the state change and its event in one CTE."""

    NOW = "statement_timestamp()"
    JSON = "%s::jsonb"

    def json_text(self, column: str, name: str) -> str:
        return f"({column} ->> '{name}')"

    def json_int(self, column: str, name: str) -> str:
        return f"({column} ->> '{name}')::bigint"

    def expiry(self, ttl_sql: str) -> str:
        return f"(statement_timestamp() + ({ttl_sql})::float8 * interval '1 second')"

    def remaining(self, column: str) -> str:
        return f"GREATEST(EXTRACT(EPOCH FROM {column} - statement_timestamp()), 0)::float8"

    # VALUES needs typed columns for the comparisons with bigint and the interval
    VALUES_ROW = "(%s, %s::bigint, %s, %s::float8)"
    # concurrent reclaimers take different rows instead of queueing on the same ones
    LOCK_SKIP = "FOR UPDATE SKIP LOCKED"

    def ago(self, seconds_sql: str) -> str:
        return f"(statement_timestamp() - ({seconds_sql})::float8 * interval '1 second')"

    def claim_expired(
        self, *, grace: float, resend_after: float, max_attempts: int, limit: int
    ) -> list[Claim]:
        """The claim and the ``abandoned`` events in one statement."""
        claim_sql, _ = self._claim_sql()
        rows = self._fetch(
            f"""WITH c AS ({claim_sql}),
                ev AS (
                    INSERT INTO {EVENT} (lease_id, kind, token, task_id, owner, at, detail)
                    SELECT id, 'abandoned', token, task_id, owner, statement_timestamp(),
                           jsonb_build_object('task', task_name, 'attempts', reclaim_attempts,
                                              'max', %s::int, 'reason', %s::text)
                    FROM c WHERE reclaim_state = 'abandoned')
                SELECT * FROM c""",
            [
                *self._claim_params(grace, resend_after, max_attempts, limit),
                max_attempts,
                TOO_MANY,
            ],
        )
        return [Claim(*row) for row in rows]

    def acquire(
        self,
        key: str,
        ttl: float,
        owner: str,
        task_id: str,
        task_name: str,
        job: str | None = None,
        retries: int | None = None,
    ) -> Grant | Holder | Completed:
        unless_completed, params = self._grant_params(
            key, ttl, owner, task_id, task_name, job, retries
        )
        grant = self._upsert(unless_completed=True) if unless_completed else self._upsert()
        rows = self._fetch(
            f"""WITH granted AS ({grant}),
                ev AS (
                    INSERT INTO {EVENT} (lease_id, kind, token, task_id, owner, at, detail)
                    SELECT id, CASE WHEN reclaimed_from = '' THEN 'acquired' ELSE 'reclaimed' END,
                           token, %s, %s, statement_timestamp(),
                           CASE WHEN reclaimed_from = '' THEN '{{}}'::jsonb ELSE
                           jsonb_build_object('previous_owner', reclaimed_from,
                                              'previous_token', token - 1) END
                    FROM granted)
                SELECT id, token, expires_at, reclaimed_from FROM granted""",
            [*params, task_id, owner],
        )
        if rows:
            lease_id, token, expires_at, reclaimed_from = rows[0]
            return Grant(lease_id, token, _aware(expires_at), reclaimed_from)
        # not granted (rare): a completed duplicate, or the key is held
        if unless_completed and retries is not None and self.completed(task_id, retries):
            return Completed(task_id, retries)
        rows = self._fetch(
            f"""WITH holder AS ({self._busy_select()}),
                ev AS (
                    INSERT INTO {EVENT} (lease_id, kind, token, task_id, owner, at, detail)
                    SELECT id, 'busy', token, %s, %s, statement_timestamp(),
                           jsonb_build_object('holder', owner)
                    FROM holder)
                SELECT token, owner, expires_at, remaining FROM holder""",
            [key, task_id, owner],
        )
        return _holder(rows)

    def release(
        self,
        key: str,
        token: int,
        owner: str,
        task_id: str,
        state: str = "",
        retries: int | None = None,
    ) -> bool:
        rows = self._fetch(
            f"""WITH r AS (
                    UPDATE {LEASE} SET released_at = statement_timestamp(), job = NULL
                    WHERE key = %s AND token = %s AND owner = %s AND released_at IS NULL
                    RETURNING id, token),
                ev AS (
                    INSERT INTO {EVENT} (lease_id, kind, token, task_id, owner, at, detail)
                    SELECT id, 'released', token, %s, %s, statement_timestamp(), %s::jsonb
                    FROM r)
                SELECT token FROM r""",
            [key, token, owner, task_id, owner, json.dumps(_state(state, retries))],
        )
        return bool(rows)

    def force_release(
        self, key: str, by: str, task_id: str | None = None
    ) -> tuple[int, str] | None:
        only_task = "" if task_id is None else "AND task_id = %s"
        rows = self._fetch(
            f"""WITH r AS (
                    UPDATE {LEASE} SET released_at = statement_timestamp(), job = NULL
                    WHERE key = %s AND released_at IS NULL {only_task}
                    RETURNING id, token, owner, task_id),
                ev AS (
                    INSERT INTO {EVENT} (lease_id, kind, token, task_id, owner, at, detail)
                    SELECT id, 'force_released', token, task_id, owner, statement_timestamp(),
                           jsonb_build_object('by', %s::text)
                    FROM r)
                SELECT token, owner FROM r""",
            [key, *([] if task_id is None else [task_id]), by],
        )
        return (rows[0][0], rows[0][1]) if rows else None

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

    def release_current(
        self,
        key: str,
        token: int,
        owner: str,
        task_id: str,
        state: str = "",
        retries: int | None = None,
    ) -> tuple[bool, int | None]:
        """One conditional ``UPDATE`` (it locks the row) with its event: proof and release."""
        rows = self._fetch(
            f"""WITH r AS (
                    UPDATE {LEASE} SET released_at = statement_timestamp(), job = NULL
                    WHERE key = %s AND token = %s AND released_at IS NULL
                      AND expires_at > statement_timestamp()
                    RETURNING id, token),
                ev AS (
                    INSERT INTO {EVENT} (lease_id, kind, token, task_id, owner, at, detail)
                    SELECT id, 'released', token, %s, %s, statement_timestamp(), %s::jsonb
                    FROM r)
                SELECT token FROM r""",
            [key, token, task_id, owner, json.dumps(_state(state, retries))],
        )
        if rows:
            return True, token
        return False, self._current_token(key)


class SQLite(SQLDialect):
    """SQLite: the upsert is one statement; its event joins it in one transaction.

    Times are written by SQLite's own clock in Django's text format, so they compare
    as text with the values Django writes.
    """

    NOW = "strftime('%%Y-%%m-%%d %%H:%%M:%%f', 'now')"
    JSON = "%s"

    def json_text(self, column: str, name: str) -> str:
        return f"json_extract({column}, '$.{name}')"

    def json_int(self, column: str, name: str) -> str:
        return f"json_extract({column}, '$.{name}')"

    def expiry(self, ttl_sql: str) -> str:
        return f"strftime('%%Y-%%m-%%d %%H:%%M:%%f', 'now', '+' || ({ttl_sql}) || ' seconds')"

    def remaining(self, column: str) -> str:
        return f"max((julianday({column}) - julianday('now')) * 86400.0, 0.0)"

    def ttl_param(self, ttl: float) -> Any:
        return repr(float(ttl))

    def ago(self, seconds_sql: str) -> str:
        return f"strftime('%%Y-%%m-%%d %%H:%%M:%%f', 'now', '-' || ({seconds_sql}) || ' seconds')"

    def claim_expired(
        self, *, grace: float, resend_after: float, max_attempts: int, limit: int
    ) -> list[Claim]:
        """The claim in one statement; the ``abandoned`` events in its transaction."""
        with transaction.atomic(using=self.alias):
            rows = self._fetch(
                self._claim_sql()[0],
                self._claim_params(grace, resend_after, max_attempts, limit),
            )
            claims = [Claim(*row) for row in rows]
            for claim in claims:
                if claim.state == "abandoned":
                    self._insert_event(
                        claim.lease_id,
                        "abandoned",
                        claim.token,
                        claim.task_id,
                        claim.owner,
                        _abandoned_detail(claim, max_attempts),
                    )
        return claims

    def acquire(
        self,
        key: str,
        ttl: float,
        owner: str,
        task_id: str,
        task_name: str,
        job: str | None = None,
        retries: int | None = None,
    ) -> Grant | Holder | Completed:
        unless_completed, params = self._grant_params(
            key, ttl, owner, task_id, task_name, job, retries
        )
        with transaction.atomic(using=self.alias):
            grant = self._upsert(unless_completed=True) if unless_completed else self._upsert()
            rows = self._fetch(grant, params)
            if rows:
                lease_id, token, expires_at, reclaimed_from = rows[0]
                if reclaimed_from:
                    kind = "reclaimed"
                    detail = {"previous_owner": reclaimed_from, "previous_token": token - 1}
                else:
                    kind, detail = "acquired", {}
                self._insert_event(lease_id, kind, token, task_id, owner, detail)
                return Grant(lease_id, token, _aware(expires_at), reclaimed_from)
            if unless_completed and retries is not None and self.completed(task_id, retries):
                return Completed(task_id, retries)
            rows = self._fetch(self._busy_select(), [key])
            if rows:
                self._insert_event(
                    rows[0][0], "busy", rows[0][1], task_id, owner, {"holder": rows[0][2]}
                )
            return _holder([row[1:] for row in rows])

    def _insert_event(
        self,
        lease_id: int,
        kind: str,
        token: int | None,
        task_id: str,
        owner: str,
        detail: dict[str, Any],
    ) -> None:
        self._fetch(
            f"""INSERT INTO {EVENT} (lease_id, kind, token, task_id, owner, at, detail)
                VALUES (%s, %s, %s, %s, %s, {self.NOW}, %s) RETURNING id""",
            [lease_id, kind, token, task_id, owner, json.dumps(detail)],
        )

    def release(
        self,
        key: str,
        token: int,
        owner: str,
        task_id: str,
        state: str = "",
        retries: int | None = None,
    ) -> bool:
        with transaction.atomic(using=self.alias):
            rows = self._fetch(
                f"""UPDATE {LEASE} SET released_at = {self.NOW}, job = NULL
                    WHERE key = %s AND token = %s AND owner = %s AND released_at IS NULL
                    RETURNING id""",
                [key, token, owner],
            )
            if rows:
                detail = _state(state, retries)
                self._insert_event(rows[0][0], "released", token, task_id, owner, detail)
            return bool(rows)

    def force_release(
        self, key: str, by: str, task_id: str | None = None
    ) -> tuple[int, str] | None:
        only_task = "" if task_id is None else "AND task_id = %s"
        with transaction.atomic(using=self.alias):
            rows = self._fetch(
                f"""UPDATE {LEASE} SET released_at = {self.NOW}, job = NULL
                    WHERE key = %s AND released_at IS NULL {only_task}
                    RETURNING id, token, owner, task_id""",
                [key, *([] if task_id is None else [task_id])],
            )
            if not rows:
                return None
            lease_id, token, owner, task_id = rows[0]
            self._insert_event(lease_id, "force_released", token, task_id, owner, {"by": by})
            return token, owner

    def prove_current(self, key: str, token: int) -> tuple[bool, int | None]:
        # A conditional no-op write takes SQLite's write lock for the rest of the
        # transaction: no grant can be issued until the caller's writes commit.
        rows = self._fetch(
            f"""UPDATE {LEASE} SET token = token
                WHERE key = %s AND token = %s AND released_at IS NULL
                  AND expires_at > {self.NOW}
                RETURNING token""",
            [key, token],
        )
        if rows:
            return True, token
        return False, self._current_token(key)

    def release_current(
        self,
        key: str,
        token: int,
        owner: str,
        task_id: str,
        state: str = "",
        retries: int | None = None,
    ) -> tuple[bool, int | None]:
        """One conditional ``UPDATE`` (it takes the write lock), then its event."""
        rows = self._fetch(
            f"""UPDATE {LEASE} SET released_at = {self.NOW}, job = NULL
                WHERE key = %s AND token = %s AND released_at IS NULL
                  AND expires_at > {self.NOW}
                RETURNING id""",
            [key, token],
        )
        if not rows:
            return False, self._current_token(key)
        detail = _state(state, retries)
        self._insert_event(rows[0][0], "released", token, task_id, owner, detail)
        return True, token


TOO_MANY = "the job expired unfinished after the maximum number of re-sends"


def _abandoned_detail(claim: Claim, max_attempts: int) -> dict[str, Any]:
    return {
        "task": claim.task_name,
        "attempts": claim.attempts,
        "max": max_attempts,
        "reason": TOO_MANY,
    }


def _state(state: str, retries: int | None = None) -> dict[str, Any]:
    """The detail of a ``released`` event: the final state and the delivery's retry count.

    ``retries`` (``request.retries`` of the execution) is what the completed-duplicate
    check compares a later delivery of the same task id with.
    """
    detail: dict[str, Any] = {"state": state} if state else {}
    if retries is not None:
        detail["retries"] = retries
    return detail


def _holder(rows: Sequence[Sequence[Any]]) -> Holder:
    if not rows:
        # The row was released between the two statements: report a zero wait.
        return Holder(0, "", dt.datetime.now(dt.timezone.utc), 0.0)
    token, owner, expires_at, remaining = rows[0]
    return Holder(token, owner, _aware(expires_at), float(remaining))


def for_alias(alias: str, *, portable: bool = False) -> Dialect:
    """The dialect for database ``alias`` (``portable=True`` forces the ORM fallback)."""
    vendor = connections[alias].vendor
    if portable:
        return Dialect(alias)
    if vendor == "postgresql":
        return PostgreSQL(alias)
    if vendor == "sqlite":
        return SQLite(alias)
    return Dialect(alias)


__all__ = ["Claim", "Completed", "Dialect", "Grant", "Holder", "Renewal", "for_alias"]
