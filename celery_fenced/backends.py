"""FencedDatabaseBackend: django-celery-results' database backend with fenced result writes.

``result_backend = "celery_fenced.backends:FencedDatabaseBackend"`` (alias ``fenced-db``).

- A fenced execution's outcome is settled in one transaction that first locks the lease
  row and proves the execution's token current (R3); for a final state (or RETRY) one
  conditional ``UPDATE`` does both and releases the lease, in that same transaction, so a
  result write that fails rolls the release back. The token and key are stored in the
  row's ``meta``.
- What the outcome drives happens inside that transaction, after the proof, or not at
  all (R4): the ``link`` callbacks and the next chain step (which Celery's tracer would
  send before storing the result: :class:`~celery_fenced.execution.FencedTask` hands them to
  the backend), the chord count, the chain successors marked failed and the errbacks.
- A stale execution's outcome is never stored as the task's result (R2): when the newer
  grant belongs to the same task id nothing is written; otherwise the task is stored as
  FAILURE with :class:`~celery_fenced.StaleToken`.
- An untokened write (a plain task id, the worker's main process reporting a time limit,
  a lost child or a revoke, a delivery that failed before its grant) never overwrites a
  row written under a token that is final or whose grant is still live (R1): the check
  and the write are one transaction holding the task id's result lock. For a fenced task
  it records nothing while another execution holds a grant of the task id, and ends only
  the grant of the process that ended.
- Tasks that are not fenced are stored exactly as by ``DatabaseBackend``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

from celery import states
from celery.app.task import Context
from django.db import DatabaseError, connections, router, transaction
from django_celery_results.models import TaskResult

from celery_fenced import outages, store, workflow
from celery_fenced.backend_fenced import (
    RELEASING_STATES,
    FencedWrites,
    lease_of,
    proof_meta,
)
from celery_fenced.backend_reports import MainProcessReports
from celery_fenced.backend_untokened import UntokenedWrites
from celery_fenced.exceptions import StaleToken
from celery_fenced.request_state import state_of
from celery_fenced.store import HeldLease

logger = logging.getLogger(__name__)
T = TypeVar("T")


class FencedDatabaseBackend(MainProcessReports, FencedWrites, UntokenedWrites):
    """A drop-in ``DatabaseBackend`` that refuses result writes under stale tokens."""

    #: what :func:`celery_fenced.roles.is_fenced_backend` asks
    celery_fenced_backend: ClassVar[bool] = True

    # -- what Celery's tracer and worker report ---------------------------------------
    def mark_as_done(
        self,
        task_id: str,
        result: Any,
        request: Context | None = None,
        store_result: bool = True,
        state: str = states.SUCCESS,
    ) -> None:
        lease = lease_of(request)
        if (
            lease is not None
            and store_result
            and not getattr(request, "ignore_result", False)
            and self._in_one_statement(task_id, state, request, lease)
        ):
            self._settle(task_id, result, state, request, lease, None)
            return

        def drive() -> None:
            workflow.send_successors(self.app, task_id, request, result)
            super(FencedDatabaseBackend, self).mark_as_done(
                task_id, result, request, store_result, state
            )

        self._report(task_id, result, state, request, drive)
        workflow.successors_settled(request)

    def _in_one_statement(
        self, task_id: str, state: str, request: Context | None, lease: HeldLease
    ) -> bool:
        """Whether this success is settled by one statement: proof, release and result row.

        Only when it drives nothing (no callback, chain step or chord to count), its
        result row is django-celery-results' own (not a subclass's ``TaskModel``) and
        lives in the lease database, that database can (PostgreSQL) and no transaction is
        open around it; otherwise it is one transaction, as for the rest.
        """
        return (
            state == states.SUCCESS
            and self.TaskModel is TaskResult
            and task_id == lease.task_id
            and not getattr(request, "chord", None)
            and not workflow.holds_successors(request)
            and router.db_for_write(self.TaskModel) == lease.alias
            and not connections[lease.alias].in_atomic_block
            and store.writes_result_in_release(lease.alias)
        )

    def mark_as_failure(
        self,
        task_id: str,
        exc: Any,
        traceback: Any = None,
        request: Context | None = None,
        store_result: bool = True,
        call_errbacks: bool = True,
        state: str = states.FAILURE,
    ) -> None:
        workflow.restore_successors(request)  # a success that was not settled

        def drive() -> None:
            super(FencedDatabaseBackend, self).mark_as_failure(
                task_id, exc, traceback, request, store_result, call_errbacks, state
            )

        self._report(task_id, exc, state, request, drive)

    def mark_as_revoked(
        self,
        task_id: str,
        reason: str = "",
        request: Context | None = None,
        store_result: bool = True,
        state: str = states.REVOKED,
    ) -> None:
        def drive() -> None:
            alias = router.db_for_write(self.TaskModel)
            with transaction.atomic(using=alias):
                # the task id's result lock to the commit: two revocations of an expired
                # job (by the worker that discards its message, by the outbox's reclaimer)
                # cannot both find no outcome; the second records nothing and does not
                # count its chord part again
                store.lock_for_result(alias, task_id)
                rows = self.TaskModel._default_manager.using(alias)
                if rows.filter(task_id=task_id, status__in=states.READY_STATES).exists():
                    logger.info(
                        "task %s: %s not recorded over its final outcome",
                        task_id,
                        state,
                        extra={"task_id": task_id},
                    )
                    return
                super(FencedDatabaseBackend, self).mark_as_revoked(
                    task_id, reason, request, store_result, state
                )

        self._report(task_id, reason, state, request, drive)

    def _call_task_errbacks(self, request: Context | None, exc: Any, traceback: Any) -> None:
        """Celery's errbacks; inside a proven transaction, in a savepoint of their own.

        Celery runs an errback of the old ``(request, exc, traceback)`` signature inline
        and logs and swallows what it raises. Inside the transaction that settles the
        task, a database error of that errback would mark the whole transaction for
        rollback: the task's outcome and the lease's release would silently go with it.
        The savepoint keeps the errback's failure its own, as without fencing.
        """
        lease = state_of(request).proven
        if lease is None:
            super()._call_task_errbacks(request, exc, traceback)
            return
        try:
            with transaction.atomic(using=lease.alias):
                super()._call_task_errbacks(request, exc, traceback)
        except DatabaseError:
            logger.exception(
                "an errback of task %s failed in the database; the task's outcome stands",
                getattr(request, "id", None),
            )

    def _report(
        self,
        task_id: str,
        result: Any,
        state: str,
        request: Context | None,
        drive: Callable[[], None],
    ) -> None:
        """A final outcome: settled under the lease, or checked as an untokened report."""
        lease = lease_of(request)
        if lease is not None:
            self._settle(task_id, result, state, request, lease, drive)
        elif not self._is_fenced(request):
            drive()
        elif self._first_report(task_id, state, request) and not self._after_the_process_exits(
            task_id, state, request, drive
        ):
            self._report_elsewhere(task_id, state, request, drive)

    # -- the fenced path ----------------------------------------------------------------
    def _store_result(
        self,
        task_id: str,
        result: Any,
        status: str,
        traceback: Any = None,
        request: Context | None = None,
        using: Any = None,
    ) -> Any:
        lease = lease_of(request)
        if lease is None:
            if state_of(request).checked == task_id or not self._is_fenced(request):
                return super()._store_result(task_id, result, status, traceback, request, using)

            def write() -> None:
                super(FencedDatabaseBackend, self)._store_result(
                    task_id, result, status, traceback, request, using
                )

            # before the grant (track_started's STARTED): a database restart is waited
            # through, as for a final outcome, not turned into the job's FAILURE. A state
            # that is not final never replaces a final outcome (a lost grant's RETRY
            # after the reclaimer recorded the expired job's REVOKED)
            self._through_outages(
                task_id,
                self._untokened_aliases(),
                lambda: self._untokened(
                    task_id, status, request, write, over_final=status in states.READY_STATES
                ),
            )
            return result
        if state_of(request).proven is lease:
            self._write_row(task_id, result, status, traceback, request, using)
            return result

        def write_fenced() -> None:
            self._write_row(task_id, result, status, traceback, request, using)

        self._settle(task_id, result, status, request, lease, write_fenced)
        return result

    def _untokened_aliases(self) -> list[str]:
        """The databases an untokened write touches: the leases' and the results'."""
        return [store.database_alias(), router.db_for_write(self.TaskModel)]

    def _through_outages(self, task_id: str, aliases: list[str], attempt: Callable[[], T]) -> T:
        """``attempt()``, again after a pause while the database is away (0.5 to 8 s apart)."""
        return outages.attempt_through(
            attempt,
            aliases,
            f"could not record the outcome of task {task_id}",
            extra={"task_id": task_id},
        )


__all__ = [
    "RELEASING_STATES",
    "FencedDatabaseBackend",
    "StaleToken",
    "lease_of",
    "proof_meta",
]
