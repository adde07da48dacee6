"""What the package carries on a Celery request: one typed object, set and read by us only.

Celery hands a task's request (a ``celery.app.task.Context``) to the body, the tracer and
the result backend; the worker's main process hands the backend a context of its own
when it reports an end it did not run. What the package needs to carry with a request
travels on it as one :class:`RequestState`, kept in the request's ``__dict__`` under one
name and read back only when it is that type. A request we never set it on — one a test
builds, a ``MagicMock`` that answers every attribute, a message whose headers name it —
has none: :func:`state_of` gives the empty state, never something looked up on
whatever object arrived.

A state is never changed in place: :func:`carry` puts a new one on that request. Celery
copies a request's fields into the request it pushes for the body (``Task.__call__``),
so the body's request starts with the same state, and what either changes afterwards
stays its own, as for Celery's own fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from celery_fenced.atomic import BodyTransaction
    from celery_fenced.requests import EndedProcess
    from celery_fenced.store import HeldLease

#: the one name the state is kept under in a request's ``__dict__``
_NAME = "_fenced_state"


@dataclass(frozen=True)
class RequestState:
    """The package's state of one request."""

    #: the grant this execution holds: set by the worker at acquisition, never taken
    #: from the message
    lease: HeldLease | None = None
    #: the grant the result backend proved current in the transaction open now: what
    #: that transaction sends runs inside it (the errbacks in a savepoint of their own)
    proven: HeldLease | None = None
    #: the task id whose untokened write the backend checked in the transaction open
    #: now: the write itself goes through unchecked
    checked: str | None = None
    #: the ``link`` callbacks and chain a fenced success took off the request, for the
    #: backend to send once the token is proven: ``(callbacks, chain)``
    successors: tuple[Any, Any] | None = None
    #: the pool process whose end the worker's main process reports (see
    #: :mod:`celery_fenced.requests`)
    process: EndedProcess | None = None
    #: the transaction of an atomic body (``lease_atomic``), open from the body's start
    #: until the backend commits it with the result (or anything rolls it back)
    atomic: BodyTransaction | None = None


#: the state of a request we never set one on
NO_STATE = RequestState()


def state_of(request: object) -> RequestState:
    """The state carried on ``request``, or :data:`NO_STATE` (None included)."""
    try:
        found = vars(request).get(_NAME)
    except TypeError:  # no __dict__ (None, a slotted object): nothing of ours on it
        return NO_STATE
    return found if isinstance(found, RequestState) else NO_STATE


def carry(request: object, state: RequestState) -> None:
    """Put ``state`` on ``request`` (in its ``__dict__``), in place of what it carried."""
    vars(request)[_NAME] = state


def add_meta(request: object, fields: Mapping[str, Any]) -> None:
    """Add ``fields`` to ``request``'s ``meta``: what django-celery-results stores in the
    result row's ``meta`` (a field Celery's ``Context`` does not declare)."""
    vars(request)["meta"] = {**(getattr(request, "meta", None) or {}), **fields}


def stamp_grant(request: object, token: int | None, key: str | None) -> None:
    """Set ``request``'s public ``fencing_token`` and ``lease_key`` (None, None: no grant).

    Only acquisition sets them: a token or key a message carries is never trusted."""
    vars(request).update(fencing_token=token, lease_key=key)
