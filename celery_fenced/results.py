"""Result handles that do not wait for a job this thread's transaction still holds back.

The outbox sends a job published inside a transaction on the lease database when that
transaction commits (``transaction.on_commit``). A caller that waits for the job's result
in the same thread before then — ``task.delay(...).get(timeout=10)`` in a view, with
Django's ``ATOMIC_REQUESTS`` — would wait until its timeout for a message sent only
after it returns. So the outbox registers each such deferred sending here
(:func:`on_commit`), per thread, and the app's result classes (:func:`install`) raise
:class:`~celery_fenced.exceptions.UncommittedJob` at once instead of waiting when the
job, one of its parents (a chain) or one of a group's members is such a job:
still waiting for this thread's commit, or discarded with a rollback (never to be sent).

"This thread's" is decided by the connection: a sending waits for the commit of the
connection it was registered on (Django's connections are per thread), and a handle
used in another thread, or once the commit has sent the job, waits as Celery's does.
Whether a sending is still queued is read from the connection's commit callbacks, which
Django itself trims on a rollback (a savepoint's included).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from celery.result import AsyncResult, ResultSet
from django.db import connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper

from celery_fenced.exceptions import UncommittedJob

_R = TypeVar("_R")


class Deferred:
    """A job's sending that waits for the commit of ``connection``'s transaction: the
    callable given to ``transaction.on_commit``."""

    def __init__(
        self,
        task_id: str,
        task_name: str,
        alias: str,
        connection: BaseDatabaseWrapper,
        send: Callable[[], Any],
    ) -> None:
        self.task_id = task_id
        self.task_name = task_name
        self.alias = alias
        self.connection = connection
        self._send = send
        #: the commit came and the sending ran (whatever its outcome: a broker that
        #: refuses it leaves the job to the reclaimer, as for any publish)
        self.ran = False
        #: a later publish of the same task id in this thread: what decides since
        self.successor: Deferred | None = None

    def __call__(self) -> None:
        self.ran = True
        send, self._send = self._send, _sent  # what it holds is not kept with the handle
        send()

    def latest(self) -> Deferred:
        """The sending of this task id published last in this thread (this one, or one of
        a later publish of the same id: a rolled-back job sent again decides nothing)."""
        deferred = self
        while deferred.successor is not None:
            deferred = deferred.successor
        return deferred

    def queued(self) -> bool:
        """Whether the sending still waits in its connection's commit callbacks (Django
        drops those of a transaction, or savepoint, that rolls back)."""
        callbacks = getattr(self.connection, "run_on_commit", None)
        if callbacks is None:  # not how Django keeps them: queued while a transaction is
            return bool(self.connection.in_atomic_block)
        return any(entry[1] is self for entry in callbacks)


def _sent() -> None:
    """A sending's stand-in once it has run."""


class _Waiting(threading.local):
    def __init__(self) -> None:
        # weak: a sending is remembered while its connection queues it, or a handle the
        # publish returned holds it (:func:`hold`): a rolled-back job is known as such
        # for as long as its caller can still wait for it
        self.by_id: weakref.WeakValueDictionary[str, Deferred] = weakref.WeakValueDictionary()


_waiting = _Waiting()


def on_commit(alias: str, task_id: str, task_name: str, send: Callable[[], Any]) -> Deferred:
    """``transaction.on_commit(send, using=alias)``, remembered for this thread while it
    waits: a result handle of ``task_id`` then refuses to wait for it (outside a
    transaction Django calls ``send`` at once, and nothing is waited for)."""
    deferred = Deferred(task_id, task_name, alias, connections[alias], send)
    previous = _waiting.by_id.get(task_id)
    if previous is not None:  # the id published again (a fixed task_id, say): this decides
        previous.latest().successor = deferred
    _waiting.by_id[task_id] = deferred
    transaction.on_commit(deferred, using=alias)
    return deferred


def hold(result: _R, deferred: Deferred | None) -> _R:
    """``result``, the handle a publish returns, keeping ``deferred`` (its sending) known
    for as long as the handle lives — past a rollback, which drops the sending."""
    if deferred is not None and isinstance(result, UnsentAwareResult):
        result.fenced_sending = deferred
    return result


