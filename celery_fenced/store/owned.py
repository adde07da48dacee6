"""The connection a worker thread keeps open for its grants and one-statement successes.

Celery closes Django's connections around every task (``CONN_MAX_AGE = 0``, Django's
default), so each fenced task would open a new PostgreSQL connection for its grant: the
handshake and the catalog loading cost more than the statements themselves. A worker
thread keeps one connection of its own per lease database instead (setting
``fenced_keep_connection``, on by default), opened on first use, as Django opens its
own (same ``DATABASES`` entry, same ``connection_created`` signal), and closed:

- when it was idle for more than a minute (``IDLE_REPLACED_AFTER``: a firewall or NAT may
  have dropped it silently); when tasks are that sparse a connection per task costs
  nothing that matters;
- when the server ended it while idle (a restart, a failover, a terminated backend: its
  socket has something to read between tasks; a look that costs no round trip);
- when an error left it unusable (checked the next time, as Django checks its own);
- after ``CONN_MAX_AGE`` seconds, when that is a positive number;
- when the database is away (:mod:`celery_fenced.outages` closes it with Django's);
- at worker (process) shutdown, and when its thread has ended.

Its statements are prepared on the server (setting ``fenced_prepare``, on by default):
psycopg 3's server-side binding, each statement prepared the second time it runs, so the
grant and the success are parsed and planned once per connection, not once per task.
(On Django's own connections the store prepares its statements through a cursor of its
own: :mod:`.dialects.prepared`.)

Only outside any transaction of the caller's: the grant and the success are then
statements of their own on any connection.
"""

from __future__ import annotations

import os
import select
import threading
import time
import weakref
from typing import Any

from django.db import DatabaseError, connections
from django.db.backends.base.base import BaseDatabaseWrapper

from celery_fenced import conf

try:
    from django.db.backends.postgresql.psycopg_any import is_psycopg3 as _psycopg3
except ImportError:  # pragma: no cover - neither psycopg nor psycopg2 installed
    _psycopg3 = False

_local = threading.local()
_lock = threading.Lock()
#: every connection kept in this process: (pid, its thread, the connection). A forked
#: child keeps its parent's entries referenced and never closes them: closing (or
#: collecting) them would end the parent's sessions, whose sockets they share.
_kept: list[tuple[int, weakref.ref[threading.Thread], BaseDatabaseWrapper]] = []
#: when each kept connection was last handed out (monotonic seconds)
_used: weakref.WeakKeyDictionary[BaseDatabaseWrapper, float] = weakref.WeakKeyDictionary()
#: whether each kept connection was made to prepare its statements (``fenced_prepare``)
_prepares: weakref.WeakKeyDictionary[BaseDatabaseWrapper, bool] = weakref.WeakKeyDictionary()
#: a connection idle longer than this is replaced, not trusted: a firewall or NAT may
#: have dropped it without a word (no end of stream to see), and a statement sent on it
#: would hang for the kernel's retransmissions (about 15 minutes)
IDLE_REPLACED_AFTER = 60.0
#: with ``fenced_prepare``, a statement is prepared on the server the second time it
#: runs on a kept connection (psycopg's ``prepare_threshold``): the store's statements
#: are few and run on every task, a one-off is never prepared
PREPARE_THRESHOLD = 1


def connection_for(
    alias: str, request: Any, settings: conf.FencedSettings | None = None
) -> BaseDatabaseWrapper | None:
    """This thread's kept connection to ``alias`` for ``request``, or None: use Django's.

    ``settings``: the settings already loaded by the caller (default: loaded here).

    Only for a task delivered to a worker: never for an eager or a direct call (they run
    in the caller's thread, a web request's, which must not be left holding a
    connection). None too when ``fenced_keep_connection`` is off, the database is not
    PostgreSQL, its connections come from Django's pool (``OPTIONS["pool"]``: a kept one
    would hold a pool slot for good), or a transaction is open on Django's connection
    (what runs in it must stay in it).
    """
    if (
        request is None
        or getattr(request, "called_directly", True)
        or getattr(request, "is_eager", False)
    ):
        return None
    django_connection = connections[alias]
    if (
        django_connection.vendor != "postgresql"
        or django_connection.in_atomic_block
        or django_connection.settings_dict.get("OPTIONS", {}).get("pool")
    ):
        return None
    settings = settings or conf.load()
    if not settings.keep_connection:
        return None
    mine = _this_thread()
    wrapper = mine.get(alias)
    if wrapper is not None and _prepares.get(wrapper) != settings.prepare:
        _forget(wrapper)  # made for the other ``fenced_prepare``
        wrapper = None
    if wrapper is None:
        wrapper = _create(alias, prepare=settings.prepare)
        _prepares[wrapper] = settings.prepare
        mine[alias] = wrapper
        _remember(wrapper)
    elif wrapper.connection is not None and _spent(wrapper):
        _close(wrapper)
    _used[wrapper] = time.monotonic()
    return wrapper


