"""What a task's success sends on: its ``link`` callbacks and the next step of its chain.

Celery's tracer sends them before it stores the result. A fenced execution hands them
to the fenced result backend instead (:meth:`FencedExecution.__call__` takes them off
the request), which sends them inside the transaction that proved the execution's
token current, just before the result row: a stale execution sends none, the current
one sends each once. The sending is Celery's own, as in ``celery.app.trace``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from celery import group, signature

from celery_fenced.request_state import carry, state_of


def hold_successors(request: Any) -> None:
    """Take the callbacks and chain off ``request``, so that the tracer sends neither.

    What was taken is carried in the request's state (``successors``)."""
    held = (request.callbacks, request.chain)
    if any(held):
        carry(request, replace(state_of(request), successors=held))
        request.callbacks = None
        request.chain = None


def holds_successors(request: Any) -> bool:
    """Whether ``request`` carries successors held by :func:`hold_successors`."""
    return bool(state_of(request).successors)


def send_successors(app: Any, task_id: str, request: Any, retval: Any) -> None:
    """Send what :func:`hold_successors` took, with ``retval``, as the tracer would.

    They stay held until :func:`successors_settled`: inside the transaction that settles
    the outcome they are recorded and sent on its commit, so a transaction lost with the
    database (a restart) took them with it, and the outcome settled again sends them
    again. Not settled at all, :func:`restore_successors` gives them back for Celery's
    failure handling (a broker error here: the tracer records the task as failed and
    marks the chain's remaining steps failed).
    """
    held = state_of(request).successors
    if held:
        callbacks, chain = held
        _send(app, task_id, request, retval, callbacks, chain)


def successors_settled(request: Any) -> None:
    """The outcome that sent the held successors is settled (committed, or refused)."""
    if holds_successors(request):
        carry(request, replace(state_of(request), successors=None))


def _send(app: Any, task_id: str, request: Any, retval: Any, callbacks: Any, chain: Any) -> None:
    root_id = request.root_id or task_id
    info = request.delivery_info or {}
    priority = info.get("priority") if app.conf.task_inherit_parent_priority else None
    options: dict[str, Any] = {"parent_id": task_id, "root_id": root_id, "priority": priority}
    # as the tracer does: each message retried on its own, a bounded number of times
    # (Celery's own policy could otherwise retry forever while the lease row is locked)
    retry_publish = getattr(app.amqp, "_retry_publish", None)

    def publish(send: Any, *args: Any, **kwargs: Any) -> None:
        if retry_publish is not None:
            retry_publish(send, *args, **kwargs)
        else:
            send(*args, **kwargs)

    if callbacks:
        if len(callbacks) > 1:
            sigs: list[Any] = []
            groups: list[Any] = []
            for callback in callbacks:
                sig = signature(callback, app=app)
                (groups if isinstance(sig, group) else sigs).append(sig)
            for group_ in groups:
                publish(group_.apply_async, (retval,), **options)
            if sigs:
                publish(group(sigs, app=app).apply_async, (retval,), **options)
        else:
            publish(signature(callbacks[0], app=app).apply_async, (retval,), **options)
    if chain:
        step = signature(chain[-1], app=app)
        publish(step.apply_async, (retval,), chain=chain[:-1], **options)


def restore_successors(request: Any) -> None:
    """Give ``request`` back what :func:`hold_successors` took and nothing sent.

    For a success that could not be settled (the tracer then records a failure): Celery's
    failure handling marks the chain's remaining steps failed from ``request.chain``.
    """
    held = state_of(request).successors
    if held:
        carry(request, replace(state_of(request), successors=None))
        request.callbacks, request.chain = held
