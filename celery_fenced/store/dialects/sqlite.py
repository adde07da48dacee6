"""SQLite: the state change in one upsert, its event in the same transaction."""

from __future__ import annotations

import json
from typing import Any

from django.db import transaction
from django.db.backends.base.base import BaseDatabaseWrapper

from celery_fenced.models import LeaseEvent, ReclaimState
from celery_fenced.store.dialects.rows import abandoned_detail, aware, holder_of, released_detail
from celery_fenced.store.dialects.sql import SQLDialect
from celery_fenced.store.dialects.statements import sqlite as sql
from celery_fenced.store.types import (
    Claim,
    Completed,
    Deduplicated,
    Displaced,
    Ending,
    Grant,
    GrantRequest,
    Holder,
    Pending,
)

Kind = LeaseEvent.Kind


class SQLite(SQLDialect):
    """SQLite: the upsert is one statement; its event joins it in one transaction.

    Times are written by SQLite's own clock in Django's text format, so they compare
    as text with the values Django writes.
    """

    def __init__(self, alias: str, connection: BaseDatabaseWrapper | None = None) -> None:
        super().__init__(alias, connection, sql, ttl_param=_seconds_text)

    def record_unique_pending(self, pending: Pending) -> str | Deduplicated:
        """:meth:`.PendingRows.record_unique` in one statement when the key is free (an
        insert that does nothing on a conflict), and in two when a copy stands: the
        ``deduplicated`` event inserted from that copy's pending row and its key's lease
        row, if the copy still stands. Anything else — a retry's publish, an ended copy
        to take over, a key without its lease row yet (its first refusal), a conflict on
        the task id — takes the portable path, which decides it again."""
        if not pending.same_job:
            fields = self._pending_fields(pending, unique=True)
            rows = self._fetch(sql.RECORD_UNIQUE_PENDING, fields)
            if rows:
                return str(rows[0][0])
            mode = "until_done" if pending.unique == "until_done" else "until_started"
            detail = {"refused_task_id": pending.task_id, "task_name": pending.task_name}
            rows = self._fetch(
                sql.DEDUPLICATED[mode],
                {"key": pending.key, "task_id": pending.task_id, "detail": json.dumps(detail)},
            )
            if rows:
                standing, token, owner = rows[0]
                return Deduplicated(str(standing), token, str(owner))
        return self._record_unique_portably(pending)

    def acquire(self, request: GrantRequest) -> Grant | Holder | Completed:
        """A permit's grant (:mod:`.permits`) or the key's (:meth:`_grant`) and the end of
        the job's pending row, in one transaction."""
        grant = self.permits.grant if request.limit is not None else self._grant
        return self.pending.ending_with_grant(request, grant)

    def claim_expired(
        self, *, grace: float, resend_after: float, max_attempts: int, limit: int
    ) -> list[Claim]:
        """The claim in one statement; the ``abandoned`` events in its transaction."""
        with transaction.atomic(using=self.alias):
            rows = self._fetch(
                sql.CLAIM,
                {
                    "max": max_attempts,
                    "grace": self.ttl_param(grace),
                    "resend_after": self.ttl_param(resend_after),
                    "limit": limit,
                },
            )
            claims = [Claim(*row) for row in rows]
            for claim in claims:
                if claim.state == ReclaimState.ABANDONED:
                    self._insert_event(
                        claim.lease_id,
                        Kind.ABANDONED,
                        claim.token,
                        claim.task_id,
                        claim.owner,
                        abandoned_detail(claim, max_attempts),
                    )
        return claims

    def _grant(self, request: GrantRequest) -> Grant | Holder | Completed:
        """The grant of a key (not a permit), in :meth:`acquire`'s transaction."""
        key, owner, task_id, delivery = (
            request.key,
            request.owner,
            request.task_id,
            request.delivery,
        )
        delivery = request.delivery
        unless_completed = delivery is not None and bool(delivery.task_id)
        params = {
            "key": key,
            "owner": owner,
            "task_id": task_id,
            "task_name": request.task_name,
            "ttl": self.ttl_param(request.ttl),
            "job": request.job,
            **(
                self._marked_fields(key, delivery, request.window)
                if delivery is not None and unless_completed
                else {}
            ),
        }
        with transaction.atomic(using=self.alias, savepoint=False):  # acquire's
            # the previous grant's start, for a takeover's event: read by a write that
            # changes nothing, so the transaction holds the write lock from its first
            # statement (a read's shared lock cannot always be upgraded: "database is
            # locked" at once, whatever the timeout)
            before = self._fetch(sql.LOCK_LEASE_ROW, {"key": key})
            previous_start = aware(before[0][0]).isoformat() if before else None
            rows = self._fetch(
                sql.GRANT_UNLESS_COMPLETED if unless_completed else sql.GRANT, params
            )
            if rows:
                lease_id, token, expires_at, reclaimed_from, marker = rows[0]
                if reclaimed_from:
                    _, was_task, name, job, released_at, state, attempts, _ends = before[0]
                    self.pending.requeue_displaced(
                        Displaced(
                            key, was_task, name, job, released_at is not None, state, attempts
                        ),
                        task_id,
                    )
                    detail = {
                        "previous_owner": reclaimed_from,
                        "previous_token": token - 1,
                        "previous_acquired_at": previous_start,
                    }
                    self._insert_event(lease_id, Kind.RECLAIMED, token, task_id, owner, detail)
                elif request.routine_events:
                    self._insert_event(lease_id, Kind.ACQUIRED, token, task_id, owner, {})
                previous = aware(before[0][7]) if reclaimed_from and before else None
                return Grant(
                    lease_id, token, aware(expires_at), reclaimed_from, marker, "", previous
                )
            if (
                delivery is not None
                and unless_completed
                and self.completed(key, delivery, request.window)
            ):
                return Completed(task_id, delivery.retries)
            rows = self._fetch(sql.HOLDER, {"key": key})
            if rows:
                self._insert_event(
                    rows[0][0], Kind.BUSY, rows[0][1], task_id, owner, {"holder": rows[0][2]}
                )
            return holder_of([row[1:] for row in rows])

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
            sql.INSERT_EVENT,
            {
                "lease_id": lease_id,
                "kind": kind,
                "token": token,
                "task_id": task_id,
                "owner": owner,
                "detail": json.dumps(detail),
            },
        )

    def release(self, ending: Ending) -> bool:
        with transaction.atomic(using=self.alias):
            return self._release(ending, holder_only=True)

    def force_release(
        self, key: str, by: str, task_id: str | None = None, token: int | None = None
    ) -> tuple[int, str] | None:
        with transaction.atomic(using=self.alias):
            rows = self._fetch(sql.FORCE_RELEASE, {"key": key, "task_id": task_id, "token": token})
            if not rows:
                return None
            lease_id, token, owner, task_id, acquired_at = rows[0]
            detail = {"by": by, "acquired_at": aware(acquired_at).isoformat()}
            self._insert_event(lease_id, Kind.FORCE_RELEASED, token, task_id, owner, detail)
            return token, owner

    def lock_for_result(self, task_id: str) -> None:
        """SQLite's write lock, taken by a write that changes nothing."""
        self._fetch(sql.LOCK_FOR_RESULT, {"task_id": task_id})

    def prove_current(self, key: str, token: int) -> tuple[bool, int | None]:
        # A conditional no-op write takes SQLite's write lock for the rest of the
        # transaction: no grant can be issued until the caller's writes commit.
        rows = self._fetch(sql.PROVE_CURRENT, {"key": key, "token": token})
        if rows:
            return True, token
        return False, self._current_token(key)

    def release_current(self, ending: Ending) -> tuple[bool, int | None]:
        """One conditional ``UPDATE`` (it takes the write lock), then what goes with it.

        As on PostgreSQL, a grant that expired with no successor is still accepted. The
        update takes SQLite's write lock, which is also ``task_id``'s result lock.
        """
        if self._release(ending, holder_only=False):
            return True, ending.token
        return False, self._current_token(ending.key)

    def _release(self, ending: Ending, *, holder_only: bool) -> bool:
        """Release the grant in the caller's transaction; move a displaced completion marker
        to the ``Completion`` table; the ``released`` event with routine events only."""
        state, delivery = ending.state, ending.delivery
        marker = self._completion_params(state, delivery)
        params = {
            "key": ending.key,
            "token": ending.token,
            "only_owner": ending.owner if holder_only else None,
            "state": state[:16],
            **({"digest": marker[0], "retries": marker[1]} if marker else {}),
        }
        if marker and ending.displaces is not False:
            # first (a write: the write lock from the first statement), under the
            # release's own conditions: the marker this release is about to replace
            self._fetch(sql.MOVE_MARKER, params)
        rows = self._fetch(sql.RELEASE_COMPLETING if marker else sql.RELEASE, params)
        if not rows:
            return False
        if ending.routine_events:
            detail = released_detail(state, delivery)
            self._insert_event(
                rows[0][0], Kind.RELEASED, ending.token, ending.task_id, ending.owner, detail
            )
        return True

    def estimated_rows(self, table: str) -> int | None:
        return None  # SQLite keeps no estimate: the count is exact


def _seconds_text(ttl: float) -> str:
    """A duration in seconds as SQLite's time modifiers take it: text."""
    return repr(float(ttl))
