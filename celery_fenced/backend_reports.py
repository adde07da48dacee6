"""Main-process reports: a fenced task's end recorded by a process that did not run it."""

from __future__ import annotations

import logging
from collections.abc import Callable

from celery import states
from celery.app.task import Context
from django_celery_results.backends.database import DatabaseBackend

from celery_fenced import exits, owners, store
from celery_fenced.backend_fenced import from_scratch
from celery_fenced.execution import FencedExecution, delivery_of
from celery_fenced.request_state import state_of

logger = logging.getLogger("celery_fenced.backends")


class MainProcessReports(DatabaseBackend):  # type: ignore[misc]
    """The backend's untokened final outcomes of fenced tasks, reported outside their grant:
    by the worker's main process (a hard time limit, a lost pool process, a revoke), or by
    a delivery that failed before its grant."""

    def _first_report(self, task_id: str, state: str, request: Context | None) -> bool:
        """False for a second report of the end of one execution by the worker's main
        process: Celery reports a hard time limit twice (``Request.on_failure``, then
        ``Request.on_timeout``), and the first one records it, its errbacks and its chord
        count (R4: once)."""
        ended = state_of(request).process
        if ended is None or ended.first_report():
            return True
        logger.info(
            "%s of task %s: its end was reported already",
            state,
            task_id,
            extra={"task_id": task_id},
        )
        return False

    def _after_the_process_exits(
        self, task_id: str, state: str, request: Context | None, drive: Callable[[], None]
    ) -> bool:
        """Whether the report is left to a thread that waits for the pool process it names
        to exit (see :mod:`celery_fenced.exits`): the worker's main process reports a hard
        time limit before it kills the process, whose grant must not end while it runs —
        nor may a database that is away hold the kill back."""
        ended = state_of(request).process
        process = ended.owner_prefix if ended is not None else None
        pid = exits.live_child(process)
        if pid is None or process is None:
            return False
        logger.info(
            "%s of task %s: reported once its pool process %s has exited",
            state,
            task_id,
            pid,
            extra={"task_id": task_id},
        )
        exits.after_exit(
            pid,
            lambda: store.process_holds(task_id, process),
            lambda: self._report_elsewhere(task_id, state, request, drive),
        )
        return True

    def _report_elsewhere(
        self, task_id: str, state: str, request: Context | None, drive: Callable[[], None]
    ) -> None:
        """An untokened final outcome of a fenced task, reported outside its grant (often
        by the worker's main process, whose connections nothing else resets)."""
        again = from_scratch(request)

        def attempt() -> None:
            again()
            if self._may_record_elsewhere(task_id, state, request):
                self._untokened(
                    task_id, state, request, lambda: self._ended(drive, state, request)
                )

        self._through_outages(task_id, self._untokened_aliases(), attempt)

    def _ended(self, drive: Callable[[], None], state: str, request: Context | None) -> None:
        """``drive()`` — an untokened final outcome of a fenced task (a time limit, a lost
        worker) — and the end of its row in the outbox with it (handed over when another
        job took its expired grant over): the reclaimer does not send the job again over
        that outcome.

        The FAILURE of a pool process that ended (its hard time limit, its loss) is the
        job's outcome, as an execution's own FAILURE is: its errbacks are sent, so a copy
        of the message (a busy retry sent while it held the key, a redelivery) is a
        completed duplicate and does not run. A revoke's or an expiry's REVOKED is not:
        a copy sent again still runs, and the outcome it records supersedes this one."""
        task_id = getattr(request, "id", None)
        task = self.app.tasks.get(getattr(request, "task", None) or "")
        if not task_id or not isinstance(task, FencedExecution):
            drive()
            return
        ending = self._job_ended(task_id, state, request)
        process = state_of(request).process
        prefix = process.owner_prefix if process is not None else None
        # the grant the process kept while the report decided, locked for the outcome's
        # transaction: another execution that took it over since (it had expired) owns the
        # job's outcome, and this one writes and sends nothing (its errbacks would go out
        # twice); none can take it over while the outcome is written
        if ending is not None and prefix and not store.keep_for_outcome(task_id, prefix):
            logger.info(
                "%s of task %s not recorded: its grant was taken over since the report decided",
                state,
                task_id,
                extra={"task_id": task_id},
            )
            return
        drive()
        store.forget_pending(store.database_alias(), task_id)
        if ending is not None:  # the grant it kept while the outcome was written
            store.settle_elsewhere(
                task_id, process=prefix, by=f"worker:{state.lower()}", ending=ending
            )

    def _job_ended(
        self, task_id: str, state: str, request: Context | None
    ) -> store.Delivery | None:
        """The delivery whose job a reported FAILURE ends: that of a pool process that
        ended (its hard time limit, its loss), as the execution's own FAILURE would. Its
        copies are then completed duplicates (:func:`store.settle_elsewhere` marks it with
        the release of the process's grant). None for any other report."""
        ended = state_of(request).process
        task = self.app.tasks.get(getattr(request, "task", None) or "")
        args, kwargs = getattr(request, "args", None), getattr(request, "kwargs", None)
        if (
            request is None
            or state != states.FAILURE
            or ended is None
            or not ended.owner_prefix
            or not isinstance(task, FencedExecution)
            or args is None
            or kwargs is None
        ):
            return None
        return delivery_of(task_id, task.name, args, kwargs, request)

    def _may_record_elsewhere(self, task_id: str, state: str, request: Context | None) -> bool:
        """A fenced task's outcome reported without its lease: record it, or change nothing.

        The worker's main process reports the end of the process that ran the task (a
        hard time limit, a lost child, a revoke with terminate): only that process's
        grant is ended. A delivery that never started (expired, revoked) or failed before
        its grant ends none. Nothing is recorded while another execution holds a grant
        of the task id.
        """
        # set by the main process's request (see requests.py); else reported by the thread
        # that ran the delivery (it failed before its grant): only a grant of this very
        # thread is its own — another thread of the process (a threads pool) may be
        # running the job
        ended = state_of(request).process
        process = ended.owner_prefix if ended is not None else owners.execution_owner(request)
        # the grant of a FAILURE that ends the job is released once that outcome is
        # written, with its delivery marked ended (:meth:`_ended`)
        may = store.settle_elsewhere(
            task_id,
            process=process,
            by=f"worker:{state.lower()}",
            release=self._job_ended(task_id, state, request) is None,
        )
        if not may:
            logger.warning(
                "%s of task %s not recorded: another execution holds its lease",
                state,
                task_id,
                extra={"task_id": task_id},
            )
        return may
