"""The fenced result path: an execution's outcome written only under its lease, proven current."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from celery import states
from celery.app.task import Context
from django.db import (
    DatabaseError,
    connections,
    models,
    router,
    transaction,
)
from django.db.models.functions import Now
from django.db.transaction import TransactionManagementError
from django.utils import timezone
from django_celery_results.backends.database import DatabaseBackend

from celery_fenced import atomic, conf, context, outbox, store, workflow
from celery_fenced.exceptions import StaleToken
from celery_fenced.renewal import renewer
from celery_fenced.request_state import add_meta, carry, state_of
from celery_fenced.store import HeldLease

logger = logging.getLogger("celery_fenced.backends")

RELEASING_STATES = frozenset({*states.READY_STATES, states.RETRY})


def lease_of(request: Context | None) -> HeldLease | None:
    """The grant an execution's request holds (set only by the worker at acquisition)."""
    return state_of(request).lease


def proof_meta(lease: HeldLease) -> dict[str, Any]:
    """What a result row written under ``lease`` carries in its ``meta``: token and key."""
    return {"fencing_token": lease.token, "lease_key": lease.key}


class FencedWrites(DatabaseBackend):  # type: ignore[misc]
    """The backend's writes under a lease: prove it current (release it), then write."""

    def _settle(
        self,
        task_id: str,
        result: Any,
        status: str,
        request: Context | None,
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
        body = atomic.body_of(request, lease)
        if body is not None and releasing and context.atomic_body_lease.get() is lease:
            raise TransactionManagementError(
                f"update_state({status!r}) inside the atomic body of {lease.key!r}: a ready "
                "state would end its transaction before the body does; return or raise "
                "to end it, or use a state of your own for progress"
            )
        if body is not None and releasing:
            if status == states.SUCCESS:
                return self._settle_in_body(body, task_id, result, status, request, lease, then)
            body.rollback()  # an outcome that is no success commits nothing of the body

        again = from_scratch(request)

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
            renewer().unregister(lease)
            lease.confirm_released()
        return proven

    def _settle_in_body(
        self,
        body: atomic.BodyTransaction,
        task_id: str,
        result: Any,
        status: str,
        request: Context | None,
        lease: HeldLease,
        then: Callable[[], None] | None,
    ) -> bool:
        """The success of an atomic body, settled inside the body's own transaction.

        The proof, the release and what ``then`` writes and sends run on the connection
        that holds the body's writes, and commit with them. Refused, the body rolls back
        first: the refusal is recorded after, in a transaction of its own. Nothing is
        tried again after a database outage: the body's writes went with the connection.
        """
        try:
            self._prove_then(task_id, status, request, lease, True, then or (lambda: None))
        except store.Refused as refused:
            body.rollback()
            self._refuse(task_id, result, status, request, lease, refused.current)
            return False
        except BaseException as exc:
            body.rollback()
            if atomic.lost_with_its_session(exc):
                return self._after_body_lost(task_id, request, lease, exc)
            raise
        try:
            body.commit()
        except Exception as exc:
            if body.committed or not atomic.lost_with_its_session(exc):
                raise
            return self._after_body_lost(task_id, request, lease, exc)
        finally:
            if body.committed:  # a hook of the body's that raised changes nothing of this
                renewer().unregister(lease)
                lease.confirm_released()
        return True

    def _after_body_lost(
        self, task_id: str, request: Context | None, lease: HeldLease, exc: Exception
    ) -> bool:
        """An atomic body's success met a database error as it was proven or committed (a
        restart, a failover, a lost link, a deadlock): nothing of the body stands, so the
        job runs again, not ends as a FAILURE.

        Once the database answers, a commit that did land (its answer lost with the
        connection) is found by its release, and stands. Otherwise the task ends its
        grant, if still current, and sends the job again at once with the same retry
        count, its RETRY recorded (:meth:`Outcomes.send_again_after_lost_body`); when
        another execution took the key over, this one's outcome is a stale one's
        (:meth:`_refuse`). An eager run, or a task that is not fenced, raises ``exc``.
        """
        if self._through_outages(
            task_id, [lease.alias], lambda: self._settled_by(task_id, states.SUCCESS, lease)
        ):
            renewer().unregister(lease)
            lease.confirm_released()
            return True
        task = self.app.tasks.get(getattr(request, "task", None) or "")
        send_again = getattr(task, "send_again_after_lost_body", None)
        if send_again is None or getattr(request, "is_eager", False):
            raise exc
        logger.warning(
            "task %s[%s]: the database failed before its atomic body committed (%s); "
            "nothing of it was committed: the job runs again unless another execution "
            "took its key",
            getattr(request, "task", None),
            task_id,
            exc,
            extra={"task_id": task_id, "lease_key": lease.key, "fencing_token": lease.token},
        )
        if send_again(exc):
            return True
        # not sent again: another execution took the key over, or the grant was ended.
        # Its outcome is that of any stale execution (R2): nothing over a redelivery of
        # the same task id; else FAILURE(StaleToken), or the job would be left with no
        # outcome, nothing pending, granted or running to give it one
        current = self._through_outages(
            task_id, [lease.alias], lambda: store.token_of(lease.key, using=lease.alias)
        )
        self._refuse(task_id, None, states.SUCCESS, request, lease, current)
        return False

    def process_cleanup(self) -> None:
        """After every task: an atomic body's transaction still open is rolled back."""
        atomic.close_leaked()
        super().process_cleanup()

    def _prove_then(
        self,
        task_id: str,
        status: str,
        request: Context | None,
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
            add_meta(request, proof_meta(lease))
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
        self, task_id: str, result: Any, status: str, request: Context | None, lease: HeldLease
    ) -> None:
        """The success of :meth:`_in_one_statement`: one statement, or :class:`store.Refused`."""
        meta = proof_meta(lease)
        fields = self._row_fields(
            task_id, self.encode_result(result, status), status, None, request, meta
        )
        kept = store.kept_connection(lease.alias, request)
        connection = kept if kept is not None else connections[lease.alias]
        values = _result_values(self.TaskModel, {**fields, "task_id": task_id}, connection)
        ok, current = store.release_with_result(lease, status, values, connection=kept)
        if not ok:
            raise store.Refused(current)
        add_meta(request, meta)

    def _row_fields(
        self,
        task_id: str,
        result: Any,
        status: str,
        traceback: Any,
        request: Context | None,
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

    def _get_extended_properties(self, request: Context | None, traceback: Any) -> dict[str, Any]:
        """The result row's extended fields, as django-celery-results computes them, with
        ``result_extended`` read once with the package's settings (kept until a setting
        changes): its own lookup through Celery's configuration, on every result, cost
        more than the rest of the row."""
        found: dict[str, Any] = dict.fromkeys(_EXTENDED_FIELDS)
        if not request or not conf.load(self.app).result_extended:
            return found
        task_args = getattr(request, "argsrepr", None)  # task protocol 2
        if task_args is None:
            task_args = getattr(request, "args", None)  # task protocol 1
        task_kwargs = getattr(request, "kwargsrepr", None)
        if task_kwargs is None:
            task_kwargs = getattr(request, "kwargs", None)
        if task_args is not None:
            _, _, task_args = self.encode_content(task_args)
        if task_kwargs is not None:
            _, _, task_kwargs = self.encode_content(task_kwargs)
        found.update(
            periodic_task_name=getattr(request, "periodic_task_name", None),
            task_args=task_args,
            task_kwargs=task_kwargs,
            task_name=getattr(request, "task", None),
            traceback=traceback,
            worker=getattr(request, "hostname", None),
        )
        return found

    def _write_row(
        self,
        task_id: str,
        result: Any,
        status: str,
        traceback: Any,
        request: Context | None,
        using: Any,
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
        request: Context | None,
        lease: HeldLease,
        current: int | None,
    ) -> None:
        grant = store.grant_of(lease.key, using=lease.alias)
        current_task, ended = grant if grant is not None else ("", True)
        newer = current if current != lease.token else None
        lease.mark_lost(f"{status} result refused: current token is {current}", warn=False)
        stale = store.reject_stale(
            lease.alias,
            lease.key,
            lease.token,
            newer,
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
            add_meta(request, {"stale_fencing_token": lease.token})

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


#: the result row's fields django-celery-results fills only with ``result_extended``
_EXTENDED_FIELDS = (
    "periodic_task_name",
    "task_args",
    "task_kwargs",
    "task_name",
    "traceback",
    "worker",
)


def _result_values(model: Any, fields: dict[str, Any], connection: Any) -> list[Any]:
    """The values of a new ``model`` row with ``fields`` (the other columns their
    defaults), in :data:`store.RESULT_COLUMNS` order, as its fields prepare them for
    ``connection`` on a save (``auto_now`` and ``auto_now_add``: now, read once).

    Text columns are what their field's ``to_python`` makes of them (``None``, or a
    string); other columns go through the field itself. Without making the model
    instance and preparing every field: what django-celery-results' row needs, on every
    task's success.
    """
    now = None
    values: list[Any] = []
    for column, field, kind in _result_columns(model):
        if kind == "now":
            now = now or timezone.now()
            value = now
        else:
            value = fields[column] if column in fields else field.get_default()
        if kind == "text":
            values.append(value if value is None or isinstance(value, str) else str(value))
        else:
            values.append(field.get_db_prep_save(value, connection))
    return values


_COLUMNS: dict[Any, list[tuple[str, Any, str]]] = {}


def _result_columns(model: Any) -> list[tuple[str, Any, str]]:
    """``(column, field, kind)`` of each result column of ``model``: kind ``"now"`` (an
    ``auto_now`` or ``auto_now_add`` date), ``"text"`` (a ``CharField`` or ``TextField``
    of Django's own) or ``"field"`` (prepared by the field)."""
    found = _COLUMNS.get(model)
    if found is None:
        found = []
        for column in store.RESULT_COLUMNS:
            field = model._meta.get_field(column)
            if getattr(field, "auto_now", False) or getattr(field, "auto_now_add", False):
                kind = "now"
            elif type(field) in (models.CharField, models.TextField):
                kind = "text"
            else:
                kind = "field"
            found.append((column, field, kind))
        _COLUMNS[model] = found
    return found


def _refused_under(outcome: Any, lease: HeldLease) -> bool:
    """Whether ``outcome`` is a write refused under ``lease``'s key and token (logged as
    a warning when it was refused)."""
    return (
        isinstance(outcome, StaleToken)
        and outcome.key == lease.key
        and outcome.token == lease.token
    )


def from_scratch(request: Context | None) -> Callable[[], None]:
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
