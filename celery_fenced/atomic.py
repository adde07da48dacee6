"""Atomic task bodies (``lease_atomic``): every write of the body fenced, by configuration.

The body runs inside one transaction on the lease database, opened after the grant has
committed. Its writes, the token's proof (the lease row locked, the token still the
key's), the result row, the release and the outbox rows of what it published commit
together, or nothing does:

- The body returns: with the fenced result backend, the transaction stays open past the
  return; the backend proves the token, writes the result and releases *on that same
  connection, inside it*, then commits it (:meth:`BodyTransaction.commit`). Refused (the
  token is no longer current), everything rolls back and the refusal is recorded after
  the rollback. Without the fenced backend (or called directly) the token is proven
  here and the body's writes commit; the result is written apart.
- The body raises (a ``Retry`` too): its writes roll back at once; the failure or the
  retry is recorded under the proof as without ``lease_atomic``. A raised retry is sent
  at once under its own proof (see ``Outcomes.retry``).
- What the body publishes is an outbox row in its transaction: a fenced task's
  ``apply_async`` is recorded anyway; a plain task's is recorded too while the body runs
  (:func:`celery_fenced.outbox.plain_sends_recorded`). Nothing is sent before the commit.
- A paused execution must not stall the current one: the transaction is bounded on the
  server, which ends a session idle in it longer than the lease's ttl
  (PostgreSQL's ``idle_in_transaction_session_timeout``, MariaDB's
  ``idle_transaction_timeout``), releasing its row locks. SQLite cannot bound it.
- A write to another database alias while the body runs is not covered: it is named in a
  warning, once per task and alias.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeGuard

from celery.exceptions import Ignore
from django.db import DatabaseError, InterfaceError, OperationalError, connections, transaction

from celery_fenced import context, outbox, store
from celery_fenced.exceptions import LeaseLost
from celery_fenced.request_state import carry, state_of
from celery_fenced.results import Deferred

if TYPE_CHECKING:
    from celery_fenced.store import HeldLease

logger = logging.getLogger(__name__)

#: the statements that change a database (a statement's first word, upper case)
WRITES = frozenset({"INSERT", "UPDATE", "DELETE", "REPLACE", "MERGE", "CREATE", "DROP", "ALTER"})

_local = threading.local()
#: (task name, alias) pairs already warned about a write outside the body's transaction
_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


class RetryAfterBody(BaseException):
    """``self.retry()`` raised inside an atomic body: the retry is sent once the body's
    transaction has rolled back, outside it (a ``BaseException``: a body's ``except
    Exception`` does not swallow it)."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.retry_args = args
        self.retry_kwargs = kwargs


class BodyNotBegun(Exception):
    """The database failed as an atomic body's transaction was opened (a restart, a lost
    link): nothing of the body ran, so the job is sent again, as after a database error
    before the grant. ``error`` is the database's error."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


class BodyTransaction:
    """The open transaction of one atomic body on its lease's database (this thread's)."""

    def __init__(self, lease: HeldLease) -> None:
        self.lease = lease
        self.alias = lease.alias
        self.open = False
        #: whether it committed (set by its first commit hook, then by :meth:`commit`)
        self.committed = False
        self._atomic = transaction.atomic(using=lease.alias)
        self._restore: Callable[[], None] | None = None

    def begin(self) -> None:
        """Open the transaction, bounded to about the lease's ttl of idleness."""
        self._atomic.__enter__()
        self.open = True
        self.committed = False
        # the first of its commit hooks: tells a hook that raised after the commit from a
        # commit that failed
        transaction.on_commit(self._mark_committed, using=self.alias, robust=True)
        _open_bodies().append(self)
        try:
            self._restore = _bound(self.alias, self.lease.ttl)
        except BaseException:
            self.rollback()
            raise

    def commit(self) -> None:
        """Commit it (Django rolls back and raises when the commit fails)."""
        if not self.open:
            return
        if connections[self.alias].needs_rollback:
            self.rollback()
            raise DatabaseError(
                f"the atomic body of {self.lease.key!r} (token {self.lease.token}) was not "
                "committed: a database error inside its transaction was swallowed"
            )
        hooks = [entry[1] for entry in getattr(connections[self.alias], "run_on_commit", [])]
        try:
            self._end(None)
        except Exception:
            if not self.committed:
                raise
            # a hook of the body's raised after the commit: Django runs none after it, so
            # the outbox's sendings of what the body published are run here
            for hook in hooks:
                if isinstance(hook, Deferred) and not hook.ran:
                    _quietly(hook)
            raise
        self.committed = True

    def _mark_committed(self) -> None:
        self.committed = True

    def rollback(self) -> None:
        """Roll it back (nothing of it commits); a connection the server ended is closed.

        The database away does not make it raise: leaving the transaction on a session
        the server ended, Django drops the connection and opens a new one to restore
        autocommit, which a restarting database refuses; the server ended the
        transaction with the session all the same.
        """
        if not self.open:
            return
        transaction.set_rollback(True, using=self.alias)
        try:
            self._end(None)
        except (OperationalError, InterfaceError):
            logger.info(
                "the atomic body of %r (token %s) ended with its session",
                self.lease.key,
                self.lease.token,
                exc_info=True,
            )
            with contextlib.suppress(DatabaseError, InterfaceError):
                connections[self.alias].close()

    def _end(self, _: None) -> None:
        self.open = False
        bodies = _open_bodies()
        if self in bodies:
            bodies.remove(self)
        try:
            self._atomic.__exit__(None, None, None)
        finally:
            restore, self._restore = self._restore, None
            if restore is not None:
                _quietly(restore)


