"""Renewal: one thread per process renews every lease the process holds, in batches.

It runs in the process that runs the task body (the prefork child, the threads-pool or
solo worker), never in the prefork main process: a paused child must lose its lease.
It uses its own database connection (Django connections are per thread).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import defaultdict
from typing import Any

from django.db import connections

from celery_fenced import metrics, store
from celery_fenced.store import HeldLease

logger = logging.getLogger(__name__)

#: a lease is renewed with its batch once this share of its renew interval has passed
BATCH_SHARE = 0.6
#: the renewer's statements fail after this share of the shortest ttl of their batch
STATEMENT_SHARE = 0.25
RENEWED, ROW_LOCKED, FAILED = "renewed", "row locked", "failed"
#: PostgreSQL's SQLSTATE of a statement cancelled by statement_timeout / lock_timeout
QUERY_CANCELED, LOCK_NOT_AVAILABLE = "57014", "55P03"
#: MariaDB and MySQL's error number of a lock wait timeout (innodb_lock_wait_timeout)
LOCK_WAIT_TIMEOUT = 1205


class Renewer:
    def __init__(self) -> None:
        self._leases: dict[int, HeldLease] = {}
        # found lost, not yet unregistered by their execution: still this process's
        self._lost: dict[int, HeldLease] = {}
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        # the monotonic time the thread sleeps until, waiting on a lease's renewal; None
        # while it runs, or waits for a lease to come
        self._wake_at: float | None = None
        # whether the thread may hold a database connection (it renewed since it closed
        # its connections last)
        self._connected = False

    def register(self, lease: HeldLease) -> None:
        with self._cond:
            self._leases[id(lease)] = lease
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="celery-fenced-renewer", daemon=True
                )
                self._thread.start()
            # woken only when this lease is due before the thread's wake-up: each wake
            # costs the task's thread a switch to the renewer's, on every task
            if self._wake_at is None or lease.confirmed_at + lease.renew_interval < self._wake_at:
                self._cond.notify()

    def unregister(self, lease: HeldLease) -> None:
        with self._cond:
            self._leases.pop(id(lease), None)
            self._lost.pop(id(lease), None)
            if not self._leases and self._connected:
                self._cond.notify_all()  # nothing to renew: its connection closes now

    def held(self) -> list[HeldLease]:
        with self._cond:
            return list(self._leases.values())

    def holding(self, token: int) -> list[HeldLease]:
        """The registered leases under ``token``, those found lost included.

        A lease stays registered until its execution ends: this is how code running in
        another thread of that execution (where :func:`~celery_fenced.current_lease` is
        None) finds the lease its token belongs to.
        """
        with self._cond:
            leases = [*self._leases.values(), *self._lost.values()]
        return [lease for lease in leases if lease.token == token]

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._leases:
                    connections.close_all()
                    self._connected = False
                    # stop only after 30 s without a lease: short tasks come and go
                    # between two wake-ups, and a thread per task would cost each of them
                    if not self._cond.wait(timeout=30) and not self._leases:
                        self._thread = None
                        return
                    continue
                now = time.monotonic()
                leases = list(self._leases.values())
                next_due = min(x.confirmed_at + x.renew_interval for x in leases)
                if next_due > now:
                    self._wake_at = next_due
                    try:
                        self._cond.wait(timeout=next_due - now)
                    finally:
                        self._wake_at = None
                    continue
                self._connected = True
                due = [x for x in leases if now >= x.confirmed_at + x.renew_interval * BATCH_SHARE]
            try:
                self.renew(due, time_limit=True)
            except Exception:  # nothing may stop the thread: every other lease needs it
                logger.exception("lease renewal failed; will retry")
            with self._cond:
                for lease in due:
                    if not lease.marked_lost and not lease.released:
                        continue  # a lease past its deadline is marked lost next round
                    if self._leases.pop(id(lease), None) is not None and not lease.released:
                        self._lost[id(lease)] = lease  # until its execution unregisters it

    def renew(self, leases: list[HeldLease], *, time_limit: bool = False) -> None:
        """Renew ``leases`` with one statement per database; mark the refused ones lost.

        A lease whose local deadline passed without a confirmed renewal is marked lost
        instead. With ``time_limit`` (the renewer's own thread) the statements fail after
        :data:`STATEMENT_SHARE` of the shortest ttl instead of waiting on a lock (see
        :func:`celery_fenced.store.time_limited`); when a batch times out on a locked row,
        each lease is renewed on its own, so one locked row does not hold up the others.
        """
        by_alias: dict[str, list[HeldLease]] = defaultdict(list)
        for lease in leases:
            if not lease.released:
                by_alias[lease.alias].append(lease)
        for alias, leases_here in by_alias.items():
            seconds = STATEMENT_SHARE * min(x.ttl for x in leases_here) if time_limit else None
            group = []
            for lease in leases_here:
                if lease.lost:  # past its deadline, or found lost already (then a no-op)
                    lease.mark_lost(lease.unrenewed_reason(), time_limit=seconds)
                else:
                    group.append(lease)
            if not group:
                continue
            outcome = self._renew_batch(alias, group, seconds)
            if outcome == ROW_LOCKED and len(group) > 1:
                outcomes = [self._renew_batch(alias, [lease], seconds) for lease in group]
                outcome = RENEWED if RENEWED in outcomes else FAILED
            for lease in group:
                if not lease.released and time.monotonic() >= lease.local_deadline:
                    lease.mark_lost(lease.unrenewed_reason(), time_limit=seconds)
            if outcome != RENEWED:
                time.sleep(min(1.0, min(x.renew_interval for x in group) / 4))

    @staticmethod
    def _renew_batch(alias: str, group: list[HeldLease], seconds: float | None) -> str:
        sent = time.monotonic()
        try:
            with store.time_limited(alias, seconds):
                renewed = store.renew_many(alias, group)
            metrics.observe_renewal(time.monotonic() - sent, len(group))
        except Exception as exc:
            for lease in group:  # a lease lost at its deadline names this error
                lease.renewal_failed(exc)
            locked = _timed_out(exc)
            logger.warning(
                "lease renewal failed on %r%s; will retry",
                alias,
                " (a lease row is locked)" if locked else "",
                exc_info=not locked,
            )
            if not locked:
                connections[alias].close()
            return ROW_LOCKED if locked else FAILED
        for lease in group:
            if not lease.released:
                renewal = renewed.get((lease.key, lease.token))
                lease.confirm_renewal(sent, renewal, time_limit=seconds)
        return RENEWED


def _timed_out(exc: BaseException) -> bool:
    """Whether a renewal failed on its time limit (a row lock held): PostgreSQL's statement
    timeout, MariaDB and MySQL's lock wait timeout."""
    cause = exc.__cause__
    code = getattr(cause, "sqlstate", None) or getattr(cause, "pgcode", None)
    if code in (QUERY_CANCELED, LOCK_NOT_AVAILABLE):
        return True
    args: tuple[Any, ...] = getattr(cause, "args", ())
    return bool(args) and args[0] == LOCK_WAIT_TIMEOUT


_renewer = Renewer()


def _reset_after_fork() -> None:
    global _renewer
    _renewer = Renewer()


os.register_at_fork(after_in_child=_reset_after_fork)


def renewer() -> Renewer:
    """This process's renewer."""
    return _renewer