def refuse_unsent(result: Any) -> None:
    """Raise :class:`UncommittedJob` when waiting for ``result`` (an ``AsyncResult`` or a
    ``ResultSet``) means waiting for a job this thread's transaction has not sent: the
    job itself, a parent it follows (a chain, a chord's header) or a member."""
    held = getattr(result, "fenced_sending", None)
    if not _waiting.by_id and held is None:
        return
    for node in _graph(result):
        found = getattr(node, "fenced_sending", None) or _waiting.by_id.get(node.id)
        deferred = found.latest() if found is not None else None
        if deferred is None or deferred.ran:
            continue
        if connections[deferred.alias] is not deferred.connection:
            continue  # another thread's transaction: its commit may come while we wait
        raise UncommittedJob(
            deferred.task_id,
            deferred.alias,
            deferred.task_name,
            rolled_back=not deferred.queued(),
        )


def _graph(result: Any) -> Iterator[Any]:
    """The job handles waiting for ``result`` waits for: itself, its parents, and the
    members of every result set among them."""
    pending, seen = [result], set()
    while pending:
        node = pending.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, ResultSet):
            pending.extend(node.results or ())
        elif isinstance(node, AsyncResult):
            yield node
        pending.append(getattr(node, "parent", None))


class UnsentAwareResult(AsyncResult):  # type: ignore[type-arg]
    """The app's ``AsyncResult``, refusing to wait for a job this thread has not sent."""

    #: the sending of the job, when this handle was returned by its publish
    fenced_sending: Deferred | None = None

    def get(self, *args: Any, **kwargs: Any) -> Any:
        if not self.ignored:  # Celery returns at once: nothing to wait for
            refuse_unsent(self)
        return super().get(*args, **kwargs)

    # Celery's ``wait`` is its ``get`` function itself, not a call of ``self.get``
    wait = get

    def collect(self, *args: Any, **kwargs: Any) -> Any:
        refuse_unsent(self)
        return super().collect(*args, **kwargs)


class UnsentAwareResultSet(ResultSet):
    """The app's ``ResultSet`` (and ``GroupResult``), refusing to wait for a member this
    thread has not sent, before waiting for any (a native join never asks the members)."""

    def get(self, *args: Any, **kwargs: Any) -> Any:
        refuse_unsent(self)
        return super().get(*args, **kwargs)

    def join(self, *args: Any, **kwargs: Any) -> Any:
        refuse_unsent(self)
        return super().join(*args, **kwargs)

    def join_native(self, *args: Any, **kwargs: Any) -> Any:
        refuse_unsent(self)
        return super().join_native(*args, **kwargs)


_aware: weakref.WeakKeyDictionary[type, type] = weakref.WeakKeyDictionary()


def aware(cls: Callable[..., Any]) -> Callable[..., Any]:
    """``cls`` (a result class: an app's, a caller's ``result_cls``) refusing to wait for
    a job this thread has not sent: a subclass that keeps all it does, its pickling
    included (an app's result class pickles by the app attribute it comes from). A
    factory that is not a class (Celery's tasks pass their ``AsyncResult`` method, which
    makes the app's) is kept as it is."""
    if not isinstance(cls, type) or issubclass(cls, UnsentAwareResult | UnsentAwareResultSet):
        return cls
    made = _aware.get(cls)
    if made is None:
        mixin = UnsentAwareResultSet if issubclass(cls, ResultSet) else UnsentAwareResult
        made = type(cls.__name__, (mixin, cls), {"__module__": cls.__module__})
        _aware[cls] = made
    return made


#: the app's result classes :func:`install` makes aware
RESULT_CLASSES = ("AsyncResult", "ResultSet", "GroupResult")


def install(app: Any) -> None:
    """Give ``app`` result classes that refuse to wait for a job this thread has not
    sent (each made from the one the app has: what it does is kept)."""
    for name in RESULT_CLASSES:
        setattr(app, name, aware(getattr(app, name)))
