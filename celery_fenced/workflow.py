"""What a task's success sends on: its ``link`` callbacks and the next step of its chain.

Celery's tracer sends them before it stores the result. A fenced execution hands them
to the fenced result backend instead (:meth:`FencedExecution.__call__` takes them off
the request), which sends them inside the transaction that proved the execution's
token current, just before the result row: a stale execution sends none, the current
one sends each once. The sending is Celery's own, as in ``celery.app.trace``.
"""

from __future__ import annotations

from typing import Any

from celery import group, signature

#: the request attribute holding what was taken off it: (callbacks, chain)
HELD = "_fenced_successors"


def hold_successors(request: Any) -> None:
    """Take the callbacks and chain off ``request``, so that the tracer sends neither."""
    held = (request.callbacks, request.chain)
    if any(held):
        setattr(request, HELD, held)
        request.callbacks = None
        request.chain = None


def send_successors(app: Any, task_id: str, request: Any, retval: Any) -> None:
    """Send what :func:`hold_successors` took, with ``retval``, as the tracer would."""
    held = getattr(request, HELD, None)
    if not held:
        return
    setattr(request, HELD, None)
    callbacks, chain = held
    root_id = request.root_id or task_id
    info = request.delivery_info or {}
    priority = info.get("priority") if app.conf.task_inherit_parent_priority else None
    options: dict[str, Any] = {"parent_id": task_id, "root_id": root_id, "priority": priority}
    if callbacks:
        if len(callbacks) > 1:
            sigs: list[Any] = []
            groups: list[Any] = []
            for callback in callbacks:
                sig = signature(callback, app=app)
                (groups if isinstance(sig, group) else sigs).append(sig)
            for group_ in groups:
                group_.apply_async((retval,), **options)
            if sigs:
                group(sigs, app=app).apply_async((retval,), **options)
        else:
            signature(callbacks[0], app=app).apply_async((retval,), **options)
    if chain:
        step = signature(chain[-1], app=app)
        step.apply_async((retval,), chain=chain[:-1], **options)
