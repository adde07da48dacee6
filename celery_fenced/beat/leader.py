"""The beat leader's lease: taken with :func:`celery_fenced.store.acquire`, renewed by
the process's renewer thread while it leads, released when beat stops."""

from __future__ import annotations

import logging

from django.db import DatabaseError, connections

from celery_fenced import renewal, store
from celery_fenced.exceptions import LeaseBusy
from celery_fenced.store import HeldLease

logger = logging.getLogger(__name__)

#: the shortest wait between two attempts to take the lease (seconds)
MIN_WAIT = 0.05


class Leadership:
    """One beat process's claim to lead under ``key``."""

    def __init__(self, key: str, ttl: float, *, alias: str, owner: str | None = None) -> None:
        self.key = store.validate_key(key)
        self.alias = alias
        self.ttl = ttl
        self.owner = owner or store.default_owner()
        self.lease: HeldLease | None = None
        #: bumped at every new grant: the schedule is read again from the database
        self.term = 0
        self._holder: str | None = None

    @property
    def poll_interval(self) -> float:
        """How often a standby tries, and a leader looks at its lease: a third of the ttl."""
        return self.ttl / 3

    def leading(self) -> bool:
        """Whether this process holds the lease now (its renewals confirmed it)."""
        lease = self.lease
        return lease is not None and not lease.lost and not lease.released

    def lead(self) -> float | None:
        """None when this process leads (taking the lease if it is free); otherwise the
        seconds to wait before trying again."""
        if self.leading():
            return None
        if self.lease is not None:
            self.step_down(self.lease.lost_reason or "released")
        try:
            held_for = self._held_for()
            if held_for is not None:  # a standby only reads: no busy event per poll
                return min(max(held_for, MIN_WAIT), self.poll_interval)
            lease = store.acquire(self.key, ttl=self.ttl, owner=self.owner, using=self.alias)
        except LeaseBusy as busy:
            if busy.holder != self._holder:
                self._holder = busy.holder
                logger.info(
                    "beat standing by: %r is led by %s (token %s)",
                    self.key,
                    busy.holder,
                    busy.token,
                    extra={"lease_key": self.key, "fencing_token": busy.token},
                )
            return min(max(busy.remaining, MIN_WAIT), self.poll_interval)
        except DatabaseError:
            logger.warning("beat could not reach the lease database; will retry", exc_info=True)
            # a session the server ended (a restart, a failover) is not used again: the
            # next attempt opens a new one
            connections[self.alias].close_if_unusable_or_obsolete()
            return self.poll_interval
        self.lease = lease
        self.term += 1
        self._holder = None
        renewal.renewer().register(lease)
        logger.info(
            "beat leading %r with token %s",
            self.key,
            lease.token,
            extra={"lease_key": self.key, "fencing_token": lease.token, "lease_owner": self.owner},
        )
        return None

    def _held_for(self) -> float | None:
        """Seconds until the current grant of the key expires (the database's clock), or
        None when it is free, released or expired."""
        holder = store.beat_holder(self.alias, self.key)
        if holder is None:
            return None
        if holder.owner != self._holder:
            self._holder = holder.owner
            logger.info(
                "beat standing by: %r is led by %s (token %s)",
                self.key,
                holder.owner,
                holder.token,
                extra={"lease_key": self.key, "fencing_token": holder.token},
            )
        return holder.remaining

    def step_down(self, reason: str) -> None:
        """Stop leading here (the lease is lost or was released)."""
        lease, self.lease = self.lease, None
        if lease is None:
            return
        renewal.renewer().unregister(lease)
        logger.warning(
            "beat no longer leads %r (token %s): %s",
            self.key,
            lease.token,
            reason,
            extra={"lease_key": self.key, "fencing_token": lease.token},
        )

    def release(self) -> None:
        """Beat stops: give the lease up so that a standby takes over at once."""
        lease, self.lease = self.lease, None
        if lease is None:
            return
        renewal.renewer().unregister(lease)
        try:
            lease.release()
        except DatabaseError:
            logger.warning("beat could not release %r; it expires", self.key, exc_info=True)
