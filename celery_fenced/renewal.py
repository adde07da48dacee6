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

from django.db import connections

from celery_fenced import dialects
from celery_fenced.store import HeldLease

logger = logging.getLogger(__name__)

#: a lease is renewed with its batch once this share of its renew interval has passed
BATCH_SHARE = 0.6


class Renewer:
    def __init__(self) -> None:
        self._leases: dict[int, HeldLease] = {}
        # found lost, not yet unregistered by their execution: still this process's
        self._lost: dict[int, HeldLease] = {}
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def register(self, lease: HeldLease) -> None:
        with self._cond:
            self._leases[id(lease)] = lease
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="celery-fenced-renewer", daemon=True
                )
                self._thread.start()
            self._cond.notify()

    def unregister(self, lease: HeldLease) -> None:
        with self._cond:
            self._leases.pop(id(lease), None)
            self._lost.pop(id(lease), None)

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
                    # stop only after 30 s without a lease: short tasks come and go
                    # between two wake-ups, and a thread per task would cost each of them
                    if not self._cond.wait(timeout=30) and not self._leases:
                        self._thread = None
                        return
                    continue
                now = time.monotonic()
                leases = list(self._leases.values())
                next_due = min(x._confirmed_at + x.renew_interval for x in leases)
                if next_due > now:
                    self._cond.wait(timeout=next_due - now)
                    continue
                due = [
                    x for x in leases if now >= x._confirmed_at + x.renew_interval * BATCH_SHARE
                ]
            try:
                self.renew(due)
            except Exception:  # nothing may stop the thread: every other lease needs it
                logger.exception("lease renewal failed; will retry")
            with self._cond:
                for lease in due:
                    if not (lease.lost or lease.released):
                        continue
                    if self._leases.pop(id(lease), None) is not None and not lease.released:
                        self._lost[id(lease)] = lease  # until its execution unregisters it

    def renew(self, leases: list[HeldLease]) -> None:
        """Renew ``leases`` with one statement per database; mark the refused ones lost."""
        by_alias: dict[str, list[HeldLease]] = defaultdict(list)
        for lease in leases:
            if not (lease.lost or lease.released):
                by_alias[lease.alias].append(lease)
        for alias, group in by_alias.items():
            sent = time.monotonic()
            try:
                renewed = dialects.for_alias(alias).renew(
                    [dialects.Renewal(x.key, x.token, x.owner, x.ttl) for x in group]
                )
            except Exception:
                logger.warning("lease renewal failed on %r; will retry", alias, exc_info=True)
                connections[alias].close()
                for lease in group:
                    if time.monotonic() >= lease.local_deadline:
                        lease.mark_lost("the database was unreachable until the grant expired")
                time.sleep(min(1.0, min(x.renew_interval for x in group) / 4))
                continue
            for lease in group:
                if not lease.released:
                    lease.confirm_renewal(sent, renewed.get((lease.key, lease.token)))


_renewer = Renewer()


def _reset_after_fork() -> None:
    global _renewer
    _renewer = Renewer()


os.register_at_fork(after_in_child=_reset_after_fork)


def renewer() -> Renewer:
    """This process's renewer."""
    return _renewer
