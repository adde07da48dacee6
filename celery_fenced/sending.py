"""The app's ``send_task``: a job published by task name is recorded like any other.

``app.send_task("billing.tasks.charge", ...)`` is how a process that does not import a
task's module publishes it (a web process, beat for a task it does not have). When the
``fenced_tasks`` setting fences that name, the name alone says so, and with which
options: the job goes through the outbox as the task's ``apply_async`` sends it —
recorded in the caller's transaction when one is open on the lease database, sent when
it commits, sent again by the reclaimer if no worker grants it. A name this process has
registered as a fenced task is published by that task's ``apply_async``.

The lease key is decided here when the name and the arguments give it without the task's
signature: a ``key`` template whose every field is passed as a keyword argument, or a
callable key. The default key hashes the task's *named* arguments (defaults applied),
which only its signature gives: such a job carries no key, the worker decides it, and its
row has none (so ``unique`` cannot refuse a copy of it at publish).

Every app is given this ``send_task`` (:func:`install`) when Django loads celery_fenced
and when an app is finalized. It also records a plain task's publish inside the
transaction that proves a fenced execution's outcome (:func:`outbox.plain_sends_recorded`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from celery.utils import uuid

from celery_fenced import conf, context, keys, outbox, results
from celery_fenced.execution import FencedExecution

logger = logging.getLogger(__name__)

#: where :func:`install` keeps the app's ``send_task`` it wraps (Celery's own)
ORIGINAL = "_fenced_send_task"


def install(app: Any) -> None:
    """Give ``app`` the package's ``send_task`` (once; the one it had is kept and called)."""
    if ORIGINAL in app.__dict__:
        return
    original: Callable[..., Any] = app.send_task

    def send_task(name: str, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        return _send_task(app, original, name, args, kwargs, options)

    app.__dict__[ORIGINAL] = original
    app.send_task = send_task


def _send_task(
    app: Any,
    original: Callable[..., Any],
    name: str,
    args: Any,
    kwargs: Any,
    options: dict[str, Any],
) -> Any:
    if not context.is_sending_decided():
        task = _registered(app, name)
        fenced = None if task is not None else conf.load(app).configured_options(name)
        fenced_task = isinstance(task, FencedExecution)
        # the eager setting last, for a fenced name only: Celery reads it through Django's
        # settings, a lookup that costs more than the rest of a plain task's path here
        if (fenced_task or fenced is not None) and app.conf.task_always_eager:
            fenced_task, fenced = False, None  # sent as Celery sends it
        if fenced_task:  # as its own apply_async publishes it
            return task.apply_async(args, kwargs, **_apply_async_options(options))
        if fenced is not None:
            # the job's id, chosen now: its key header names it
            options["task_id"] = options.get("task_id") or uuid()
            key = _publish_key(app, name, fenced.key, args, kwargs, options)
            keys.stamp_key(options, key, name, options["task_id"])
            if fenced.outbox and not outbox.sends_at_once():
                return _publish(app, original, name, fenced, args, kwargs, options, key)
    alias = outbox.plain_recording()
    if alias is not None and not outbox.sends_at_once():  # a raised retry is sent now
        return outbox.record_plain(app, original, alias, name, args, kwargs, options)
    return original(name, args, kwargs, **options)


def _registered(app: Any, name: str) -> Any:
    """The task ``name`` registered in ``app`` now, or None (an app that does not finalize
    by itself is not finalized to find out, as Celery's ``send_task`` does not)."""
    registry = app.tasks if app.autofinalize else app._tasks
    return registry.get(name)


def _apply_async_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """``send_task``'s options as ``apply_async`` takes them (it names its own task type
    and result class)."""
    return {k: v for k, v in options.items() if k not in ("task_type", "result_cls")}


def _publish_key(
    app: Any, name: str, spec: Any, args: Any, kwargs: Any, options: Mapping[str, Any]
) -> str | None:
    """The lease key of a job of task ``name`` (key option ``spec``), from what a process
    without the task knows: the key the headers already carry; a template whose every
    field is a keyword argument; a callable key. None otherwise (the default key needs
    the task's signature): the worker decides it."""
    carried = keys.carried_key(keys.headers_of(options), name, options.get("task_id"))
    if carried is not None:
        return carried
    if spec is None:
        return None
    args, kwargs = list(args or ()), dict(kwargs or {})
    if isinstance(spec, str) and not keys.template_fields(spec) <= set(kwargs):
        return None  # a field may be a positional argument, or left to its default
    serializer = options.get("serializer") or app.conf.task_serializer
    try:
        args, kwargs = keys.as_carried(args, kwargs, serializer)
        return keys.render_key(name, spec, _no_signature, args, kwargs)
    except Exception as exc:
        logger.info(
            "task %s: no lease key decided at publish (%s); the worker decides it",
            name,
            exc,
        )
        return None


def _no_signature(*args: Any, **kwargs: Any) -> None:
    """The signature a key template is filled against when the task is not here: the
    keyword arguments as passed (every name the template has is among them)."""


def _publish(
    app: Any,
    original: Callable[..., Any],
    name: str,
    fenced: conf.TaskOptions,
    args: Any,
    kwargs: Any,
    options: dict[str, Any],
    key: str | None,
) -> Any:
    """Record the job of task ``name`` and send it with Celery's ``send_task`` when the
    lease database commits (:func:`outbox.publish`)."""
    task_id = options.pop("task_id", None) or uuid()
    to_parent = options.pop("add_to_parent", True)
    result_cls = results.aware(options.pop("result_cls", None) or app.AsyncResult)
    # without a key, no copy of the job can be told apart at publish
    publisher = outbox.Publisher(app, name, fenced.unique if key else None, result_cls)

    def send(deferred: bool) -> Any:
        # a producer lent by the caller (a group's) is back in its pool by the commit
        kept = {k: v for k, v in options.items() if not (deferred and k == "producer")}
        return original(
            name, args, kwargs, task_id=task_id, add_to_parent=False, result_cls=result_cls, **kept
        )

    result = outbox.publish(publisher, args, kwargs, task_id, options, send, key=key or "")
    return outbox.in_trail(app, result, to_parent)
