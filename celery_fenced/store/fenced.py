"""Fencing: transactions that prove a token current, and the record of a refused write."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from django.db import InterfaceError, OperationalError, connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper

from celery_fenced import signals
from celery_fenced.context import atomic_body_lease, open_guards
from celery_fenced.exceptions import StaleToken
from celery_fenced.models import Lease, LeaseEvent
from celery_fenced.store import dialects
from celery_fenced.store.dialects.tables import result_row_known
from celery_fenced.store.validation import database_alias

if TYPE_CHECKING:
    from celery_fenced.store.held import HeldLease

logger = logging.getLogger("celery_fenced.store")


def reject_stale(
    alias: str,
    key: str,
    token: int,
    current: int | None,
    *,
    task_id: str = "",
    owner: str = "",
    what: str = "write",
    task_name: str = "",
    logged: bool = False,
) -> StaleToken:
    """Record (on database ``alias``), signal and log a refused write; return the
    :class:`StaleToken` to raise.

    Logged as a warning naming key, stale token and current token; at INFO when
    ``logged``: the refused write carries a rejection already logged (the FAILURE of an
    execution fenced out by that rejection)."""
    logger.log(
        logging.INFO if logged else logging.WARNING,
        "stale %s rejected for %r: token %s, current token %s",
        what,
        key,
        token,
        current,
        extra={"lease_key": key, "fencing_token": token, "current_token": current},
    )
    try:
        with transaction.atomic(using=alias):
            dialects.for_alias(alias).record_event(
                key,
                LeaseEvent.Kind.STALE_WRITE_REJECTED,
                token,
                task_id,
                owner,
                {"current_token": current, "what": what},
            )
    except Exception:
        logger.info("could not record the stale_write_rejected event", exc_info=True)
    signals.send(
        signals.stale_write_rejected,
        Lease,
        key=key,
        token=token,
        owner=owner,
        task_id=task_id,
        task_name=task_name,
        current=current,
        what=what,
    )
    return StaleToken(key, token, current)


class Refused(Exception):
    """Inside the package: a proof failed; ``current`` is the key's token (or None)."""

    def __init__(self, current: int | None) -> None:
        self.current = current


@contextmanager
def fenced_transaction(
    key: str,
    token: int,
    *,
    using: str | None = None,
    lease: HeldLease | None = None,
    what: str = "write",
) -> Iterator[None]:
    """Open a transaction on the lease database that proves ``token`` current first.

    The refusal is recorded after the transaction has rolled back, so the event stands
    (unless an outer transaction of the caller's rolls back too).
    """
    alias = database_alias(using)
    in_body = _in_atomic_body_of(alias, key, token)
    raised: list[BaseException] = []  # what the guarded block raised
    try:
        with transaction.atomic(using=alias):
            if in_body:
                ok, current = _read_current(alias, key, token)
            else:
                ok, current = dialects.for_alias(alias).prove_current(key, token)
            if not ok:
                raise Refused(current)
            marker = open_guards.set((*open_guards.get(), (alias, key, token)))
            try:
                yield
            except BaseException as exc:
                raised.append(exc)
                raise
            finally:
                open_guards.reset(marker)
    except (OperationalError, InterfaceError) as exc:
        if raised and exc is not raised[0]:
            # leaving the transaction after the block raised, on a session the server
            # ended: Django dropped the connection and reconnected to restore autocommit,
            # which a restarting database refused. Nothing of the block committed (the
            # server ended its transaction): the block's own exception stands.
            raise raised[0]  # noqa: B904 - its context shows the refused reconnect
        raise
    except Refused as refused:
        current = refused.current
        if lease is not None:
            lease.mark_lost(f"write refused: current token is {current}", warn=False)
        raise reject_stale(
            alias,
            key,
            token,
            current if current != token else None,
            task_id=lease.task_id if lease else "",
            owner=lease.owner if lease else "",
            what=what,
            task_name=lease.task_name if lease else "",
        ) from None


def _in_atomic_body_of(alias: str, key: str, token: int) -> bool:
    """Whether this runs inside the open transaction of the atomic body of ``key``'s grant
    ``token`` on ``alias`` (see :mod:`celery_fenced.atomic`)."""
    body = atomic_body_lease.get()
    return (
        body is not None
        and (body.alias, body.key, body.token) == (alias, key, token)
        and connections[alias].in_atomic_block
    )


def _read_current(alias: str, key: str, token: int) -> tuple[bool, int | None]:
    """The proof of a guard() or fenced_update inside that grant's atomic body: a plain
    read, which locks nothing.

    A locking proof there (the lease row's ``FOR UPDATE``, SQLite's write lock) would be
    held until the body's transaction ends, and the renewer's ``UPDATE`` of that row, on
    its own connection, would wait for it, time out and lose a lease that is current. No
    lock is needed: none of the body's writes commits but with the body's transaction,
    whose commit is preceded, in that transaction, by the locking proof of the settle
    (the release's conditional ``UPDATE``). This read only fails the body early once
    its token is gone. It reads the token and the release, not the expiry: a snapshot
    (REPEATABLE READ) may hold an expiry that renewals have moved since, and a grant
    expired with no successor is still accepted by the settle's proof.
    """
    row = Lease._default_manager.using(alias).filter(key=key).values_list("token", "released_at")
    found = row.first()
    if found is None:
        return False, None
    current, released_at = found
    return current == token and released_at is None, current


