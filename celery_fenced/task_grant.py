"""The grant a fenced execution runs under: its key, its delivery, the acquisition."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from celery.app.task import Context
from celery.exceptions import Ignore

from celery_fenced import conf, keys, reclaim, store
from celery_fenced.exceptions import AlreadyCompleted
from celery_fenced.owners import execution_owner
from celery_fenced.task_options import FencedOptions

if TYPE_CHECKING:
    from celery_fenced.store import Delivery, HeldLease

logger = logging.getLogger("celery_fenced.execution")


class Granting(FencedOptions):
    """Takes a fenced execution's grant before its body runs (or skips the delivery)."""

    def _lease_key_of(
        self,
        request: Context,
        options: conf.TaskOptions,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> str:
        """The key this execution runs under: the one its message carries, decided where
        the job was published; else (a message from a publisher that did not decide it,
        a direct or eager call) rendered from the arguments as they arrived."""
        carried = keys.carried_key(_message_headers(request), self.name, request.id)
        if carried is not None:
            return carried
        return keys.render_key(self.name, options.key, self.run, args, kwargs)

    def _take_lease(
        self,
        key: str,
        options: conf.TaskOptions,
        alias: str,
        task_id: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        settings: conf.FencedSettings | None = None,
    ) -> HeldLease:
        """Grant this execution the key (or LeaseBusy); skip a completed duplicate.

        ``settings``: the store's settings, already loaded by the caller.

        The grant statement itself refuses a job that already completed under its lease
        within ``fenced_duplicate_window``: the same task id and message, in a delivery
        retried at least as often as this one (a redelivered or re-sent message); a retry
        the body asked for before that execution ended (``retries`` above it) still runs.
        """
        request = self.request
        retries = int(getattr(request, "retries", 0) or 0)
        delivery = self._delivery(task_id, args, kwargs) if task_id else None
        # what the reclaimer needs to send the job again, written by the grant itself
        job = reclaim.job_for(self, args, kwargs, key) if options.reclaim else None
        try:
            return store.grant(
                key,
                connection=store.kept_connection(alias, request, settings),
                ttl=options.ttl,
                owner=execution_owner(request),
                task_id=task_id,
                task_name=self.name,
                using=alias,
                renew_interval=options.renew_interval,
                job=job,
                delivery=delivery,
                ends_pending=options.outbox and bool(task_id),
                stamps_started=options.unique == "until_done",
                limit=options.limit,
                settings=settings,
            )
        except AlreadyCompleted:
            store.record_duplicate(
                key,
                task_id,
                execution_owner(request),
                {"task": self.name, "retries": retries},
                using=alias,
            )
            logger.info(
                "task %s[%s] skipped as a duplicate: the same job already completed under "
                "lease %r within fenced_duplicate_window",
                self.name,
                task_id,
                key,
                extra={"task_id": task_id, "lease_key": key},
            )
            raise Ignore() from None

    def _delivery(self, task_id: str, args: Any, kwargs: Any) -> Delivery:
        """This execution's delivery: task id, message digest, retry count."""
        return delivery_of(task_id, self.name, args, kwargs, self.request)

    def _end_delivery(
        self, alias: str, task_id: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """A delivery skipped (or failed) as busy ends its job like a completion: a copy
        of it the outbox sent again, arriving once the key is free, is a duplicate."""
        try:
            store.mark_ended(alias, self._delivery(task_id, args, kwargs))
        except Exception:
            logger.warning("could not mark %s ended as busy", task_id, exc_info=True)

    def _end_pending(self, alias: str, task_id: str) -> None:
        try:
            store.forget_pending(alias, task_id)
        except Exception:
            logger.warning("could not end the pending row of %s", task_id, exc_info=True)


def _message_headers(request: Context) -> Mapping[str, Any]:
    """The custom headers of the message ``request`` runs: Celery's worker makes each an
    attribute of the request (``request.headers`` holds them on Celery 5.5 and later)."""
    fields = vars(request)
    headers = fields.get("headers")
    found = dict(headers) if isinstance(headers, Mapping) else {}
    for name in (keys.KEY_HEADER, keys.JOB_HEADER):
        if name in fields:
            found[name] = fields[name]
    return found


def delivery_of(
    task_id: str, task_name: str, args: Any, kwargs: Any, request: Context
) -> Delivery:
    """One delivery of a job: its task id, message digest (with its replacement count) and
    retry count as the body sees it (``request.retries``; the package's own re-sends keep
    it). The execution and the worker's main process reporting its end both name it so,
    with the message's arguments."""
    retries = int(getattr(request, "retries", 0) or 0)
    nesting = keys.replacements(getattr(request, "replaced_task_nesting", 0))
    digest = keys.message_digest(task_id, task_name, args, kwargs, nesting)
    return store.Delivery(task_id, digest, retries, nesting)
