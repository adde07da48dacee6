"""Untokened writes: a fenced task's result written without a token, never over a fenced one."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from celery import states
from celery.app.task import Context
from django.db import router, transaction
from django_celery_results.backends.database import DatabaseBackend

from celery_fenced import outbox, store
from celery_fenced.execution import FencedExecution
from celery_fenced.request_state import carry, state_of

logger = logging.getLogger("celery_fenced.backends")


class UntokenedWrites(DatabaseBackend):  # type: ignore[misc]
    """The backend's writes that carry no token: checked against the fenced row (R1)."""

    def _is_fenced(self, request: Context | None) -> bool:
        """Whether ``request``'s task is (or may be) fenced: then its writes are checked."""
        name = getattr(request, "task", None) if request is not None else None
        task = self.app.tasks.get(name) if isinstance(name, str) else None
        return task is None or isinstance(task, FencedExecution)

    def _untokened(
        self,
        task_id: str,
        status: str,
        request: Context | None,
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