def _open_bodies() -> list[BodyTransaction]:
    bodies: list[BodyTransaction] | None = getattr(_local, "bodies", None)
    if bodies is None:
        bodies = _local.bodies = []
    return bodies


def body_of(request: object, lease: HeldLease) -> BodyTransaction | None:
    """The open body transaction of ``request`` under ``lease`` on this thread, or None."""
    body = state_of(request).atomic
    if body is None or not body.open or body.lease is not lease or body not in _open_bodies():
        return None
    return body


def close_leaked() -> None:
    """Roll back every body transaction still open on this thread (after the task ended:
    a backend that raised before it committed, a tracer that never settled)."""
    for body in list(_open_bodies()):
        logger.warning(
            "the atomic body of lease %r (token %s) was still open after its task ended; "
            "rolled back",
            body.lease.key,
            body.lease.token,
            extra={"lease_key": body.lease.key, "fencing_token": body.lease.token},
        )
        _quietly(body.rollback)


def run_body(
    task_name: str,
    request: Any,
    lease: HeldLease,
    call: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    settled_by_backend: bool,
    retry: Callable[..., Any],
) -> Any:
    """Run ``call(*args, **kwargs)`` inside a transaction on the lease's database.

    ``settled_by_backend``: the fenced result backend commits it with the result and the
    release (the transaction stays open past the return); otherwise the token is proven
    and the transaction committed here. ``retry``: the task's ``retry``, for a retry the
    body raised (sent after the rollback).
    """
    close_leaked()  # never run a body inside another's forgotten transaction
    body = BodyTransaction(lease)
    try:
        body.begin()
    except (OperationalError, InterfaceError) as exc:
        raise BodyNotBegun(exc) from exc
    carry(request, replace(state_of(request), atomic=body))
    try:
        with ExitStack() as stack:
            stack.enter_context(outbox.plain_sends_recorded(lease.alias))
            stack.enter_context(context.in_atomic_body(lease))
            stack.enter_context(_other_writes_named(task_name, lease.alias))
            retval = call(*args, **kwargs)
        if connections[lease.alias].needs_rollback:
            raise DatabaseError(
                f"task {task_name}: a database error inside its atomic body was swallowed; "
                "its writes are rolled back"
            )
    except RetryAfterBody as later:
        body.rollback()
        raise retry(*later.retry_args, **later.retry_kwargs) from None
    except Ignore:
        if lease.released and body.open:
            # ``replace()``: the replacement's outbox row and the release as REPLACED (the
            # proof) were written in the body's transaction: they commit with its writes
            body.commit()
        else:
            body.rollback()
        raise
    except BaseException as exc:
        body.rollback()
        if isinstance(exc, DatabaseError) and _session_ended(exc, lease):
            raise LeaseLost(
                lease.key,
                lease.token,
                "the server ended the atomic body's transaction: it was idle longer than "
                "the lease's ttl",
            ) from exc
        raise
    if settled_by_backend:
        return retval
    try:
        ok, current = store.prove_current(lease)
    except BaseException:
        body.rollback()
        raise
    if not ok:
        body.rollback()
        lease.mark_lost(f"atomic body refused: current token is {current}", warn=False)
        raise store.reject_stale(
            lease.alias,
            lease.key,
            lease.token,
            current if current != lease.token else None,
            task_id=lease.task_id,
            owner=lease.owner,
            what="atomic body",
            task_name=lease.task_name,
        )
    body.commit()
    return retval


