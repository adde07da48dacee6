"""MariaDB and MySQL 8: the portable dialect, with the family's own SQL where one
statement does the work of several."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Sequence
from typing import Any

from django.db import transaction

from celery_fenced.models import Lease
from celery_fenced.store.dialects.orm import ORMDialect
from celery_fenced.store.dialects.rows import aware
from celery_fenced.store.dialects.tables import EVENT, LEASE, RESULT
from celery_fenced.store.types import Renewal


class MySQL(ORMDialect):
    """MariaDB (10.6 or newer) and MySQL 8, Django's ``mysql`` backend.

    A grant reads the key's row under its lock, then updates it, in one transaction: the
    family has no ``UPDATE … RETURNING`` to hand back the token it wrote. The clock is the
    database's, to the microsecond (``CURRENT_TIMESTAMP`` alone is to the second); system
    check ``celery_fenced.E006`` makes sure it is UTC, as Django stores datetimes.
    """

    CLOCK = "CURRENT_TIMESTAMP(6)"  # to the microsecond

    def _locked_row(self, key: str) -> tuple[Any, ...] | None:
        """The row's lock and the database's time in one ``SELECT … FOR UPDATE``."""
        with self.connection.cursor() as cursor:
            cursor.execute(
                f"""SELECT id, token, released_at, expires_at, {self.CLOCK}
                    FROM {LEASE} WHERE `key` = %s FOR UPDATE""",
                [key],
            )
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
        marks = ", ".join(["%s"] * len(keys))
        return list(
            Lease._default_manager.raw(
                f"""SELECT * FROM {LEASE} FORCE INDEX (celery_fenced_lease_key_uniq)
                    WHERE `key` IN ({marks}) FOR UPDATE""",
                keys,
                using=self.alias,
            )
        )

    def lock_for_result(self, task_id: str) -> None:
        """The task id's result row, locked until the transaction ends — made first, and
        deleted again at once, when the task has no row yet.

        A ``SELECT … FOR UPDATE`` of a missing row locks nothing under READ COMMITTED
        (Django's isolation level for the family): an untokened write that found no row
        would then go on to write over a fenced result committed meanwhile (R1); under
        REPEATABLE READ it takes a gap lock, and two such takers deadlock inserting (1213).
        PostgreSQL takes an advisory lock on the task id; here one ``INSERT … ON DUPLICATE
        KEY UPDATE`` locks the row, existing or not (an exclusive lock even on a duplicate,
        never the shared one whose upgrade deadlocks), and a row made here is deleted in
        the same transaction: the deleted record stays locked by it to the end, and no one
        sees it. (Each call uses up a value of the table's ``AUTO_INCREMENT``.)
        """
        with self.connection.cursor() as cursor:
            cursor.execute(
                f"""INSERT INTO {RESULT}
                      (task_id, status, content_type, content_encoding, date_created, date_done)
                    VALUES (%s, 'PENDING', '', '', {self.CLOCK}, {self.CLOCK})
                    ON DUPLICATE KEY UPDATE id = id""",
                [task_id],
            )
            if cursor.lastrowid:  # made here (0: the task's row, now locked)
                cursor.execute(f"DELETE FROM {RESULT} WHERE id = %s", [cursor.lastrowid])

    def renew(self, leases: Sequence[Renewal]) -> dict[tuple[str, int], dt.datetime]:
        """Every lease in one ``UPDATE … JOIN``; the renewed ones read back by their new
        ``renewed_at`` (the family's ``UPDATE`` returns no rows)."""
        if not leases:
            return {}
        wanted = " UNION ALL ".join(["SELECT %s AS k, %s AS t, %s AS o, %s AS us"] * len(leases))
        params: list[Any] = []
        for lease in leases:
            params += [lease.key, lease.token, lease.owner, round(lease.ttl * 1_000_000)]
        with transaction.atomic(using=self.alias), self.connection.cursor() as cursor:
            cursor.execute(f"SELECT {self.CLOCK}")
            now = cursor.fetchone()[0]
            cursor.execute(
                f"""UPDATE {LEASE} l JOIN ({wanted}) v
                      ON l.`key` = v.k AND l.token = v.t AND l.owner = v.o
                    SET l.renewed_at = %s, l.expires_at = %s + INTERVAL v.us MICROSECOND
                    WHERE l.released_at IS NULL AND l.expires_at > %s""",
                [*params, now, now, now],
            )
            if not cursor.rowcount:
                return {}
            cursor.execute(
                f"""SELECT l.`key`, l.token, l.expires_at FROM {LEASE} l JOIN ({wanted}) v
                      ON l.`key` = v.k AND l.token = v.t AND l.owner = v.o
                    WHERE l.renewed_at = %s AND l.released_at IS NULL""",
                [*params, now],
            )
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
            cursor.execute(f"SELECT id FROM {LEASE} WHERE `key` = %s LOCK IN SHARE MODE", [key])
            row = cursor.fetchone()
            if row is None:
                return
            cursor.execute(
                f"""INSERT INTO {EVENT} (lease_id, kind, token, task_id, owner, at, detail)
                    VALUES (%s, %s, %s, %s, %s, {self.CLOCK}, %s)""",
                [row[0], kind, token, task_id, owner, json.dumps(detail)],
            )


def _aware_or_none(value: dt.datetime | None) -> dt.datetime | None:
    return None if value is None else aware(value)
