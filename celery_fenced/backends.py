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
from dataclasses import replace
from typing import Any, TypeVar

from celery import states
from django.db import (
    DatabaseError,
    connections,
    router,
    transaction,
)
from django.db.models.functions import Now
from django_celery_results.backends.database import DatabaseBackend
from django_celery_results.models import TaskResult

from celery_fenced import exits, outages, outbox, owners, store, workflow
from celery_fenced.exceptions import StaleToken
from celery_fenced.request_state import carry, state_of
from celery_fenced.store import HeldLease

logger = logging.getLogger(__name__)
T = TypeVar("T")

RELEASING_STATES = frozenset({*states.READY_STATES, states.RETRY})


def lease_of(request: Any) -> HeldLease | None:
    """The grant an execution's request holds (set only by the worker at acquisition)."""
    return state_of(request).lease


def proof_meta(lease: HeldLease) -> dict[str, Any]:
    """What a result row written under ``lease`` carries in its ``meta``: token and key."""
    return {"fencing_token": lease.token, "lease_key": lease.key}


class FencedDatabaseBackend(DatabaseBackend):  # type: ignore[misc]
    """A drop-in ``DatabaseBackend`` that refuses result writes under stale tokens."""

    # -- what Celery's tracer and worker report ---------------------------------------
    def mark_as_done(
        self,
        task_id: str,
        result: Any,
        request: Any = None,
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

    def _in_one_statement(self, task_id: str, state: str, request: Any, lease: HeldLease) -> bool:
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
        request: Any = None,
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
        request: Any = None,
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

    def _call_task_errbacks(self, request: Any, exc: Any, traceback: Any) -> None:
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
        self, task_id: str, result: Any, state: str, request: Any, drive: Callable[[], None]
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

    def _first_report(self, task_id: str, state: str, request: Any) -> bool:
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
        self, task_id: str, state: str, request: Any, drive: Callable[[], None]
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
        self, task_id: str, state: str, request: Any, drive: Callable[[], None]
    ) -> None:
        """An untokened final outcome of a fenced task, reported outside its grant (often
        by the worker's main process, whose connections nothing else resets)."""
        again = _from_scratch(request)

        def attempt() -> None:
            again()
            if self._may_record_elsewhere(task_id, state, request):
                self._untokened(
                    task_id, state, request, lambda: self._ended(drive, state, request)
                )

        self._through_outages(task_id, self._untokened_aliases(), attempt)

    def _ended(self, drive: Callable[[], None], state: str, request: Any) -> None:
        """``drive()`` — an untokened final outcome of a fenced task (a time limit, a lost
        worker) — and the end of its row in the outbox with it (handed over when another
        job took its expired grant over): the reclaimer does not send the job again over
        that outcome.

        The FAILURE of a pool process that ended (its hard time limit, its loss) is the
        job's outcome, as an execution's own FAILURE is: its errbacks are sent, so a copy
        of the message (a busy retry sent while it held the key, a redelivery) is a
        completed duplicate and does not run. A revoke's or an expiry's REVOKED is not:
        a copy sent again still runs, and the outcome it records supersedes this one."""
        from celery_fenced.execution import FencedExecution

        drive()
        task_id = getattr(request, "id", None)
        task = self.app.tasks.get(getattr(request, "task", None) or "")
        if not task_id or not isinstance(task, FencedExecution):
            return
        store.forget_pending(store.database_alias(), task_id)
        ending = self._job_ended(task_id, state, request)
        if ending is not None:  # the grant it kept while the outcome was written
            process = state_of(request).process
            store.settle_elsewhere(
                task_id,
                process=process.owner_prefix if process is not None else None,
                by=f"worker:{state.lower()}",
                ending=ending,
            )

    def _job_ended(self, task_id: str, state: str, request: Any) -> store.Delivery | None:
        """The delivery whose job a reported FAILURE ends: that of a pool process that
        ended (its hard time limit, its loss), as the execution's own FAILURE would. Its
        copies are then completed duplicates (:func:`store.settle_elsewhere` marks it with
        the release of the process's grant). None for any other report."""
        from celery_fenced.execution import FencedExecution, delivery_of

        ended = state_of(request).process
        task = self.app.tasks.get(getattr(request, "task", None) or "")
        args, kwargs = getattr(request, "args", None), getattr(request, "kwargs", None)
        if (
            state != states.FAILURE
            or ended is None
            or not ended.owner_prefix
            or not isinstance(task, FencedExecution)
            or args is None
            or kwargs is None
        ):
            return None
        return delivery_of(task_id, task.name, args, kwargs, request)

    # -- the fenced path ----------------------------------------------------------------
    def _store_result(
        self,
        task_id: str,
        result: Any,
        status: str,
        traceback: Any = None,
        request: Any = None,
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

    def _settle(
        self,
        task_id: str,
        result: Any,
        status: str,
        request: Any,
        lease: HeldLease,
        then: Callable[[], None] | None,
    ) -> bool:
        """Prove ``lease`` current (and release it, for a final state), then run ``then``.

        One transaction: the lease row first, then the task id's result lock, then what
        ``then`` writes and sends. Refused: nothing of ``then`` happens, and the refusal
        is recorded (R2). Returns whether it was proven. Without ``then``, one statement
        proves, releases and writes the result row (see :meth:`_in_one_statement`).
        """
        releasing = status in RELEASING_STATES

        again = _from_scratch(request)

        def attempt() -> bool:
            again()
            try:
                if then is None:
                    self._prove_and_write(task_id, result, status, request, lease)
                else:
                    self._prove_then(task_id, status, request, lease, releasing, then)
            except store.Refused as refused:
                if (releasing or refused.current == lease.token) and self._settled_by(
                    task_id, status, lease
                ):
                    return True  # a commit whose answer was lost with the connection
                self._refuse(task_id, result, status, request, lease, refused.current)
                return False
            return True

        # A final outcome is settled again when the database is back from a restart or
        # a failover, instead of turning a done job into a FAILURE.
        proven = self._through_outages(task_id, [lease.alias], attempt) if releasing else attempt()
        if proven and releasing:
            from celery_fenced.renewal import renewer

            renewer().unregister(lease)
            lease.confirm_released()
        return proven

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

    def _prove_then(
        self,
        task_id: str,
        status: str,
        request: Any,
        lease: HeldLease,
        releasing: bool,
        then: Callable[[], None],
    ) -> None:
        with transaction.atomic(using=lease.alias):
            # releasing: one statement proves the token current and releases the grant;
            # a write that fails below rolls the release back with it
            ok, current = store.prove_for_result(lease, task_id, status, releasing=releasing)
            if not ok:
                raise store.Refused(current)
            request.meta = {**(getattr(request, "meta", None) or {}), **proof_meta(lease)}
            carry(request, replace(state_of(request), proven=lease))
            try:
                # what it sends on (callbacks, chain steps, errbacks, a chord body) goes
                # out when this transaction commits: a proof that never commits is none
                with outbox.plain_sends_recorded(lease.alias):
                    then()
            finally:
                carry(request, replace(state_of(request), proven=None))
            if connections[lease.alias].needs_rollback:
                # something ``then`` ran swallowed a database error: the commit would
                # silently be a rollback of the outcome and the release
                raise DatabaseError(
                    f"the {status} outcome of task {task_id} was not settled: a "
                    "database error inside its transaction was swallowed"
                )

    def _prove_and_write(
        self, task_id: str, result: Any, status: str, request: Any, lease: HeldLease
    ) -> None:
        """The success of :meth:`_in_one_statement`: one statement, or :class:`store.Refused`."""
        meta = proof_meta(lease)
        fields = self._row_fields(
            task_id, self.encode_result(result, status), status, None, request, meta
        )
        model = self.TaskModel
        row = model(task_id=task_id, **fields)
        kept = store.kept_connection(lease.alias, request)
        connection = kept if kept is not None else connections[lease.alias]
        values = [
            field.get_db_prep_save(field.pre_save(row, add=True), connection)
            for field in map(model._meta.get_field, store.RESULT_COLUMNS)
        ]
        ok, current = store.release_with_result(lease, status, values, connection=kept)
        if not ok:
            raise store.Refused(current)
        request.meta = {**(getattr(request, "meta", None) or {}), **meta}

    def _row_fields(
        self,
        task_id: str,
        result: Any,
        status: str,
        traceback: Any,
        request: Any,
        meta: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The result row's fields as ``DatabaseBackend._store_result`` computes them.

        ``meta``: added to the request's ``meta`` for this row.
        """
        content_type, content_encoding, encoded = self.encode_content(result)
        row_meta = {
            **self._get_meta_from_request(request),
            **(meta or {}),
            "children": self.current_task_children(request),
        }
        _, _, encoded_meta = self.encode_content(row_meta)
        return {
            "content_encoding": content_encoding,
            "content_type": content_type,
            "meta": encoded_meta,
            "result": encoded,
            "status": status,
            "traceback": traceback,
            **self._get_extended_properties(request, traceback),
        }

    def _write_row(
        self, task_id: str, result: Any, status: str, traceback: Any, request: Any, using: Any
    ) -> None:
        """The fenced execution's result row: what ``DatabaseBackend`` writes, in one upsert.

        The fields come from ``DatabaseBackend``'s own helpers, as in its ``_store_result``;
        the row is written with one ``INSERT … ON CONFLICT (task_id) DO UPDATE`` (MySQL's
        ``ON DUPLICATE KEY UPDATE``) instead of
        the manager's ``get_or_create`` (a ``SELECT``, then an ``INSERT`` in a savepoint):
        inside the fenced transaction that is two round trips fewer, and a concurrent
        untokened write of the same task id is settled by the conflict clause. A database
        without that clause, or a ``STARTED`` write (its start time is the database's
        ``Now()``), goes through the manager as ``DatabaseBackend`` does.
        """
        fields = self._row_fields(task_id, result, status, traceback, request)
        model = self.TaskModel
        alias = using or router.db_for_write(model)
        features = connections[alias].features
        if status == states.STARTED or not features.supports_update_conflicts:
            if status == states.STARTED:
                fields["date_started"] = Now()
            model._default_manager.store_result(task_id=task_id, using=using, **fields)
            return
        # MariaDB and MySQL: ON DUPLICATE KEY UPDATE (task_id is the row's one unique key
        # besides its id)
        target = features.supports_update_conflicts_with_target
        model._default_manager.using(alias).bulk_create(
            [model(task_id=task_id, **fields)],
            update_conflicts=True,
            unique_fields=["task_id"] if target else None,
            update_fields=[*fields, "date_done"],
        )

    def _refuse(
        self,
        task_id: str,
        result: Any,
        status: str,
        request: Any,
        lease: HeldLease,
        current: int | None,
    ) -> None:
        grant = store.grant_of(lease.key, using=lease.alias)
        current_task, ended = grant if grant is not None else ("", True)
        newer = current if current != lease.token else None
        lease.mark_lost(f"{status} result refused: current token is {current}", warn=False)
        stale = store.reject_stale(
            lease.key,
            lease.token,
            newer,
            using=lease.alias,
            task_id=task_id,
            owner=lease.owner,
            what=f"{status} result",
            task_name=lease.task_name,
            # the FAILURE of the body's own refused write: that refusal was the warning
            logged=_refused_under(result, lease),
        )
        if current_task == task_id and (newer is not None or not ended):
            # A redelivery: the newer execution owns this task's result. Or this
            # execution's own grant expired (a state that is not final): nothing stored.
            return
        if store.granted_again(lease.key, task_id, lease.token, using=lease.alias):
            return  # a redelivery of the job took another permit of the key: its result
        if status in states.READY_STATES:
            request.meta = {
                **(getattr(request, "meta", None) or {}),
                "stale_fencing_token": lease.token,
            }

            def fail() -> None:
                # No execution of this task id will run again: its FAILURE(StaleToken) —
                # not the stale execution's outcome — reaches the workflow once (the
                # chain's remaining steps, the chord, the errbacks), so that a caller
                # waiting on it gets the error rather than waiting for ever.
                workflow.restore_successors(request)
                # this is its outcome: its job, handed to the outbox when the other job
                # took its key over, is not sent again, and a copy already sent (or
                # its busy retry) is skipped as a completed duplicate
                store.forget_pending(lease.alias, task_id)
                if lease.delivery is not None:
                    store.mark_ended(lease.alias, lease.delivery)
                # the row is written as checked, untokened
                carry(request, replace(state_of(request), lease=None))
                try:
                    DatabaseBackend.mark_as_failure(self, task_id, stale, None, request)
                finally:
                    carry(request, replace(state_of(request), lease=lease))

            # never over a final outcome already recorded (a REVOKED, another result)
            self._untokened(task_id, states.FAILURE, request, fail, over_final=False)

    def _settled_by(self, task_id: str, status: str, lease: HeldLease) -> bool:
        """Whether the ``status`` outcome under ``lease`` committed already: its grant
        released in that state, or ``task_id``'s row holding a final result written under
        it (the key granted again since)."""
        if store.released_as(lease, status):
            return True
        row = (
            self.TaskModel._default_manager.using(router.db_for_write(self.TaskModel))
            .filter(task_id=task_id, status__in=states.READY_STATES)
            .values_list("meta", flat=True)
            .first()
        )
        if not row:
            return False
        try:
            meta = self.decode(row)
        except Exception:
            return False
        return (
            isinstance(meta, dict)
            and meta.get("fencing_token") == lease.token
            and meta.get("lease_key") == lease.key
        )

    # -- untokened writes -----------------------------------------------------------------
    def _is_fenced(self, request: Any) -> bool:
        """Whether ``request``'s task is (or may be) fenced: then its writes are checked."""
        from celery_fenced.execution import FencedExecution

        name = getattr(request, "task", None) if request is not None else None
        task = self.app.tasks.get(name) if isinstance(name, str) else None
        return task is None or isinstance(task, FencedExecution)

    def _may_record_elsewhere(self, task_id: str, state: str, request: Any) -> bool:
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

    def _untokened(
        self,
        task_id: str,
        status: str,
        request: Any,
        then: Callable[[], None],
        *,
        over_final: bool = True,
    ) -> None:
        """Run ``then`` (an untokened write, and what it drives) unless R1 refuses it.

        The check and ``then`` run in one transaction holding the task id's result lock,
        so a fenced write cannot commit between them.
        """
        alias = router.db_for_write(self.TaskModel)
        with transaction.atomic(using=alias):
            store.lock_for_result(alias, task_id)
            if not self._untokened_may_write(task_id, alias, over_final):
                logger.warning(
                    "untokened %s write for task %s refused: a fenced execution's result stands",
                    status,
                    task_id,
                    extra={"task_id": task_id},
                )
                return
            marker = state_of(request).checked
            if request is not None:
                carry(request, replace(state_of(request), checked=task_id))
            try:
                with outbox.plain_sends_recorded(alias):
                    then()
            finally:
                if request is not None:
                    carry(request, replace(state_of(request), checked=marker))

    def _untokened_may_write(self, task_id: str, alias: str, over_final: bool = True) -> bool:
        row = (
            self.TaskModel._default_manager.using(alias)
            .filter(task_id=task_id)
            .values_list("status", "meta")
            .first()
        )
        if row is None:
            return True
        existing_status, meta = row
        if not over_final and existing_status in states.READY_STATES:
            return False
        try:
            decoded = self.decode(meta) if meta else {}
        except Exception:
            return True
        if not isinstance(decoded, dict):
            return True
        if existing_status in states.READY_STATES and decoded.get("stale_fencing_token"):
            # a stale report's FAILURE(StaleToken), recorded as the job's one outcome (its
            # job ended, see _refuse): not a busy copy's RETRY written after it
            return False
        token = decoded.get("fencing_token")
        if token is None:
            return True
        if existing_status in states.READY_STATES:
            return False
        key = decoded.get("lease_key")
        if not isinstance(key, str):
            return True
        return not store.grant_live_since(key, token, task_id)


def _refused_under(outcome: Any, lease: HeldLease) -> bool:
    """Whether ``outcome`` is a write refused under ``lease``'s key and token (logged as
    a warning when it was refused)."""
    return (
        isinstance(outcome, StaleToken)
        and outcome.key == lease.key
        and outcome.token == lease.token
    )


def _from_scratch(request: Any) -> Callable[[], None]:
    """A function that gives ``request`` back the children it has now: each attempt at
    settling an outcome (again after a database restart) adds to the trail only what it
    sends, as the first would have."""
    children = getattr(request, "children", None)
    if not isinstance(children, list):
        return lambda: None
    before = list(children)

    def again() -> None:
        children[:] = before

    return again


__all__ = ["FencedDatabaseBackend", "StaleToken"]