def in_guard(key: str, token: int) -> bool:
    """True inside a guard() of ``key``/``token`` (its transaction holds the lock)."""
    return any(k == key and t == token for _, k, t in open_guards.get())


def in_guard_of_token(token: int) -> bool:
    """True inside a guard() holding ``token``, whatever its key."""
    return any(t == token for _, _, t in open_guards.get())


@contextmanager
def time_limited(alias: str, seconds: float | None) -> Iterator[None]:
    """Statements on ``alias`` in this block fail after about ``seconds`` (None: no limit)
    instead of waiting on a lock held by another connection.

    For the renewer's thread. PostgreSQL: a transaction of its own with a local
    ``statement_timeout`` (nothing stays on the session, so a transaction pooler is safe;
    inside a transaction already open there is no limit). SQLite: the busy timeout of this
    thread's connection (how long a statement waits for another connection's write lock),
    the longest fixed step within ``seconds``; it stays on that connection, which only
    the renewer's thread uses. MariaDB and MySQL: that connection's
    ``innodb_lock_wait_timeout``, in whole seconds (at least 1). Other databases: no limit.
    """
    connection = connections[alias]
    if seconds is None or connection.vendor not in ("postgresql", "sqlite", "mysql"):
        yield
        return
    if connection.vendor == "mysql":
        with connection.cursor() as cursor:
            cursor.execute(
                "SET SESSION innodb_lock_wait_timeout = %s", [max(1, math.ceil(seconds))]
            )
        yield
        return
    milliseconds = max(1, int(seconds * 1000))
    if connection.vendor == "sqlite":
        # a PRAGMA takes no parameters: fixed texts, never a spliced value
        busy = (
            "PRAGMA busy_timeout = 10000"
            if milliseconds >= 10000
            else "PRAGMA busy_timeout = 5000"
            if milliseconds >= 5000
            else "PRAGMA busy_timeout = 2000"
            if milliseconds >= 2000
            else "PRAGMA busy_timeout = 1000"
            if milliseconds >= 1000
            else "PRAGMA busy_timeout = 500"
            if milliseconds >= 500
            else "PRAGMA busy_timeout = 200"
            if milliseconds >= 200
            else "PRAGMA busy_timeout = 100"
        )
        with connection.cursor() as cursor:
            cursor.execute(busy)
        yield
        return
    if connection.in_atomic_block:
        yield
        return
    with transaction.atomic(using=alias):
        with connection.cursor() as cursor:
            cursor.execute("SELECT set_config('statement_timeout', %s, true)", [str(milliseconds)])
        yield


def prove_for_result(
    lease: HeldLease, task_id: str, status: str, *, releasing: bool
) -> tuple[bool, int | None]:
    """Prove ``lease``'s token current for ``task_id``'s result write of ``status``.

    Inside the caller's transaction on ``lease.alias``. ``releasing``: the same statement
    ends the grant (a final state or RETRY) and marks its job completed, and a write that
    fails after it rolls the release back too. Either way the task id's result lock is
    held until the transaction ends. Returns ``(ok, the key's current token)``.
    """
    dialect = dialects.for_alias(lease.alias)
    if releasing:
        ok, current = dialect.release_current(lease.ending(status))
    else:
        ok, current = dialect.prove_current(lease.key, lease.token)
    if ok and (not releasing or task_id != lease.task_id):
        dialect.lock_for_result(task_id)  # release_current took lease.task_id's
    return ok, current


def prove_current(lease: HeldLease) -> tuple[bool, int | None]:
    """Lock ``lease``'s row inside the caller's transaction and tell whether its token is
    the key's current, unexpired grant: ``(ok, the key's current token)``."""
    return dialects.for_alias(lease.alias).prove_current(lease.key, lease.token)


def released_as(lease: HeldLease, status: str) -> bool:
    """Whether ``lease``'s grant was released in ``status`` by its holder's outcome (a
    commit whose answer was lost with the connection): its row still carries its token."""
    return (
        Lease._default_manager.using(lease.alias)
        .filter(
            key=lease.key,
            token=lease.token,
            released_at__isnull=False,
            release_state=status[:16],
        )
        .exists()
    )


def writes_result_in_release(alias: str) -> bool:
    """Whether a success's result row can be written by the statement that releases."""
    return result_row_known() and dialects.releasing_with_result(alias) is not None


def release_with_result(
    lease: HeldLease,
    status: str,
    row: Sequence[Any],
    *,
    connection: BaseDatabaseWrapper | None = None,
) -> tuple[bool, int | None]:
    """Prove ``lease`` current, release it in ``status`` and write its task's result row.

    One statement (see :func:`writes_result_in_release`); ``row`` holds the values of
    :data:`~celery_fenced.store.types.RESULT_COLUMNS`. Returns ``(ok, the key's
    current token)``; refused, nothing is written. ``connection``: the connection to send
    it on (default: Django's for the lease's alias).
    """
    dialect = dialects.releasing_with_result(lease.alias, connection=connection)
    if dialect is None:
        raise NotImplementedError(f"the database {lease.alias!r} writes the result apart")
    return dialect.release_with_result(lease.ending(status), row)


def lock_for_result(alias: str, task_id: str) -> None:
    """Serialize the result writes of ``task_id`` on ``alias`` until the transaction ends."""
    dialects.for_alias(alias).lock_for_result(task_id)