#: what the server says when it ends a session idle in its transaction past the bound:
#: PostgreSQL's SQLSTATE (``idle_in_transaction_session_timeout``), MariaDB's error number
#: (``idle_transaction_timeout``)
_IDLE_ENDED_SQLSTATE = "25P03"
_IDLE_ENDED_ERRNO = 4031


def ended_by_the_bound(exc: BaseException) -> bool:
    """Whether ``exc`` says the server ended the session idle in a body's transaction
    past its bound (PostgreSQL's SQLSTATE, MariaDB's error number, in its chain)."""
    seen: BaseException | None = exc
    while seen is not None:
        if getattr(seen, "sqlstate", None) == _IDLE_ENDED_SQLSTATE:
            return True
        args = getattr(seen, "args", ())
        if type(seen).__module__.startswith("MySQLdb") and args and args[0] == _IDLE_ENDED_ERRNO:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def lost_with_its_session(exc: BaseException) -> TypeGuard[Exception]:
    """Whether ``exc`` took a body's transaction with its session: the database away (a
    restart, a lost link, a deadlock), or the server ending the session idle in it past
    its bound (a worker paused in the body, or between its return and the settle)."""
    return isinstance(exc, (OperationalError, InterfaceError)) or ended_by_the_bound(exc)


def _session_ended(exc: BaseException, lease: HeldLease) -> bool:
    """Whether ``exc`` says the body's session was ended under it: by the bound (idle
    past the ttl: a paused worker), or lost while the grant lapsed with no successor."""
    if not lost_with_its_session(exc):
        return False
    if ended_by_the_bound(exc):
        return True
    try:  # the connection went away: a pause the bound has not named, say
        return store.expired_unclaimed(lease)
    except Exception:
        return False


def _bound(alias: str, ttl: float) -> Callable[[], None] | None:
    """Have the server end this session when it idles in its transaction about ``ttl``
    seconds (a paused holder's locks are not held much past its lease); a function that
    undoes what stays on the session, or None."""
    connection = connections[alias]
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:  # local to the transaction: nothing stays
            cursor.execute(
                "SELECT set_config('idle_in_transaction_session_timeout', %s, true)",
                [str(max(1000, math.ceil(ttl * 1000)))],
            )
        return None
    if connection.vendor == "mysql" and getattr(connection, "mysql_is_mariadb", False):
        with connection.cursor() as cursor:
            cursor.execute("SELECT @@SESSION.idle_transaction_timeout")
            (before,) = cursor.fetchone()
            cursor.execute("SET SESSION idle_transaction_timeout = %s", [max(1, math.ceil(ttl))])

        def restore() -> None:
            if connection.connection is not None and connection.is_usable():
                with connection.cursor() as cursor:
                    cursor.execute("SET SESSION idle_transaction_timeout = %s", [int(before)])

        return restore
    return None  # SQLite (and MySQL): nothing on the server can bound it


@contextmanager
def _other_writes_named(task_name: str, lease_alias: str) -> Iterator[None]:
    """Warn, once per task and alias, of a write the body makes to another database alias:
    it commits on its own, whatever becomes of the body's transaction."""
    with ExitStack() as stack:
        for alias in connections:
            if alias == lease_alias:
                continue
            stack.enter_context(
                connections[alias].execute_wrapper(_write_watcher(task_name, alias))
            )
        yield


def _write_watcher(task_name: str, alias: str) -> Callable[..., Any]:
    def watch(execute: Callable[..., Any], sql: Any, params: Any, many: bool, context: Any) -> Any:
        if _is_write(sql):
            _warn_once(task_name, alias)
        return execute(sql, params, many, context)

    return watch


def _is_write(sql: Any) -> bool:
    words = str(sql).lstrip(" (\n\t").split(None, 1)
    return bool(words) and words[0].upper() in WRITES


def _warn_once(task_name: str, alias: str) -> None:
    with _warned_lock:
        if (task_name, alias) in _warned:
            return
        _warned.add((task_name, alias))
    logger.warning(
        "task %s has an atomic body but wrote to the database %r: that write is not "
        "fenced and commits on its own; fence it with fenced_update() or guard(), or "
        "use the fencing token as its idempotency key",
        task_name,
        alias,
        extra={"task_name": task_name, "alias": alias},
    )


def _quietly(step: Callable[[], None]) -> None:
    try:
        step()
    except Exception:
        logger.info("closing an atomic body's transaction failed", exc_info=True)


__all__ = [
    "BodyNotBegun",
    "BodyTransaction",
    "body_of",
    "close_leaked",
    "ended_by_the_bound",
    "lost_with_its_session",
    "run_body",
]
