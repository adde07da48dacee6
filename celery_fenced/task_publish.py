"""Publishing a fenced job: its lease key decided once, its message through the outbox."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from celery.app.task import Context
from celery.utils import uuid

from celery_fenced import conf, context, keys, outbox
from celery_fenced.task_options import FencedOptions

logger = logging.getLogger("celery_fenced.execution")


class Publishing(FencedOptions):
    """A fenced task's ``apply_async``: the key stamped on the message, the outbox's send."""

    def publish_key(
        self,
        args: Any,
        kwargs: Any,
        options: Mapping[str, Any],
        fenced: conf.TaskOptions | None = None,
    ) -> str | None:
        """The lease key of a job of this task being published with ``options``, decided
        now, once, for every copy of its message (:data:`keys.KEY_HEADER`): the key the
        options' headers already carry (a retry's, a re-send's), the running lease's for
        a retry of the running job, else rendered from the arguments as the message
        carries them. None when the arguments give no key: the worker reports that.
        ``fenced``: the task's options, when the caller has them already.

        A key header decided for another job (a parent's headers passed on) is not this
        job's; a retry with other arguments (``retry(args=...)``) works on what they name,
        and runs under their key."""
        serializer = options.get("serializer") or getattr(self, "serializer", None) or "json"
        task_id = options.get("task_id")
        retried = outbox.is_same_job() and self.request.id == task_id
        if not retried or _same_arguments(self.request, args, kwargs, serializer):
            carried = keys.carried_key(keys.headers_of(options), self.name, task_id)
            if carried is not None:
                return carried
            running = getattr(self.request, "lease_key", None)
            if retried and running:
                return str(running)
        try:
            spec = (fenced or self.fenced_options()).key
            return keys.publish_key(
                self.name, spec, self.run, args or (), kwargs or {}, serializer
            )
        except Exception:
            return None

    def apply_async(
        self,
        args: Any = None,
        kwargs: Any = None,
        task_id: str | None = None,
        *more: Any,
        **options: Any,
    ) -> Any:
        """Celery's ``apply_async``, through the outbox (``fenced_outbox``, on by default).

        The job is recorded in the lease database, in the caller's transaction when one
        is open there, and the message is sent when it commits (see
        :mod:`celery_fenced.outbox`). Eager tasks (``task_always_eager``) and tasks with
        ``lease_outbox = False`` are sent as Celery sends them.
        """
        celery_apply_async = super().apply_async  # type: ignore[misc]
        if self.app.conf.task_always_eager:
            return celery_apply_async(args, kwargs, task_id, *more, **options)

        def plain(*args: Any, **options: Any) -> Any:
            # decided here: the app's send_task it ends in does not publish it by name
            with context.sending_decided():
                return celery_apply_async(*args, **options)

        chosen = task_id or uuid()
        fenced = self.fenced_options()
        key = self.publish_key(args, kwargs, {**options, "task_id": chosen}, fenced)
        keys.stamp_key(options, key, self.name, chosen)
        if more or not fenced.outbox:
            return plain(args, kwargs, chosen, *more, **options)
        if outbox.sends_at_once():
            logger.info(
                "task %s[%s]: sent at once, unrecorded (a retry, a replacement or a re-send "
                "that cannot wait for a commit)",
                self.name,
                task_id,
                extra={"task_id": task_id},
            )
            return plain(args, kwargs, chosen, **options)
        to_parent = options.pop("add_to_parent", True)

        def send(deferred: bool) -> Any:
            # a producer lent by the caller (a group's) is back in its pool by the commit
            lent = {"producer"} if deferred else set()
            kept = {k: v for k, v in options.items() if k not in lent}
            return plain(args, kwargs, chosen, add_to_parent=False, **kept)

        publisher = outbox.Publisher(
            self.app,
            self.name,
            fenced.unique,
            self.AsyncResult,  # type: ignore[attr-defined]
        )
        result = outbox.publish(publisher, args, kwargs, chosen, options, send, key=key or "")
        return outbox.in_trail(self.app, result, to_parent)


def _same_arguments(request: Context, args: Any, kwargs: Any, serializer: str) -> bool:
    """Whether ``args`` and ``kwargs`` are those of the message ``request`` runs (as that
    message carries them)."""
    had = (list(request.args or ()), dict(request.kwargs or {}))
    given = (list(args or ()), dict(kwargs or {}))
    if given == had:
        return True
    try:
        carried = keys.as_carried(*given, serializer)
    except Exception:
        return False
    return (list(carried[0]), dict(carried[1])) == had
