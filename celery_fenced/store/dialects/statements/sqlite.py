"""SQLite's statements (:class:`~celery_fenced.store.dialects.sqlite.SQLite`).

Times are SQLite's clock in Django's text format: ``NOW``, ``now + %(ttl)s seconds``
(a ttl is passed as text: ``'30.0'``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from celery_fenced.store.dialects.statements.common import (
    CLAIM_RETURNING,
    EVENT_INSERT,
    GRANT_RETURNING,
    GRANT_SET,
    LEASE_COLUMNS,
    PENDING_COLUMNS,
    PENDING_RESET,
)

if TYPE_CHECKING:
    from collections.abc import Mapping

    from typing_extensions import LiteralString

# -- fragments: the clock -------------------------------------------------------------------
NOW: LiteralString = "strftime('%%Y-%%m-%%d %%H:%%M:%%f', 'now')"
_AGO_WINDOW: LiteralString = (
    "strftime('%%Y-%%m-%%d %%H:%%M:%%f', 'now', '-' || (%(window)s) || ' seconds')"
)

# -- name: now --
# The database's clock.
SELECT_NOW: LiteralString = "SELECT " + NOW

#: an outbox row's insert up to its ``sends``: its job, and its ETA, expiry and resend time
#: given (``*_at``) or relative to now (``*_in`` seconds)
_PENDING_INSERT: LiteralString = (
    "INSERT INTO celery_fenced_pendingjob "
    + PENDING_COLUMNS
    + """
    VALUES (%(task_id)s, %(task_name)s, %(key)s, %(job)s, """
    + NOW
    + """,
        COALESCE(%(eta_at)s, strftime('%%Y-%%m-%%d %%H:%%M:%%f', 'now',
                                      '+' || (%(eta_in)s) || ' seconds')),
        COALESCE(%(expires_at)s, strftime('%%Y-%%m-%%d %%H:%%M:%%f', 'now',
                                          '+' || (%(expires_in)s) || ' seconds')),
        COALESCE(%(resend_at)s, strftime('%%Y-%%m-%%d %%H:%%M:%%f', 'now',
                                         '+' || (%(resend_in)s) || ' seconds')),"""
)

# -- name: record_pending --
# The outbox's row of a published job, started afresh on a re-publish of the task id: its
# ETA, expiry and resend time given (``*_at``) or relative to now (``*_in`` seconds).
RECORD_PENDING: LiteralString = (
    _PENDING_INSERT
    + """
        0, %(unsent)s, NULL, '', NULL, '', NULL, %(plain)s, %(nesting)s)
    ON CONFLICT (task_id) DO UPDATE SET """
    + PENDING_RESET
    + """,
        unique_key = NULL, unique_until = '', started_token = NULL, plain = excluded.plain
    RETURNING id"""
)

# -- name: record_unique_pending --
# A ``lease_unique`` copy's pending row, nothing on any conflict; the task id if recorded.
RECORD_UNIQUE_PENDING: LiteralString = (
    _PENDING_INSERT
    + """
        0, %(unsent)s, NULL, '', %(unique_key)s, %(unique_until)s, NULL, %(plain)s,
        %(nesting)s)
    ON CONFLICT DO NOTHING RETURNING task_id"""
)

# -- fragments: a lease_unique copy that no longer stands (pending row ``p``) ---------------
_EXPIRED_OR_ABANDONED: LiteralString = (
    "p.abandoned_at IS NOT NULL OR (p.expires_at <= " + NOW + " AND p.started_token IS NULL)"
)
_UNTIL_DONE_ENDED: LiteralString = (
    "COALESCE("
    + _EXPIRED_OR_ABANDONED
    + """
        OR (p.started_token IS NOT NULL AND EXISTS (
            SELECT 1 FROM celery_fenced_lease g WHERE g.key = p.key
            AND (g.token > p.started_token
                 OR (g.token = p.started_token
                     AND (g.released_at IS NOT NULL OR g.expires_at <= """
    + NOW
    + """))))), 0)"""
)
_UNTIL_STARTED_ENDED: LiteralString = (
    "COALESCE(" + _EXPIRED_OR_ABANDONED + " OR p.started_token IS NOT NULL, 0)"
)
_DEDUPLICATED_HEAD: LiteralString = (
    EVENT_INSERT
    + """
    SELECT l.id, 'deduplicated', NULLIF(l.token, 0), p.task_id, '', """
    + NOW
    + """, %(detail)s
    FROM celery_fenced_pendingjob p JOIN celery_fenced_lease l ON l.key = p.unique_key
    WHERE p.unique_key = %(key)s AND p.task_id <> %(task_id)s AND NOT """
)
_DEDUPLICATED_TAIL: LiteralString = """
    RETURNING task_id, token, (SELECT owner FROM celery_fenced_lease WHERE id = lease_id)"""

# -- name: deduplicated --
# The ``deduplicated`` event of ``%(task_id)s``, refused: key ``%(key)s``'s copy stands —
# its pending row has not ended (abandoned, expired before it started, or
# (``until_done``) started under a grant that has ended, (``until_started``) started) —
# on the key's lease row; nothing when there is no such copy or no lease row. Returns the
# standing copy's task id, the key's token (None: never granted) and owner. Keyed by the
# ``lease_unique`` mode.
DEDUPLICATED: Mapping[str, LiteralString] = {
    "until_done": _DEDUPLICATED_HEAD + _UNTIL_DONE_ENDED + _DEDUPLICATED_TAIL,
    "until_started": _DEDUPLICATED_HEAD + _UNTIL_STARTED_ENDED + _DEDUPLICATED_TAIL,
}

# -- fragments: a completed duplicate (parameters: digest, retries, window) ------------------
_COMPLETED: LiteralString = (
    """SELECT 1 FROM celery_fenced_completion c
    WHERE c.digest = %(digest)s AND c.retries >= %(retries)s AND c.completed_at > """
    + _AGO_WINDOW
)
_MARKED: LiteralString = (
    "(l.completed_digest = %(digest)s AND l.completed_retries >= %(retries)s"
    " AND l.completed_at > " + _AGO_WINDOW + ")"
)
_PROPOSED: LiteralString = (
    "%(key)s, 1, %(owner)s, %(task_id)s, %(task_name)s, "
    + NOW
    + ", "
    + NOW
    + ", strftime('%%Y-%%m-%%d %%H:%%M:%%f', 'now', '+' || (%(ttl)s) || ' seconds'),"
    " NULL, '', %(job)s, 0, '', NULL, '', '', 0"
)
_GRANT_HEAD: LiteralString = "INSERT INTO celery_fenced_lease AS l " + LEASE_COLUMNS + "\n"
_GRANT_CONFLICT: LiteralString = (
    """
    ON CONFLICT (key) DO UPDATE SET """
    + GRANT_SET
    + """,
        acquired_at = excluded.acquired_at, renewed_at = excluded.renewed_at,
        expires_at = excluded.expires_at
    WHERE (l.released_at IS NOT NULL OR l.expires_at <= """
    + NOW
    + ") AND l.permits = 0"
)

# -- name: grant --
# The grant: one upsert taking a new, released or expired key (not the head of a key's
# permits), the token one more; nothing granted otherwise.
GRANT: LiteralString = (
    _GRANT_HEAD + "VALUES (" + _PROPOSED + ")" + _GRANT_CONFLICT + GRANT_RETURNING
)

# -- name: grant_unless_completed --
# The grant, unless the delivery's job already completed (a ``Completion`` row, or the
# lease row's marker, names it).
GRANT_UNLESS_COMPLETED: LiteralString = (
    _GRANT_HEAD
    + "SELECT "
    + _PROPOSED
    + " WHERE NOT EXISTS ("
    + _COMPLETED
    + ")"
    + _GRANT_CONFLICT
    + " AND NOT "
    + _MARKED
    + GRANT_RETURNING
)

# -- name: completed --
# Whether the delivery's job completed: the key's marker, or a ``Completion`` row.
COMPLETED: LiteralString = (
    "SELECT 1 FROM celery_fenced_lease l WHERE l.key = %(key)s AND "
    + _MARKED
    + " UNION ALL "
    + _COMPLETED
)

# -- name: lock_lease_row --
# The write lock, by a write that changes nothing; the key's row before the grant.
LOCK_LEASE_ROW: LiteralString = """UPDATE celery_fenced_lease SET token = token
    WHERE key = %(key)s
    RETURNING acquired_at, task_id, task_name, job, released_at, reclaim_state,
              reclaim_attempts, expires_at"""

# -- name: holder --
# The key's holder, and its seconds left.
HOLDER: LiteralString = """SELECT id, token, owner, expires_at,
        max(round((julianday(expires_at) - julianday('now')) * 86400.0, 3), 0.0) AS remaining
    FROM celery_fenced_lease WHERE key = %(key)s"""

# -- name: renew --
# Renew the grants of ``%(leases)s`` (a JSON array of [key, token, owner, ttl]) still held.
RENEW: LiteralString = (
    """WITH v(k, t, o, ttl) AS (
        SELECT json_extract(value, '$[0]'), json_extract(value, '$[1]'),
               json_extract(value, '$[2]'), json_extract(value, '$[3]')
        FROM json_each(%(leases)s))
    UPDATE celery_fenced_lease SET renewed_at = """
    + NOW
    + """,
        expires_at = strftime('%%Y-%%m-%%d %%H:%%M:%%f', 'now', '+' || (v.ttl) || ' seconds')
    FROM v
    WHERE celery_fenced_lease.key = v.k AND celery_fenced_lease.token = v.t
      AND celery_fenced_lease.owner = v.o AND celery_fenced_lease.released_at IS NULL
      AND celery_fenced_lease.expires_at > """
    + NOW
    + """
    RETURNING celery_fenced_lease.key, celery_fenced_lease.token,
              celery_fenced_lease.expires_at"""
)

_ELIGIBLE: LiteralString = """released_at IS NULL AND job IS NOT NULL
        AND expires_at
            < strftime('%%Y-%%m-%%d %%H:%%M:%%f', 'now', '-' || (%(grace)s) || ' seconds')
        AND (reclaim_state = '' OR (reclaim_state = 'resent' AND reclaim_claimed_at
             < strftime('%%Y-%%m-%%d %%H:%%M:%%f', 'now',
                        '-' || (%(resend_after)s) || ' seconds')))"""

# -- name: claim --
# Claim up to ``%(limit)s`` grants expired ``%(grace)s`` ago with a job: re-sent, or
# abandoned past ``%(max)s`` attempts. The condition is repeated outside the batch: a row
# a concurrent reclaimer claimed first is skipped.
CLAIM: LiteralString = (
    """UPDATE celery_fenced_lease SET
        reclaim_attempts = CASE WHEN reclaim_attempts < %(max)s
                           THEN reclaim_attempts + 1 ELSE reclaim_attempts END,
        reclaim_state = CASE WHEN reclaim_attempts < %(max)s
                        THEN 'resent' ELSE 'abandoned' END,
        reclaim_claimed_at = """
    + NOW
    + """
    WHERE id IN (SELECT id FROM celery_fenced_lease WHERE """
    + _ELIGIBLE
    + """
                 ORDER BY expires_at LIMIT %(limit)s)
      AND """
    + _ELIGIBLE
    + CLAIM_RETURNING
)

# -- name: record_event --
# An event of the key's row, if the key has one.
RECORD_EVENT: LiteralString = (
    EVENT_INSERT
    + """
    SELECT id, %(kind)s, %(token)s, %(task_id)s, %(owner)s, """
    + NOW
    + """, %(detail)s
    FROM celery_fenced_lease WHERE key = %(key)s RETURNING id"""
)

# -- name: insert_event --
# An event of the lease row ``%(lease_id)s``.
INSERT_EVENT: LiteralString = (
    EVENT_INSERT
    + """
    VALUES (%(lease_id)s, %(kind)s, %(token)s, %(task_id)s, %(owner)s, """
    + NOW
    + """, %(detail)s) RETURNING id"""
)

# -- name: is_current --
# Whether the grant is held: the key's token, owner, unreleased, unexpired.
IS_CURRENT: LiteralString = (
    """SELECT 1 FROM celery_fenced_lease WHERE key = %(key)s AND token = %(token)s
    AND owner = %(owner)s AND released_at IS NULL AND expires_at > """
    + NOW
)

# -- name: current_token --
# The key's current (or last) token.
CURRENT_TOKEN: LiteralString = "SELECT token FROM celery_fenced_lease WHERE key = %(key)s"

# -- name: force_release --
# Release the key's grant whoever holds it (only ``%(task_id)s``'s, or only token
# ``%(token)s``, when given); its row's id and grant.
FORCE_RELEASE: LiteralString = (
    "UPDATE celery_fenced_lease SET released_at = "
    + NOW
    + """, job = NULL
    WHERE key = %(key)s AND released_at IS NULL
      AND (%(task_id)s IS NULL OR task_id = %(task_id)s)
      AND (%(token)s IS NULL OR token = %(token)s)
    RETURNING id, token, owner, task_id, acquired_at"""
)

# -- name: lock_for_result --
# SQLite's write lock, by a write that changes nothing.
LOCK_FOR_RESULT: LiteralString = """UPDATE django_celery_results_taskresult
    SET task_id = task_id
    WHERE task_id = %(task_id)s RETURNING 1"""

# -- name: prove_current --
# The write lock, by a write that changes nothing, if the grant is held.
PROVE_CURRENT: LiteralString = (
    """UPDATE celery_fenced_lease SET token = token
    WHERE key = %(key)s AND token = %(token)s AND released_at IS NULL AND expires_at > """
    + NOW
    + " RETURNING token"
)

_HELD: LiteralString = """key = %(key)s AND token = %(token)s
      AND (%(only_owner)s IS NULL OR owner = %(only_owner)s) AND released_at IS NULL"""

# -- name: move_marker --
# Before a completing release, the marker it replaces (another job's) to ``Completion``.
MOVE_MARKER: LiteralString = (
    """INSERT INTO celery_fenced_completion (digest, retries, completed_at)
    SELECT completed_digest, completed_retries, completed_at FROM celery_fenced_lease
    WHERE """
    + _HELD
    + " AND completed_digest NOT IN ('', %(digest)s) RETURNING id"
)

# -- name: release --
# Release the grant (only ``%(only_owner)s``'s, when given) in state ``%(state)s``.
RELEASE: LiteralString = (
    "UPDATE celery_fenced_lease SET released_at = "
    + NOW
    + ", job = NULL, release_state = %(state)s WHERE "
    + _HELD
    + " RETURNING id"
)

# -- name: release_completing --
# Release the grant, its job's completion marker set (``%(digest)s``, ``%(retries)s``).
RELEASE_COMPLETING: LiteralString = (
    "UPDATE celery_fenced_lease SET released_at = "
    + NOW
    + ", job = NULL, release_state = %(state)s, completed_digest = %(digest)s,"
    " completed_retries = %(retries)s, completed_at = " + NOW + " WHERE " + _HELD + " RETURNING id"
)
