"""What every dialect class holds: its alias, its connection, and the bookkeeping helpers.

:class:`DialectBase` implements no decision of its own: the operations every database
does the same way are one-line calls of the helpers it composes (:mod:`.pending`,
:mod:`.bookkeeping`, :mod:`.permits`). Each database's own operations are in its class.
"""

from __future__ import annotations

import abc
import datetime as dt
from collections.abc import Callable, Iterable
from typing import Any

from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper

from celery_fenced.models import Lease
from celery_fenced.store.dialects import permits
from celery_fenced.store.dialects.bookkeeping import Claims, Events, GrantReads
from celery_fenced.store.dialects.pending import PendingRows
from celery_fenced.store.types import Claim, Deduplicated, Pending


class DialectBase(abc.ABC):
    """The database ``alias`` (``connection``: one to use instead of Django's) and the
    helpers every dialect delegates its bookkeeping to.

    ``locked_rows`` and ``next_token``: the dialect's own way of locking a key's permit
    rows and of numbering a permit's grant, where not the portable one (see
    :class:`.permits.PermitGranter`).
    """

    def __init__(
        self,
        alias: str,
        connection: BaseDatabaseWrapper | None = None,
        *,
        locked_rows: Callable[[list[str]], list[Lease]] | None = None,
        next_token: Callable[[Lease, Iterable[Lease]], int] | None = None,
    ) -> None:
        self.alias = alias
        self._connection = connection
        self.pending = PendingRows(alias)
        self.events = Events(alias, self.now)
        self.grants = GrantReads(alias, self.now)
        self.claims = Claims(alias, self.now, self.events)
        self.permits = permits.PermitGranter(
            alias,
            self.now,
            self.events,
            self.pending,
            locked_rows=locked_rows,
            next_token=next_token,
        )

    @property
    def connection(self) -> BaseDatabaseWrapper:
        """The connection the dialect's statements run on."""
        return self._connection if self._connection is not None else connections[self.alias]

    @abc.abstractmethod
    def now(self) -> dt.datetime:
        """The database's clock."""

    def record_pending(self, pending: Pending) -> None:
        """See :meth:`.PendingRows.record`."""
        self.pending.record(pending)

    def record_unique_pending(self, pending: Pending) -> str | Deduplicated:
        """See :meth:`_record_unique_portably`."""
        return self._record_unique_portably(pending)

    def _record_unique_portably(self, pending: Pending) -> str | Deduplicated:
        """:meth:`.PendingRows.record_unique`; refused, the ``deduplicated`` event is
        written in the same transaction (:meth:`.Events.add_deduplicated`)."""

        def refused(standing: str) -> Deduplicated:
            token, owner = self.events.add_deduplicated(
                pending.key, pending.task_name, standing, pending.task_id
            )
            return Deduplicated(standing, token, owner)

        return self.pending.record_unique(pending, refused)

    def delete_ended_copies(self) -> int:
        """See :meth:`.PendingRows.delete_ended_copies`."""
        return self.pending.delete_ended_copies()

    def task_grants(self, task_id: str) -> list[tuple[str, int, str, bool]]:
        """See :meth:`.GrantReads.task_grants`."""
        return self.grants.task_grants(task_id)

    def expired_unclaimed(self, key: str, token: int) -> bool:
        """See :meth:`.GrantReads.expired_unclaimed`."""
        return self.grants.expired_unclaimed(key, token)

    def end_unclaimed(self, key: str, token: int) -> bool:
        """See :meth:`.GrantReads.end_unclaimed`."""
        return self.grants.end_unclaimed(key, token)

    def expired_unfinished(
        self, *, grace: float, resend_after: float, max_attempts: int, limit: int
    ) -> list[Claim]:
        """See :meth:`.Claims.expired_unfinished`."""
        return self.claims.expired_unfinished(
            grace=grace, resend_after=resend_after, max_attempts=max_attempts, limit=limit
        )

    def unclaim(self, claim: Claim) -> bool:
        """See :meth:`.Claims.unclaim`."""
        return self.claims.unclaim(claim)

    def abandon(self, claim: Claim, reason: str) -> bool:
        """See :meth:`.Claims.abandon`."""
        return self.claims.abandon(claim, reason)

    def record_resent(self, claim: Claim, detail: dict[str, Any]) -> None:
        """See :meth:`.Claims.record_resent`."""
        self.claims.record_resent(claim, detail)
