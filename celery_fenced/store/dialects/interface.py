"""The typed interface of the lease store's dialects: every operation the store needs.

One class per database family implements it (:mod:`.postgresql`, :mod:`.sqlite`,
:mod:`.mysql`, and :mod:`.orm` for any other database); :func:`~.for_alias` picks it.
Every expiry decision is made inside a statement with the database's own clock; no
worker clock is ever compared with ``expires_at``.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from celery_fenced.store.types import (
    Claim,
    Completed,
    Deduplicated,
    Delivery,
    Ending,
    Grant,
    GrantRequest,
    Holder,
    Pending,
    Renewal,
)


@runtime_checkable
class Dialect(Protocol):
    """The lease store's operations on one database (its Django alias)."""

    alias: str

    def now(self) -> dt.datetime:
        """The database's clock."""

    # -- grants ----------------------------------------------------------------------
    def acquire(self, request: GrantRequest) -> Grant | Holder | Completed:
        """Grant ``request.key``, or tell who holds it (a ``busy`` event).

        With a ``request.delivery`` whose job already completed within ``request.window``
        seconds (see :meth:`completed`) nothing is granted: :class:`Completed`, decided
        under the lease row's lock, so a completion committing meanwhile is seen.
        """

    def renew(self, leases: Sequence[Renewal]) -> dict[tuple[str, int], dt.datetime]:
        """Extend every lease in ``leases`` still held; return the new expiry of each."""

    def release(self, ending: Ending) -> bool:
        """End the grant if it is still held by its owner; whether it was."""

    def force_release(
        self, key: str, by: str, task_id: str | None = None, token: int | None = None
    ) -> tuple[int, str] | None:
        """End the key's grant (only if it is ``task_id``'s, or ``token``, when given)."""

    # -- fencing ---------------------------------------------------------------------
    def prove_current(self, key: str, token: int) -> tuple[bool, int | None]:
        """Lock the lease row and tell whether ``token`` is its current, unexpired grant.

        Must run inside a transaction: the lock is held until it ends, so no newer grant
        can be issued before the caller's writes commit. Returns ``(ok, current_token)``.
        """

    def release_current(self, ending: Ending) -> tuple[bool, int | None]:
        """Prove the token current and end its grant, in one step; ``(ok, current_token)``.

        The key's token, not released — a grant that expired with no successor is still
        this execution's (nobody holds a newer token). When it holds, the grant is
        released and its ``released`` event recorded, and the lease row stays locked
        until the caller's transaction ends: a write that fails after it rolls the
        release back too. Must run inside a transaction. It takes the task id's result
        lock (:meth:`lock_for_result`).
        """

    def lock_for_result(self, task_id: str) -> None:
        """Serialize the result writes of ``task_id`` until the transaction ends.

        The fenced write takes it after proving its token; an untokened write takes it
        before deciding whether it may write, so the decision and the write are atomic.
        """

    def is_current(self, key: str, token: int, owner: str) -> bool:
        """Whether ``token`` is ``key``'s unreleased, unexpired grant held by ``owner``."""

    def task_grants(self, task_id: str) -> list[tuple[str, int, str, bool]]:
        """``(key, token, owner, live)`` of every unreleased grant held for ``task_id``.

        ``live``: not expired by the database's clock.
        """

    def expired_unclaimed(self, key: str, token: int) -> bool:
        """Whether ``token`` is ``key``'s grant, unreleased and expired by the DB clock."""

    def end_unclaimed(self, key: str, token: int) -> bool:
        """Whether ``token`` is still ``key``'s unreleased grant (expired now if running)."""

    # -- completed duplicates ----------------------------------------------------------
    def completed(self, key: str, delivery: Delivery, window: float) -> bool:
        """Whether ``delivery``'s job completed within the last ``window`` seconds.

        Completed: released as SUCCESS, FAILURE, REPLACED or RETRY under its lease, by a
        delivery of the same task id and message (``digest``) retried at least as often.
        A delivery whose ``retries`` is above the completed one's is a retry the body
        asked for before that execution ended: it is not a duplicate. Read from the lease
        row's marker (the key's last completed job) and from the ``Completion`` table (the
        markers of jobs completed before another job completed under the key), never from
        events: pruning them changes nothing here.
        """

    # -- reclaim ---------------------------------------------------------------------
    def claim_expired(
        self, *, grace: float, resend_after: float, max_attempts: int, limit: int
    ) -> list[Claim]:
        """Claim the expired, unfinished grants that have a job to re-send.

        A grant is claimed once per expiry: the claim sets ``reclaim_state``, which only
        the next grant clears (or ``resend_after`` seconds, when the re-sent job never
        started). A claim below ``max_attempts`` counts an attempt and is to be re-sent;
        one at the maximum abandons the lease with an ``abandoned`` event.
        """

    def expired_unfinished(
        self, *, grace: float, resend_after: float, max_attempts: int, limit: int
    ) -> list[Claim]:
        """What :meth:`claim_expired` would claim now, claiming nothing (a dry run)."""

    def unclaim(self, claim: Claim) -> bool:
        """Undo a claim whose job was not sent (or was revoked): the next sweep tries again."""

    def abandon(self, claim: Claim, reason: str) -> bool:
        """Abandon a claimed lease whose job cannot be sent again (e.g. unreadable)."""

    def record_resent(self, claim: Claim, detail: dict[str, Any]) -> None:
        """The ``resent`` event of a claim whose job was sent again."""

    # -- the outbox ----------------------------------------------------------------------
    def record_pending(self, pending: Pending) -> None:
        """Write (or, for the same task id, start afresh) the pending row of a published job."""

    def record_unique_pending(self, pending: Pending) -> str | Deduplicated:
        """Record a ``lease_unique`` job unless a copy of its key stands.

        Returns the job's task id when it was recorded; refused, the copy that stands,
        its ``deduplicated`` event written in the same transaction.
        """

    def delete_ended_copies(self) -> int:
        """Delete the ``until_done`` rows whose run has ended."""

    # -- events and sizes ----------------------------------------------------------------
    def record_event(
        self,
        key: str,
        kind: str,
        token: int | None,
        task_id: str,
        owner: str,
        detail: dict[str, Any],
    ) -> None:
        """Add an event of ``kind`` to ``key``'s history (nothing if the key has no row)."""

    def estimated_rows(self, table: str) -> int | None:
        """The planner's estimate of ``table``'s size, where the database keeps one."""


class ReleasesWithResult(Dialect, Protocol):
    """A dialect that also writes a success's result row in its releasing statement."""

    def release_with_result(self, ending: Ending, row: Sequence[Any]) -> tuple[bool, int | None]:
        """:meth:`~Dialect.release_current` and the task's result row, in one statement.

        ``row``: the values of :data:`~celery_fenced.store.types.RESULT_COLUMNS`. The row
        is written (inserted, or over the task id's row) only when the release holds,
        under the task id's result lock. Outside a transaction the statement is its own:
        one round trip proves, releases, marks the job completed and stores its result.
        """
