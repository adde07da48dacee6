"""MariaDB and MySQL 8: row-locking grants, and the family's SQL where one statement does more."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from django.db import IntegrityError, transaction
from django.db.backends.base.base import BaseDatabaseWrapper

from celery_fenced import permits
from celery_fenced.models import Lease, LeaseEvent
from celery_fenced.store.dialects import permits as permit_grants
from celery_fenced.store.dialects.row_locked import RowLockedDialect
from celery_fenced.store.dialects.row_locking import RowLocking
from celery_fenced.store.dialects.rows import aware, completes
from celery_fenced.store.dialects.statements import mysql as sql
from celery_fenced.store.types import (
    Completed,
    Ending,
    Grant,
    GrantRequest,
    Holder,
    Pending,
    Renewal,
)

if TYPE_CHECKING:
    from typing_extensions import LiteralString


class MySQL(RowLockedDialect):
    """MariaDB (10.6 or newer) and MySQL 8, Django's ``mysql`` backend.

    A grant reads the key's row under its lock, then updates it, in one transaction: the
    family has no ``UPDATE … RETURNING`` to hand back the token it wrote. The clock is the
    database's, to the microsecond (``CURRENT_TIMESTAMP`` alone is to the second); system
    check ``celery_fenced.E006`` makes sure it is UTC, as Django stores datetimes. The
    grants, releases and proofs are :class:`.RowLocking`'s, with this family's row locks
    (:meth:`_locked_row`, :meth:`_locked_rows`) and clock.

    On MariaDB a free permit's grant is one statement (:meth:`_grant_permit`), and so is a
    release that neither completes a job nor records an event (:meth:`release`).
    """

    def __init__(self, alias: str, connection: BaseDatabaseWrapper | None = None) -> None:
        super().__init__(
            alias, connection, locked_rows=self._locked_rows, next_token=self._permit_token
        )
        self.locking = RowLocking(
            alias,
            connection,
            self.now,
            self.events,
            self.pending,
            self.permits,
            locked_row=self._locked_row,
            lock_for_result=self.lock_for_result,
        )

    @property
    def mariadb(self) -> bool:
        """Whether the server is MariaDB (sequences, ``RETURNING``), not MySQL."""
        return bool(getattr(self.connection, "mysql_is_mariadb", False))

    def acquire(self, request: GrantRequest) -> Grant | Holder | Completed:
        """A free permit on MariaDB in one statement (:meth:`_grant_permit`), in the
        transaction that ends the job's outbox row and records its event when there is
        one; else :meth:`.RowLocking.acquire`.

        A transaction whose one statement granted nothing is rolled back before the
        transaction of :mod:`.dialects.permits` runs: the statement may have locked a
        free permit row it then did not grant (the job holds another, or completed), and
        that transaction locks the key's head before its permit rows — holding a permit
        row while waiting for the head deadlocks with it (error 1213).
        """
        if request.limit is None or self.connection.in_atomic_block or not self.mariadb:
            return self.locking.acquire(request)
        if not request.ends_pending and not request.routine_events:
            granted = self._grant_permit(request)
            return granted if granted is not None else self.locking.acquire(request)
        try:
            return self.pending.ending_with_grant(request, self._permit_grant)
        except _NotGranted:
            return self.locking.acquire(request)

    def _permit_grant(self, request: GrantRequest) -> Grant:
        """:meth:`_grant_permit` in the transaction of :meth:`acquire`, with the ``acquired``
        event; :class:`_NotGranted` (the transaction rolled back) when it grants nothing."""
        granted = self._grant_permit(request)
        if granted is None:
            raise _NotGranted
        if request.routine_events:
            at = granted.expires_at - dt.timedelta(microseconds=round(request.ttl * 1_000_000))
            self.events.add(
                granted.lease_id,
                LeaseEvent.Kind.ACQUIRED,
                granted.token,
                request.task_id,
                request.owner,
                at,
                {},
            )
        return granted

    def _grant_permit(self, request: GrantRequest) -> Grant | None:
        """The lowest released permit of the key, in one statement
        (:data:`~.statements.mysql.GRANT_PERMIT`); None when there is none to take here —
        the key's permit rows not made yet or its limit changed, every permit held or
        locked, the job holding one already or completed — and the transaction decides
        (:mod:`.dialects.permits`).

        Acquirers of one key's permits share no row, as on PostgreSQL: each locks only the
        permit it takes, and its token is the head's floor plus the next value of the
        sequence (:meth:`_permit_token`).
        """
        assert request.limit is not None
        delivery = request.delivery
        unless_completed = delivery is not None and bool(delivery.task_id)
        fields: dict[str, Any] = {
            "key": request.key,
            "first": request.key + permits.SEPARATOR,
            "after": request.key + chr(ord(permits.SEPARATOR) + 1),
            "limit": request.limit,
            "owner": request.owner,
            "task_id": request.task_id,
            "task_name": request.task_name,
            "us": round(request.ttl * 1_000_000),
            "job": request.job,
            "permit_job": permit_grants.permit_job(request.key, request.task_id),
        }
        if delivery is not None and unless_completed:
            fields.update(
                digest=delivery.digest,
                retries=delivery.retries,
                window_us=round(request.window * 1_000_000),
            )
        try:
            with self.connection.cursor() as cursor:
                cursor.execute(sql.GRANT_PERMIT[unless_completed], fields)
                row = cursor.fetchone()
        except IntegrityError:  # the same job granted another permit meanwhile
            return None
        if row is None:
            return None
        lease_id, token, expires_at, marker, key = row
        return Grant(lease_id, token, aware(expires_at), "", marker, key)

    def _permit_token(self, head: Lease, rows: Iterable[Lease]) -> int:
        """MariaDB: the head's floor plus the sequence's next value, as the one-statement
        grant numbers a permit (the key's tokens one increasing sequence on both paths);
        MySQL: :func:`.permits.next_permit_token`."""
        if not self.mariadb:
            return permit_grants.next_permit_token(self.alias, head, rows)
        with self.connection.cursor() as cursor:
            cursor.execute(sql.PERMIT_TOKEN, {"floor": head.token})
            return int(cursor.fetchone()[0])

    def release(self, ending: Ending) -> bool:
        """A release that neither completes a job nor records an event in one
        ``UPDATE``; else :meth:`.RowLocking.release`."""
        if ending.routine_events or completes(ending.state, ending.delivery):
            return self.locking.release(ending)
        fields: dict[str, Any] = {
            "key": ending.key,
            "token": ending.token,
            "owner": ending.owner,
            "state": ending.state[:16],
        }
        with self.connection.cursor() as cursor:
            cursor.execute(sql.RELEASE, fields)
            return bool(cursor.rowcount)

    def now(self) -> dt.datetime:
        """The database's clock, to the microsecond (``CURRENT_TIMESTAMP`` alone is to the
        second)."""
        with self.connection.cursor() as cursor:
            cursor.execute(sql.SELECT_NOW)
            row = cursor.fetchone()
        return aware(row[0])

    def record_pending(self, pending: Pending) -> None:
        """The outbox's row of a published job: one ``INSERT … ON DUPLICATE KEY UPDATE``
        (a re-publish of the task id, a retry, starts the row afresh; two at once, the
        second waits for the first's row and replaces it). Its times by the database's
        clock: ``resend_at`` is the ETA (absolute, or now plus the countdown) plus
        ``resend_after``."""
        adapt = self.connection.ops.adapt_datetimefield_value
        expires, eta, after = pending.expires, pending.eta, pending.resend_after
        fields = {
            "task_id": pending.task_id,
            "task_name": pending.task_name[:255],
            "key": pending.key,
            "job": pending.job,
            "eta_at": adapt(eta) if eta is not None else None,
            "eta_us": _us(pending.countdown) if eta is None and pending.countdown else None,
            "expires_at": None if isinstance(expires, int | float) else adapt(expires),
            "expires_us": _us(expires) if isinstance(expires, int | float) else None,
            "resend_at": adapt(eta + dt.timedelta(seconds=after)) if eta is not None else None,
            "resend_us": None if eta is not None else _us((pending.countdown or 0.0) + after),
            "plain": pending.plain,
            "nesting": pending.nesting,
        }
        with self.connection.cursor() as cursor:
            cursor.execute(sql.RECORD_PENDING, fields)

    def _locked_row(self, key: str) -> tuple[Any, ...] | None:
        """The row's lock and the database's time in one ``SELECT … FOR UPDATE``."""
        with self.connection.cursor() as cursor:
            cursor.execute(sql.LOCKED_ROW, {"key": key})
            row = cursor.fetchone()
        if row is None:
            return None
        lease_id, token, released_at, expires_at, now = row
        return lease_id, token, _aware_or_none(released_at), aware(expires_at), aware(now)

    def _locked_rows(self, keys: list[str]) -> list[Lease]:
        """The permit rows of ``keys``, locked through the keys' unique index always: on a
        small table the optimizer scans the whole table instead, locking each row it
        reads — among them the row another first grant of the key is inserting, which
        waits for the head row this transaction holds (a deadlock, error 1213)."""
        if not keys:
            return []
        return list(
            Lease._default_manager.raw(
                repeated(sql.LOCKED_ROWS, sql.LOCKED_ROWS_ROW, sql.LOCKED_ROWS_JOIN, len(keys)),
                keys,
                using=self.alias,
            )
        )

    def lock_for_result(self, task_id: str) -> None:
        """The task id's result lock until the transaction ends: the row of its bucket in
        ``celery_fenced_result_lock``, locked by ``INSERT … ON DUPLICATE KEY UPDATE``.

        A ``SELECT … FOR UPDATE`` of a missing result row locks nothing under READ
        COMMITTED (Django's isolation level for the family), and a result row made and
        deleted again leaves a deleted record whose gap InnoDB's duplicate checks lock:
        three takers of a new task id deadlock (1213). The bucket's row is made once and
        kept; on its primary key the statement takes a record lock only, exclusive even
        on a duplicate. Task ids that share a bucket take turns.
        """
        with self.connection.cursor() as cursor:
            cursor.execute(sql.LOCK_FOR_RESULT, {"task_id": task_id})

    def renew(self, leases: Sequence[Renewal]) -> dict[tuple[str, int], dt.datetime]:
        """Every lease in one ``UPDATE … JOIN``; the renewed ones read back by their new
        ``renewed_at`` (the family's ``UPDATE`` returns no rows)."""
        if not leases:
            return {}
        with transaction.atomic(using=self.alias), self.connection.cursor() as cursor:
            cursor.execute(sql.SELECT_NOW)
            now = cursor.fetchone()[0]
            params: list[Any] = []
            for lease in leases:
                params += [lease.key, lease.token, lease.owner, round(lease.ttl * 1_000_000), now]
            count = len(leases)
            cursor.execute(repeated(sql.RENEW, sql.RENEW_ROW, sql.RENEW_JOIN, count), params)
            if not cursor.rowcount:
                return {}
            cursor.execute(repeated(sql.RENEWED, sql.RENEW_ROW, sql.RENEW_JOIN, count), params)
            return {(key, token): aware(expires) for key, token, expires in cursor.fetchall()}

    def record_event(
        self,
        key: str,
        kind: str,
        token: int | None,
        task_id: str,
        owner: str,
        detail: dict[str, Any],
    ) -> None:
        """The event of ``key``'s row, if the key has one: the row share-locked first,
        then the event inserted, in one transaction.

        One ``INSERT … SELECT`` deadlocked with a grant (1213, or 1467 "failed to read
        auto-increment value"): it takes the events table's AUTO-INC lock for the whole
        statement and then waited for the row the grant holds, while the grant's own event
        waited for that AUTO-INC lock. Holding the row's shared lock before the insert, the
        insert waits for nothing, whatever ``innodb_autoinc_lock_mode`` is.
        """
        with transaction.atomic(using=self.alias), self.connection.cursor() as cursor:
            cursor.execute(sql.SHARE_LOCK, {"key": key})
            row = cursor.fetchone()
            if row is None:
                return
            cursor.execute(
                sql.INSERT_EVENT,
                {
                    "lease_id": row[0],
                    "kind": kind,
                    "token": token,
                    "task_id": task_id,
                    "owner": owner,
                    "detail": json.dumps(detail),
                },
            )


class _NotGranted(Exception):
    """The one-statement permit grant granted nothing: its transaction is rolled back."""


def repeated(
    statement: LiteralString, row: LiteralString, join: LiteralString, count: int
) -> LiteralString:
    """``statement`` with its ``{rows}`` slot filled with ``count`` copies of ``row``, joined
    by ``join``: the statements taking a variable number of rows (see
    :mod:`.statements.mysql`). Fixed text only; the values are the rows' parameters."""
    return statement.replace("{rows}", join.join([row] * count))


def _aware_or_none(value: dt.datetime | None) -> dt.datetime | None:
    return None if value is None else aware(value)


def _us(seconds: float) -> int:
    """``seconds`` in whole microseconds, as ``INTERVAL … MICROSECOND`` takes them."""
    return round(seconds * 1_000_000)