def _create(alias: str, *, prepare: bool) -> BaseDatabaseWrapper:
    """A new connection to ``alias``, as Django makes its own; ``prepare``: with psycopg's
    server-side binding, preparing each statement the second time it runs (see
    :data:`PREPARE_THRESHOLD`), unless ``OPTIONS`` chooses for itself."""
    if not prepare or not _psycopg3:
        return connections.create_connection(alias)
    settings_dict = connections.settings[alias]
    options = {
        "server_side_binding": True,
        "prepare_threshold": PREPARE_THRESHOLD,
        **settings_dict.get("OPTIONS", {}),
    }
    wrapper_class = type(connections[alias])
    return wrapper_class({**settings_dict, "OPTIONS": options}, alias)


def close(alias: str) -> None:
    """Close this thread's kept connection to ``alias``, if any (it reopens on next use)."""
    wrapper = _this_thread().get(alias)
    if wrapper is not None:
        _close(wrapper)


def close_all() -> None:
    """Close every connection kept in this process (worker shutdown, test teardown)."""
    pid = os.getpid()
    with _lock:
        mine = [wrapper for owner, _thread, wrapper in _kept if owner == pid]
    for wrapper in mine:
        _close(wrapper)


def _this_thread() -> dict[str, BaseDatabaseWrapper]:
    """This thread's kept connections, by alias (a forked child starts with none)."""
    mine: dict[str, BaseDatabaseWrapper] | None = getattr(_local, "kept", None)
    if mine is None:
        mine = _local.kept = {}
    return mine


def _forget_after_fork() -> None:
    """A forked child opens its own connections: its parent's sessions are not its."""
    global _local
    _local = threading.local()


os.register_at_fork(after_in_child=_forget_after_fork)


def _remember(wrapper: BaseDatabaseWrapper) -> None:
    """Keep ``wrapper`` for :func:`close_all`; close the connections of ended threads."""
    pid = os.getpid()
    with _lock:
        ended = [entry for entry in _kept if entry[0] == pid and not _alive(entry[1])]
        for entry in ended:
            _kept.remove(entry)
        _kept.append((pid, weakref.ref(threading.current_thread()), wrapper))
    for _pid, _thread, old in ended:
        _close(old)


def _forget(wrapper: BaseDatabaseWrapper) -> None:
    """Close ``wrapper`` and no longer keep it."""
    with _lock:
        _kept[:] = [entry for entry in _kept if entry[2] is not wrapper]
    _close(wrapper)


def _alive(thread: weakref.ref[threading.Thread]) -> bool:
    found = thread()
    return found is not None and found.is_alive()


def _spent(wrapper: BaseDatabaseWrapper) -> bool:
    """Idle too long, ended by the server, broken, unusable after an error, or past a
    positive ``CONN_MAX_AGE``."""
    if time.monotonic() - _used.get(wrapper, 0.0) > IDLE_REPLACED_AFTER:
        return True
    raw = wrapper.connection
    if raw.closed or getattr(raw, "broken", False):
        # psycopg saw the session end outside Django's cursor (an exception that is no
        # database error, a time limit's, interrupted a statement): Django never marked
        # it, and its socket is gone
        return True
    if wrapper.errors_occurred or _has_input(raw.fileno()):
        # idle between statements, the server sends nothing unless it ends the session
        wrapper.errors_occurred = False
        if not wrapper.is_usable():
            return True
    max_age = wrapper.settings_dict.get("CONN_MAX_AGE")
    return bool(max_age) and wrapper.close_at is not None and time.monotonic() >= wrapper.close_at


def _has_input(fd: int) -> bool:
    """Whether the socket ``fd`` can be read now (data or end of stream), without waiting."""
    if hasattr(select, "poll"):
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(0))
    return bool(select.select([fd], [], [], 0)[0])  # pragma: no cover - Windows


def _close(wrapper: BaseDatabaseWrapper) -> None:
    """Close ``wrapper``'s connection, from any thread; a broken one is closed all the same."""
    wrapper.inc_thread_sharing()
    try:
        wrapper.close()
    except DatabaseError:
        wrapper.connection = None
    finally:
        wrapper.dec_thread_sharing()
