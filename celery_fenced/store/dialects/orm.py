"""The portable dialect: transactions with row locks through the ORM, any database."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

from django.db import transaction
from django.db.backends.base.base import BaseDatabaseWrapper

from celery_fenced.models import Lease
from celery_fenced.store.dialects.row_locked import RowLockedDialect
from celery_fenced.store.dialects.row_locking import RowLocking
from celery_fenced.store.dialects.rows import aware
from celery_fenced.store.dialects.statements import common as sql
from celery_fenced.store.dialects.tables import task_result_model
from celery_fenced.store.types import (
    Renewal,
)


class ORMDialect(RowLockedDialect):
    """The portable dialect: transactions with row locks through the ORM, any database.

    Its grants, releases and proofs are :class:`.RowLocking`'s, with the ORM's row lock
    (:meth:`_locked_row`) and the standard clock (``CURRENT_TIMESTAMP``).
    """

    def __init__(self, alias: str, connection: BaseDatabaseWrapper | None = None) -> None:
        super().__init__(alias, connection)
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

    def now(self) -> dt.datetime:
        with self.connection.cursor() as cursor:
            cursor.execute(sql.SELECT_CURRENT_TIMESTAMP)
            row = cursor.fetchone()
        return aware(row[0])

    def _locked_row(self, key: str) -> tuple[Any, ...] | None:
        """Lock ``key``'s row: its id, token, release and expiry times, and the database's
        time (read after the lock); None when the key has no row."""
        row = (
            Lease._default_manager.using(self.alias)
            .select_for_update()
            .filter(key=key)
            .values_list("pk", "token", "released_at", "expires_at")
            .first()
        )
        return None if row is None else (*row, self.now())

    def lock_for_result(self, task_id: str) -> None:
        list(
            task_result_model()
            ._default_manager.using(self.alias)
            .select_for_update()
            .filter(task_id=task_id)
            .values_list("pk", flat=True)
        )

    def renew(self, leases: Sequence[Renewal]) -> dict[tuple[str, int], dt.datetime]:
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

    def record_event(
        self,
        key: str,
        kind: str,
        token: int | None,
        task_id: str,
        owner: str,
        detail: dict[str, Any],
    ) -> None:
        self.events.record(key, kind, token, task_id, owner, detail)
