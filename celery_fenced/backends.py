"""FencedDatabaseBackend: django-celery-results' database backend with fenced result writes.

``result_backend = "celery_fenced.backends:FencedDatabaseBackend"`` (alias ``fenced-db``).

- A fenced execution's result is written in one transaction that first locks the lease
  row and proves the execution's token current (R3); for a final state (or RETRY) one
  conditional ``UPDATE`` does both and releases the lease, in that same transaction, so a
  result write that fails rolls the release back. The token and key are stored in the
  row's ``meta``.
- A stale execution's outcome is never stored as the task's result (R2): when the newer
  grant belongs to the same task id nothing is written; otherwise the task is stored as
  FAILURE with :class:`~celery_fenced.StaleToken`.
- An untokened write (a plain task id, or the worker's main process writing
  ``WorkerLostError``) never overwrites a row written under a token that is final or whose
  grant is still live (R1).
- Tasks that are not fenced are stored exactly as by ``DatabaseBackend``.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import states
from django.db import connections, router, transaction
from django.db.models.functions import Now
from django_celery_results.backends.database import DatabaseBackend

from celery_fenced import dialects, store
from celery_fenced.exceptions import StaleToken
from celery_fenced.models import Lease
from celery_fenced.store import HeldLease

logger = logging.getLogger(__name__)

RELEASING_STATES = frozenset({*states.READY_STATES, states.RETRY})
ENDED_ELSEWHERE = frozenset({"WorkerLostError", "TimeLimitExceeded", "Terminated"})


class _Refused(Exception):
    def __init__(self, current: int | None) -> None:
        self.current = current


class FencedDatabaseBackend(DatabaseBackend):  # type: ignore[misc]
    """A drop-in ``DatabaseBackend`` that refuses result writes under stale tokens."""

    def _store_result(
        self,
        task_id: str,
        result: Any,
        status: str,
        traceback: Any = None,
        request: Any = None,
        using: Any = None,
    ) -> Any:
        lease = getattr(request, "_fenced_lease", None) if request is not None else None
        if not isinstance(lease, HeldLease):
            if self._execution_ended_elsewhere(status, result):
                ended = store.end_task_grants(task_id, by=f"worker:{status.lower()}")
                if ended:
                    logger.info(
                        "task %s ended (%s): released its grants %s",
                        task_id,
                        status,
                        ended,
                        extra={"task_id": task_id},
                    )
            if not self._untokened_may_write(task_id, status):
                logger.warning(
                    "untokened %s write for task %s refused: a fenced execution's result stands",
                    status,
                    task_id,
                    extra={"task_id": task_id},
                )
                return result
            return super()._store_result(task_id, result, status, traceback, request, using)
        releasing = status in RELEASING_STATES
        try:
            with transaction.atomic(using=lease.alias):
                # the lease row first, then the result row (always in this order)
                dialect = dialects.for_alias(lease.alias)
                if releasing:
                    # one statement proves the token current and releases the grant; a
                    # result write that fails below rolls the release back with it
                    ok, current = dialect.release_current(
                        lease.key, lease.token, lease.owner, lease.task_id, status, lease.retries
                    )
                else:
                    ok, current = dialect.prove_current(lease.key, lease.token)
                if not ok:
                    raise _Refused(current)
                request.meta = {
                    **(getattr(request, "meta", None) or {}),
                    "fencing_token": lease.token,
                    "lease_key": lease.key,
                }
                self._write_row(task_id, result, status, traceback, request, using)
            if releasing:
                self._released(lease)
            return result
        except _Refused as refused:
            return self._refuse(task_id, result, status, request, lease, refused.current)

    def _write_row(
        self, task_id: str, result: Any, status: str, traceback: Any, request: Any, using: Any
    ) -> None:
        """The fenced execution's result row: what ``DatabaseBackend`` writes, in one upsert.

        The fields come from ``DatabaseBackend``'s own helpers, as in its ``_store_result``;
        the row is written with one ``INSERT … ON CONFLICT (task_id) DO UPDATE`` instead of
        the manager's ``get_or_create`` (a ``SELECT``, then an ``INSERT`` in a savepoint):
        inside the fenced transaction that is two round trips fewer, and a concurrent
        untokened write of the same task id is settled by the conflict clause. A database
        without that clause, or a ``STARTED`` write (its start time is the database's
        ``Now()``), goes through the manager as ``DatabaseBackend`` does.
        """
        content_type, content_encoding, encoded = self.encode_content(result)
        meta = {
            **self._get_meta_from_request(request),
            "children": self.current_task_children(request),
        }
        _, _, encoded_meta = self.encode_content(meta)
        fields = {
            "content_encoding": content_encoding,
            "content_type": content_type,
            "meta": encoded_meta,
            "result": encoded,
            "status": status,
            "traceback": traceback,
            **self._get_extended_properties(request, traceback),
        }
        model = self.TaskModel
        alias = using or router.db_for_write(model)
        if status == states.STARTED or not (
            connections[alias].features.supports_update_conflicts_with_target
        ):
            if status == states.STARTED:
                fields["date_started"] = Now()
            model._default_manager.store_result(task_id=task_id, using=using, **fields)
            return
        model._default_manager.using(alias).bulk_create(
            [model(task_id=task_id, **fields)],
            update_conflicts=True,
            unique_fields=["task_id"],
            update_fields=[*fields, "date_done"],
        )

    @staticmethod
    def _released(lease: HeldLease) -> None:
        """After the commit that released ``lease``: stop renewing it, tell receivers."""
        from celery_fenced.renewal import renewer

        renewer().unregister(lease)
        lease.ended()

    def _refuse(
        self,
        task_id: str,
        result: Any,
        status: str,
        request: Any,
        lease: HeldLease,
        current: int | None,
    ) -> Any:
        current_task, ended = (
            Lease._default_manager.using(lease.alias)
            .filter(key=lease.key)
            .values_list("task_id", "released_at")
            .first()
        ) or ("", None)
        newer = current if current != lease.token else None
        lease.mark_lost(f"{status} result refused: current token is {current}")
        stale = store.reject_stale(
            lease.key,
            lease.token,
            newer,
            using=lease.alias,
            task_id=task_id,
            owner=lease.owner,
            what=f"{status} result",
        )
        if current_task == task_id and newer is not None:
            return result  # a redelivery: the newer execution owns this task's result
        if current_task == task_id and ended is None:
            # This execution's own grant expired and nobody has taken over yet: store
            # nothing and leave the grant unreleased, so the job is not recorded as
            # completed; the reclaimer or the broker's redelivery runs it again.
            lease.released = True
            return result
        if status in states.READY_STATES:
            failure = self.encode_result(stale, states.FAILURE)
            request.meta = {
                **(getattr(request, "meta", None) or {}),
                "stale_fencing_token": lease.token,
            }
            super()._store_result(task_id, failure, states.FAILURE, None, request, None)
        return result

    @staticmethod
    def _execution_ended_elsewhere(status: str, result: Any) -> bool:
        """A write that tells the executing process is gone or was stopped.

        Revoked (with terminate), a hard time limit, or a lost pool child: written by the
        worker's main process, whose request carries no lease.
        """
        if status == states.REVOKED:
            return True
        if status != states.FAILURE or not isinstance(result, dict):
            return False
        return result.get("exc_type") in ENDED_ELSEWHERE

    def _untokened_may_write(self, task_id: str, status: str) -> bool:
        row = (
            self.TaskModel._default_manager.filter(task_id=task_id)
            .values_list("status", "meta")
            .first()
        )
        if row is None:
            return True
        existing_status, meta = row
        try:
            decoded = self.decode(meta) if meta else {}
        except Exception:
            return True
        token = decoded.get("fencing_token") if isinstance(decoded, dict) else None
        if token is None:
            return True
        if existing_status in states.READY_STATES:
            return False
        key = decoded.get("lease_key")
        alias = store.database_alias()
        if not isinstance(key, str):
            return True
        return (
            not Lease._default_manager.using(alias)
            .filter(key=key, token__gte=token, released_at__isnull=True)
            .exists()
        )


__all__ = ["FencedDatabaseBackend", "StaleToken"]
