"""Column lists and fixed text that several dialects' statements share; the portable clock."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing_extensions import LiteralString

#: an event row's columns, for ``INSERT … VALUES`` and ``INSERT … SELECT``
EVENT_INSERT: LiteralString = (
    "INSERT INTO celery_fenced_leaseevent (lease_id, kind, token, task_id, owner, at, detail)"
)

#: a pending row's columns, in the order the statements give its values
PENDING_COLUMNS: LiteralString = """(task_id, task_name, key, job, published_at, eta,
    expires_at, resend_at, sends, unsent, abandoned_at, abandoned_reason, unique_key,
    unique_until, started_token, plain, nesting)"""

#: the ``SET`` list starting a conflicting pending row afresh from ``excluded``
PENDING_RESET: LiteralString = """task_name = excluded.task_name, key = excluded.key,
    job = excluded.job, published_at = excluded.published_at, eta = excluded.eta,
    expires_at = excluded.expires_at, resend_at = excluded.resend_at, sends = 0,
    unsent = excluded.unsent, abandoned_at = NULL, abandoned_reason = '',
    nesting = excluded.nesting"""

#: a lease row's columns, in the order the statements give its values
LEASE_COLUMNS: LiteralString = """(key, token, owner, task_id, task_name, acquired_at,
    renewed_at, expires_at, released_at, reclaimed_from, job, reclaim_attempts,
    reclaim_state, reclaim_claimed_at, completed_digest, release_state, permits)"""

#: the ``SET`` list of a grant's conflict clause but its times (the same task's
#: re-delivery keeps its reclaim count)
GRANT_SET: LiteralString = """token = l.token + 1, owner = excluded.owner,
    task_id = excluded.task_id, task_name = excluded.task_name,
    released_at = NULL, release_state = '',
    reclaimed_from = CASE WHEN l.released_at IS NULL THEN l.owner ELSE '' END,
    job = excluded.job,
    reclaim_attempts = CASE WHEN l.released_at IS NULL AND excluded.task_id <> ''
                            AND l.task_id = excluded.task_id
                       THEN l.reclaim_attempts ELSE 0 END,
    reclaim_state = '',
    reclaim_claimed_at = CASE WHEN l.released_at IS NULL AND excluded.task_id <> ''
                              AND l.task_id = excluded.task_id
                         THEN l.reclaim_claimed_at END"""

#: a grant's returned columns
GRANT_RETURNING: LiteralString = (
    " RETURNING id, token, expires_at, reclaimed_from, completed_digest"
)

#: a claim's returned columns
CLAIM_RETURNING: LiteralString = """ RETURNING id, key, token, owner, task_id, task_name,
    job, reclaim_attempts, reclaim_state"""

#: django-celery-results' result row but its id, as a fenced success writes it in the
#: statement that releases the lease (PostgreSQL)
RESULT_COLUMNS: LiteralString = """(task_id, periodic_task_name, task_name, task_args,
    task_kwargs, status, worker, content_type, content_encoding, result, date_created,
    date_started, date_done, traceback, meta)"""

#: what a write over an existing result row changes: what ``DatabaseBackend`` writes, not
#: the row's creation or start time
RESULT_UPDATE: LiteralString = """periodic_task_name = EXCLUDED.periodic_task_name,
    task_name = EXCLUDED.task_name, task_args = EXCLUDED.task_args,
    task_kwargs = EXCLUDED.task_kwargs, status = EXCLUDED.status, worker = EXCLUDED.worker,
    content_type = EXCLUDED.content_type, content_encoding = EXCLUDED.content_encoding,
    result = EXCLUDED.result, date_done = EXCLUDED.date_done,
    traceback = EXCLUDED.traceback, meta = EXCLUDED.meta"""

#: the database's clock in standard SQL (the portable dialect's)
SELECT_CURRENT_TIMESTAMP: LiteralString = "SELECT CURRENT_TIMESTAMP"
