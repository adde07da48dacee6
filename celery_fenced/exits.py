"""Waiting for a pool process to exit before its execution's end is reported.

The worker's main process reports the end of an execution it did not run with the
result backend, and for a hard time limit it does so *before* the pool process is killed:
billiard's ``TimeoutHandler.on_hard_timeout`` stores the job's ``TimeLimitExceeded``, runs
the timeout callback (Celery's ``Request.on_timeout``: the backend's ``mark_as_failure``)
and only then sends SIGTERM and, 0.1 s later, SIGKILL; a ``revoke(terminate=True)``
reports right after it sends the signal. Ending the grant in that report would leave the
process running the body without a grant (the next grant of the key could come while it
runs), and a database that is away would hold the kill back while the report waits for it.

So when the process the report names is still a live child of this one, the report is
made by a thread of its own once the process has exited — or once its grant ended
otherwise (the execution released it with its own result, or another execution took it
over), whichever comes first. At the worker's warm shutdown its main process waits for
those reports (:func:`wait_for_reports`): a daemon thread would otherwise die with the
process, and the outcome with it (its message already acknowledged, the grant left to
run out its ttl).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from django.db import connections

logger = logging.getLogger(__name__)

#: how often the waiting thread looks at the process, and at the grant (seconds)
PROCESS_POLL = 0.02
GRANT_POLL = 1.0
#: how long a warm shutdown waits for the reports still to be made (seconds): the pool
#: processes have exited by then; this bounds a report held by the database (its
#: outages are ridden out for about 15 s, see :mod:`celery_fenced.outages`)
SHUTDOWN_WAIT = 60.0

_waiting: set[threading.Thread] = set()
_waiting_lock = threading.Lock()


def live_child(owner_prefix: str | None) -> int | None:
    """The pid that ``owner_prefix`` (``host:boot:pid:``) names, if it is a child process of
    this one that has not exited (a zombie has); None otherwise, or where ``/proc`` does
    not tell (the report is then made at once)."""
    if not owner_prefix:
        return None
    try:
        pid = int(owner_prefix.rstrip(":").rsplit(":", 1)[1])
    except (IndexError, ValueError):
        return None
    return pid if _running_child(pid) else None


def _running_child(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # "pid (comm) state ppid …": the command name may hold spaces and parentheses
    fields = stat[stat.rindex(")") + 2 :].split()
    return len(fields) > 1 and fields[0] not in ("Z", "X", "x") and int(fields[1]) == os.getpid()


def after_exit(pid: int, held: Callable[[], bool], report: Callable[[], None]) -> None:
    """Call ``report()`` in a daemon thread once process ``pid`` has exited, or as soon as
    ``held()`` (asked every :data:`GRANT_POLL` seconds) is False."""
    thread = threading.Thread(
        target=_report_after_exit,
        args=(pid, held, report),
        name=f"celery-fenced-after-exit-{pid}",
        daemon=True,
    )
    with _waiting_lock:
        _waiting.add(thread)
    thread.start()


def wait_for_reports(timeout: float = SHUTDOWN_WAIT) -> None:
    """Wait (up to ``timeout`` seconds in all) for the reports still to be made: called at
    the worker's warm shutdown, once its pool processes have been stopped."""
    with _waiting_lock:
        threads = [thread for thread in _waiting if thread.is_alive()]
    if not threads:
        return
    logger.info("waiting for the reports of %d ended pool process(es)", len(threads))
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(deadline - time.monotonic(), 0.0))
    left = [thread.name for thread in threads if thread.is_alive()]
    if left:
        logger.warning("shutting down with reports not made: %s", ", ".join(left))


def _still(held: Callable[[], bool]) -> bool:
    try:
        return held()
    except Exception:  # the database is away: the process is what is waited for
        logger.info("could not read the grant while waiting for a pool process", exc_info=True)
        return True


def _report_after_exit(pid: int, held: Callable[[], bool], report: Callable[[], None]) -> None:
    try:
        asked = time.monotonic()
        while _running_child(pid):
            time.sleep(PROCESS_POLL)
            if time.monotonic() - asked >= GRANT_POLL:
                asked = time.monotonic()
                if not _still(held):
                    break
        report()
    except Exception:
        logger.exception("the report of pool process %s's end failed", pid)
    finally:
        connections.close_all()  # this thread's own
        with _waiting_lock:
            _waiting.discard(threading.current_thread())
