"""How a publish is sent now: recorded and sent on commit, at once, or as the running job.

Context flags the package sets around the publishes it makes (a retry, a replacement, a
callback sent inside the transaction that proves an outcome) and the outbox
(:mod:`celery_fenced.outbox`) reads.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping
from typing import Any

from django.db import connections

from celery_fenced import store

#: set while the package sends a message that must not wait for a commit: a retry or a
#: replacement raised inside the caller's own transaction, which the raise rolls back
_at_once: contextvars.ContextVar[bool] = contextvars.ContextVar("fenced_outbox_at_once")


@contextlib.contextmanager
def at_once_in_transaction(alias: str) -> Iterator[None]:
    """Inside it, a publish sends at once, unrecorded, when a transaction is already open
    on ``alias``: its commit would never come (the exception that follows rolls it back),
    and the row and the message would go with it. Outside a transaction nothing changes."""
    # never turns off an outer at-once (``unrecorded``: the database is away)
    marker = _at_once.set(_at_once.get(False) or connections[alias].in_atomic_block)
    try:
        yield
    finally:
        _at_once.reset(marker)


@contextlib.contextmanager
def unrecorded() -> Iterator[None]:
    """Inside it, a publish is sent as Celery sends it, unrecorded: the worker's own
    re-send of a job after a database error before its grant (the database is away)."""
    marker = _at_once.set(True)
    try:
        yield
    finally:
        _at_once.reset(marker)


def sends_at_once() -> bool:
    """Whether a publish now is sent at once, unrecorded."""
    return _at_once.get(False)


#: set while a task re-publishes the job it is running (its retry): a ``lease_unique``
#: job keeps its place rather than being refused as a copy of itself
_same_job: contextvars.ContextVar[bool] = contextvars.ContextVar("fenced_outbox_same_job")


def is_same_job() -> bool:
    """Whether a publish now is the running job again (inside :func:`same_job`)."""
    return _same_job.get(False)


@contextlib.contextmanager
def same_job() -> Iterator[None]:
    """Inside it, a publish is the running job again (a retry), not a new copy."""
    marker = _same_job.set(True)
    try:
        yield
    finally:
        _same_job.reset(marker)


#: the lease database alias whose open transaction records plain tasks' publishes
_recording_plain: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "fenced_outbox_recording_plain"
)


@contextlib.contextmanager
def plain_sends_recorded(alias: str) -> Iterator[None]:
    """Inside it, while a transaction is open on the lease database ``alias``, a plain
    (unfenced) task's publish — Celery's ``app.send_task``, which every plain
    ``apply_async`` ends in — is recorded in that transaction and sent when it commits,
    like a fenced job's.

    For what an execution's outcome sends on (callbacks, chain steps, errbacks, a chord
    body), inside the transaction that proves its token current: a message cannot be
    taken back, and a proof whose transaction never commits (the process paused in it
    while the database restarted, then resumed) is no proof — the grant may be
    another's by then. Sent on commit; its row ends when a worker starts the job (its
    message carries :data:`celery_fenced.outbox.PLAIN_HEADER`), so the reclaimer sends
    it again if the process dies before the send or the broker loses the message — at
    least once.
    The app's ``send_task`` (:mod:`celery_fenced.sending`, given to every app) records.
    """
    if alias != store.database_alias() or not connections[alias].in_atomic_block:
        yield
        return
    marker = _recording_plain.set(alias)
    try:
        yield
    finally:
        _recording_plain.reset(marker)


def plain_recording() -> str | None:
    """The lease database alias whose open transaction records a plain publish now
    (inside :func:`plain_sends_recorded`, that transaction still open), or None."""
    alias = _recording_plain.get(None)
    return alias if alias is not None and connections[alias].in_atomic_block else None


def recording_plain_alias() -> str | None:
    """The alias set by the innermost :func:`plain_sends_recorded` that recorded, or None
    (whether its transaction is still open or not)."""
    return _recording_plain.get(None)


#: options of a call that is a step of a workflow (chain, callbacks, group, chord)
WORKFLOW_OPTIONS = ("chain", "link", "link_error", "chord", "group_id")


def in_workflow(options: Mapping[str, Any]) -> bool:
    """Whether a call carries a workflow: sent even when a copy holds its key."""
    return "chain" in options or any(options.get(name) for name in WORKFLOW_OPTIONS)
