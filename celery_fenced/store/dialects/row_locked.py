"""The operations a dialect that locks lease rows leaves to :class:`.RowLocking`."""

from __future__ import annotations

from celery_fenced.store.dialects.base import DialectBase
from celery_fenced.store.dialects.row_locking import RowLocking
from celery_fenced.store.types import (
    Claim,
    Completed,
    Delivery,
    Ending,
    Grant,
    GrantRequest,
    Holder,
)


class RowLockedDialect(DialectBase):
    """A dialect whose grants, releases and proofs are row-locking transactions (MySQL,
    MariaDB and the portable ORM dialect): each gives its :class:`.RowLocking` its clock
    and its row locks, and these operations are that helper's."""

    locking: RowLocking

    def acquire(self, request: GrantRequest) -> Grant | Holder | Completed:
        """See :meth:`.RowLocking.acquire`."""
        return self.locking.acquire(request)

    def release(self, ending: Ending) -> bool:
        """See :meth:`.RowLocking.release`."""
        return self.locking.release(ending)

    def force_release(
        self, key: str, by: str, task_id: str | None = None, token: int | None = None
    ) -> tuple[int, str] | None:
        """See :meth:`.RowLocking.force_release`."""
        return self.locking.force_release(key, by, task_id, token)

    def prove_current(self, key: str, token: int) -> tuple[bool, int | None]:
        """See :meth:`.RowLocking.prove_current`."""
        return self.locking.prove_current(key, token)

    def release_current(self, ending: Ending) -> tuple[bool, int | None]:
        """See :meth:`.RowLocking.release_current`."""
        return self.locking.release_current(ending)

    def is_current(self, key: str, token: int, owner: str) -> bool:
        """See :meth:`.RowLocking.is_current`."""
        return self.locking.is_current(key, token, owner)

    def completed(self, key: str, delivery: Delivery, window: float) -> bool:
        """See :meth:`.RowLocking.completed`."""
        return self.locking.completed(key, delivery, window)

    def claim_expired(
        self, *, grace: float, resend_after: float, max_attempts: int, limit: int
    ) -> list[Claim]:
        """See :meth:`.RowLocking.claim_expired`."""
        return self.locking.claim_expired(
            grace=grace, resend_after=resend_after, max_attempts=max_attempts, limit=limit
        )

    def estimated_rows(self, table: str) -> int | None:
        return None
