"""The lease store: the only code that talks to the lease tables.

Acquire, renew, release, force-release and guard, and the named operations the rest of
the package needs (prove a result write, renew many, claim expired grants, record a
duplicate). Its dialects (:mod:`celery_fenced.store.dialects`) are private to it; a test
(``tests/unit/test_boundaries.py``) checks that nothing else imports them. The values it
takes and returns are in :mod:`celery_fenced.store.types`.

Usable without Celery::

    lease = acquire("report:42", ttl=30)
    with lease.guard():
        Report.objects.filter(pk=42).update(...)
    lease.release()
"""

from __future__ import annotations

from celery_fenced.store.beat import (
    BeatHolder,
    BeatState,
    advance_beat_entry,
    all_beat_entries,
    beat_entries,
    beat_holder,
    beat_keys,
)
from celery_fenced.store.fenced import (
    Refused,
    fenced_transaction,
    in_guard,
    in_guard_of_token,
    lock_for_result,
    prove_current,
    prove_for_result,
    reject_stale,
    release_with_result,
    released_as,
    time_limited,
    writes_result_in_release,
)
from celery_fenced.store.grants import (
    acquire,
    database_now,
    end_unclaimed,
    estimated_rows,
    expire,
    expired_unclaimed,
    force_release,
    grant,
    grant_live_since,
    grant_of,
    granted_again,
    record_duplicate,
    token_of,
)
from celery_fenced.store.held import UNRENEWED, HeldLease, renew_many, unrenewed
from celery_fenced.store.outbox import (
    Due,
    abandon_pending,
    claim_due,
    delete_abandoned_before,
    expired_rows,
    forget_pending,
    forget_row,
    mark_ended,
    mark_unsent,
    pending_rows,
    record_pending,
    unclaim_due,
)
from celery_fenced.store.owned import close as close_kept_connection
from celery_fenced.store.owned import close_all as close_kept_connections
from celery_fenced.store.owned import connection_for as kept_connection
from celery_fenced.store.pruning import delete_completions_before, delete_events_before
from celery_fenced.store.reclaiming import (
    abandon,
    claim_expired,
    end_claimed,
    expired_unfinished,
    record_resent,
    unclaim,
)
from celery_fenced.store.settling import keep_for_outcome, process_holds, settle_elsewhere
from celery_fenced.store.types import (
    REPLACED,
    RESULT_COLUMNS,
    Claim,
    Deduplicated,
    Delivery,
    Pending,
)
from celery_fenced.store.validation import (
    database_alias,
    default_owner,
    validate_key,
    validate_owner,
    validate_ttl,
)

__all__ = [
    "REPLACED",
    "RESULT_COLUMNS",
    "UNRENEWED",
    "BeatHolder",
    "BeatState",
    "Claim",
    "Deduplicated",
    "Delivery",
    "Due",
    "HeldLease",
    "Pending",
    "Refused",
    "abandon",
    "abandon_pending",
    "acquire",
    "advance_beat_entry",
    "all_beat_entries",
    "beat_entries",
    "beat_holder",
    "beat_keys",
    "claim_due",
    "claim_expired",
    "close_kept_connection",
    "close_kept_connections",
    "database_alias",
    "database_now",
    "default_owner",
    "delete_abandoned_before",
    "delete_completions_before",
    "delete_events_before",
    "end_claimed",
    "end_unclaimed",
    "estimated_rows",
    "expire",
    "expired_rows",
    "expired_unclaimed",
    "expired_unfinished",
    "fenced_transaction",
    "force_release",
    "forget_pending",
    "forget_row",
    "grant",
    "grant_live_since",
    "grant_of",
    "granted_again",
    "in_guard",
    "in_guard_of_token",
    "keep_for_outcome",
    "kept_connection",
    "lock_for_result",
    "mark_ended",
    "mark_unsent",
    "pending_rows",
    "process_holds",
    "prove_current",
    "prove_for_result",
    "record_duplicate",
    "record_pending",
    "record_resent",
    "reject_stale",
    "release_with_result",
    "released_as",
    "renew_many",
    "settle_elsewhere",
    "time_limited",
    "token_of",
    "unclaim",
    "unclaim_due",
    "unrenewed",
    "validate_key",
    "validate_owner",
    "validate_ttl",
    "writes_result_in_release",
]
