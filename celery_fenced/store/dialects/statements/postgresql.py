"""PostgreSQL's statements (:class:`~celery_fenced.store.dialects.postgresql.PostgreSQL`).

Times are ``statement_timestamp()``, plus or minus ``%(x)s::float8`` seconds.

A statement that finds a lease row by its key (or id, or permit job) says "unreleased"
as ``(released_at IS NULL) IS TRUE``: the planner cannot read the lease table's partial
indexes of unreleased rows for it (their predicate says ``released_at IS NULL``). The
statements are prepared, and a prepared statement's generic plan, made while few leases
were held, would scan those indexes instead of the key's: cheap when made, slower with
every grant (each adds its entries, dead ones until a vacuum) until the next ANALYZE.
The one partial index such a statement must read, of one permit per job, spells its
predicate the same way (migration 0018).
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
    RESULT_COLUMNS,
    RESULT_UPDATE,
)

if TYPE_CHECKING:
    from collections.abc import Mapping

    from typing_extensions import LiteralString

# -- name: now --
# The database's clock.
SELECT_NOW: LiteralString = "SELECT statement_timestamp()"

# -- name: record_pending --
# The outbox's row of a published job, started afresh on a re-publish of the task id: its
# ETA, expiry and resend time given (``*_at``) or relative to now (``*_in`` seconds).
RECORD_PENDING: LiteralString = (
    "INSERT INTO celery_fenced_pendingjob "
    + PENDING_COLUMNS
    + """
    VALUES (%(task_id)s, %(task_name)s, %(key)s, %(job)s, statement_timestamp(),
        COALESCE(%(eta_at)s, statement_timestamp()
                             + (%(eta_in)s)::float8 * interval '1 second'),
        COALESCE(%(expires_at)s, statement_timestamp()
                                 + (%(expires_in)s)::float8 * interval '1 second'),
        COALESCE(%(resend_at)s, statement_timestamp()
                                + (%(resend_in)s)::float8 * interval '1 second'),
        0, %(unsent)s, NULL, '', NULL, '', NULL, %(plain)s, %(nesting)s)
    ON CONFLICT (task_id) DO UPDATE SET """
    + PENDING_RESET
    + """,
        unique_key = NULL, unique_until = '', started_token = NULL, plain = excluded.plain
    RETURNING id"""
)

_AGO_WINDOW: LiteralString = "(statement_timestamp() - (%(window)s)::float8 * interval '1 second')"

# -- name: renew --
# Renew the grants of ``%(leases)s`` (a JSON array of [key, token, owner, ttl]) still held.
RENEW: LiteralString = """WITH v(k, t, o, ttl) AS (
        SELECT e->>0, (e->>1)::bigint, e->>2, (e->>3)::float8
        FROM jsonb_array_elements((%(leases)s)::jsonb) e)
    UPDATE celery_fenced_lease SET renewed_at = statement_timestamp(),
        expires_at = statement_timestamp() + v.ttl * interval '1 second'
    FROM v
    WHERE celery_fenced_lease.key = v.k AND celery_fenced_lease.token = v.t
      AND celery_fenced_lease.owner = v.o
      AND (celery_fenced_lease.released_at IS NULL) IS TRUE
      AND celery_fenced_lease.expires_at > statement_timestamp()
    RETURNING celery_fenced_lease.key, celery_fenced_lease.token,
              celery_fenced_lease.expires_at"""

# -- name: record_event --
# An event of the key's row, if the key has one.
RECORD_EVENT: LiteralString = (
    EVENT_INSERT
    + """
    SELECT id, %(kind)s, %(token)s, %(task_id)s, %(owner)s, statement_timestamp(),
           (%(detail)s)::jsonb
    FROM celery_fenced_lease WHERE key = %(key)s RETURNING id"""
)

# -- name: is_current --
# Whether the grant is held: the key's token, owner, unreleased, unexpired.
IS_CURRENT: LiteralString = """SELECT 1 FROM celery_fenced_lease
    WHERE key = %(key)s AND token = %(token)s AND owner = %(owner)s
      AND (released_at IS NULL) IS TRUE AND expires_at > statement_timestamp()"""

# -- name: current_token --
# The key's current (or last) token.
CURRENT_TOKEN: LiteralString = "SELECT token FROM celery_fenced_lease WHERE key = %(key)s"

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

# -- name: completed --
# Whether the delivery's job completed: the key's marker, or a ``Completion`` row.
COMPLETED: LiteralString = (
    "SELECT 1 FROM celery_fenced_lease l WHERE l.key = %(key)s AND "
    + _MARKED
    + "\n    UNION ALL\n    "
    + _COMPLETED
)

# -- fragments: the grant's upsert (parameters: key, owner, task_id, task_name, ttl, job) ---
_PROPOSED: LiteralString = """%(key)s, 1, %(owner)s, %(task_id)s, %(task_name)s,
    statement_timestamp(), statement_timestamp(),
    (statement_timestamp() + (%(ttl)s)::float8 * interval '1 second'),
    NULL, '', %(job)s, 0, '', NULL, '', '', 0"""
_GRANT_HEAD: LiteralString = "INSERT INTO celery_fenced_lease AS l " + LEASE_COLUMNS + "\n    "
_GRANT_VALUES: LiteralString = _GRANT_HEAD + "VALUES (" + _PROPOSED + ")"
_GRANT_UNLESS_COMPLETED: LiteralString = (
    _GRANT_HEAD + "SELECT " + _PROPOSED + "\n    WHERE NOT EXISTS (" + _COMPLETED + ")"
)
# the conflict clause runs once the row is locked: a release this grant waited for
# committed before then, and ``statement_timestamp()`` (the proposed row's) is older than
# that release; the grant starts now, its ttl unchanged
_GRANT_CONFLICT: LiteralString = (
    """
    ON CONFLICT (key) DO UPDATE SET """
    + GRANT_SET
    + """,
        acquired_at = clock_timestamp(), renewed_at = clock_timestamp(),
        expires_at = excluded.expires_at + (clock_timestamp() - excluded.acquired_at)"""
)
#: a new or released key only (the routine grant)
_RELEASED: LiteralString = "\n    WHERE l.released_at IS NOT NULL AND l.permits = 0"
#: a new, released or expired key (the takeover)
_FREE: LiteralString = (
    "\n    WHERE (l.released_at IS NOT NULL OR l.expires_at <= statement_timestamp())"
    " AND l.permits = 0"
)
# the conflict clause sees the row's latest version, but the ``Completion`` rows only as
# of the snapshot: the row's marker must still be the snapshot's (a completion committed
# in between moved this delivery's marker there), else nothing is granted here and the
# check after it (a new snapshot) finds the job completed
_UNMARKED: LiteralString = (
    " AND NOT "
    + _MARKED
    + """
      AND l.completed_digest = (SELECT s.completed_digest FROM celery_fenced_lease s
                                WHERE s.key = %(key)s)"""
)
# only over the row the snapshot read: a grant committed while this statement waited is
# not taken over blind
_UNCHANGED: LiteralString = (
    "\n      AND l.token = (SELECT s.token FROM celery_fenced_lease s WHERE s.key = %(key)s)"
)
_UPSERT_ROUTINE: LiteralString = _GRANT_VALUES + _GRANT_CONFLICT + _RELEASED + GRANT_RETURNING
_UPSERT_ROUTINE_UNLESS_COMPLETED: LiteralString = (
    _GRANT_UNLESS_COMPLETED + _GRANT_CONFLICT + _RELEASED + _UNMARKED + GRANT_RETURNING
)
_UPSERT_TAKEOVER: LiteralString = (
    _GRANT_VALUES + _GRANT_CONFLICT + _FREE + _UNCHANGED + GRANT_RETURNING
)
_UPSERT_TAKEOVER_UNLESS_COMPLETED: LiteralString = (
    _GRANT_UNLESS_COMPLETED + _GRANT_CONFLICT + _FREE + _UNMARKED + _UNCHANGED + GRANT_RETURNING
)

# -- fragments: CTEs joining the grant (``granted``) -------------------------------------------
#: its event: a takeover's ``reclaimed`` always, an ``acquired`` one with routine events
#: (``%(routine_events)s``); the previous grant's start read from the snapshot
_GRANT_EVENT: LiteralString = (
    """,
    ev AS (
        """
    + EVENT_INSERT
    + """
        SELECT id, CASE WHEN reclaimed_from = '' THEN 'acquired' ELSE 'reclaimed' END,
               token, %(task_id)s, %(owner)s, clock_timestamp(),  -- after the grant's
               CASE WHEN reclaimed_from = '' THEN '{}'::jsonb ELSE
               jsonb_build_object(
                   'previous_owner', reclaimed_from,
                   'previous_token', token - 1,
                   'previous_acquired_at',
                   (SELECT p.acquired_at FROM celery_fenced_lease p WHERE p.key = %(key)s)) END
        FROM granted WHERE reclaimed_from <> '' OR %(routine_events)s)"""
)
#: the job of the grant taken over, another job's, handed to the outbox due at once
#: (``p``: the row before the grant, from the snapshot, picked by key or by id)
_DISPLACED_HEAD: LiteralString = (
    """,
    displaced AS (
        INSERT INTO celery_fenced_pendingjob AS q """
    + PENDING_COLUMNS
    + """
        SELECT p.task_id, p.task_name, p.key, p.job, statement_timestamp(), NULL,
               NULL, statement_timestamp(), p.reclaim_attempts, false, NULL, '',
               NULL, '', NULL, false, 0
        FROM celery_fenced_lease p, granted g
        WHERE """
)
_DISPLACED_TAIL: LiteralString = """
          AND g.reclaimed_from <> '' AND (p.released_at IS NULL) IS TRUE
          AND p.job IS NOT NULL AND p.task_id NOT IN ('', %(task_id)s)
          AND p.reclaim_state <> 'abandoned'
        ON CONFLICT (task_id) DO UPDATE
            SET started_token = NULL, resend_at = statement_timestamp()
            WHERE q.started_token IS NOT NULL)"""
_DISPLACED: LiteralString = _DISPLACED_HEAD + "p.key = %(key)s" + _DISPLACED_TAIL
_DISPLACED_BY_ID: LiteralString = _DISPLACED_HEAD + "p.id = g.id" + _DISPLACED_TAIL
#: the end of the job's pending row (``%(task_id)s``, ``%(nesting)s``), once granted
_END_PENDING: LiteralString = """,
    pend AS (DELETE FROM celery_fenced_pendingjob WHERE task_id = %(task_id)s
             AND nesting <= %(nesting)s AND EXISTS (SELECT 1 FROM granted))"""
#: the same for a ``lease_unique="until_done"`` task: its row kept, stamped with the token
_STAMP_PENDING: LiteralString = """,
    pend AS (DELETE FROM celery_fenced_pendingjob WHERE task_id = %(task_id)s
             AND nesting <= %(nesting)s AND unique_until <> 'until_done'
             AND EXISTS (SELECT 1 FROM granted)),
    began AS (UPDATE celery_fenced_pendingjob
              SET started_token = (SELECT token FROM granted)
              WHERE task_id = %(task_id)s AND nesting <= %(nesting)s
                AND unique_until = 'until_done' AND EXISTS (SELECT 1 FROM granted))"""
_SELECT_GRANTED: LiteralString = """
    SELECT id, token, expires_at, reclaimed_from, completed_digest FROM granted"""
#: with the expiry of the grant taken over (the snapshot's row)
_SELECT_GRANTED_BEFORE: LiteralString = """
    SELECT id, token, expires_at, reclaimed_from, completed_digest,
           (SELECT p.expires_at FROM celery_fenced_lease p WHERE p.id = granted.id)
    FROM granted"""
_ROUTINE: LiteralString = "WITH granted AS (" + _UPSERT_ROUTINE + ")"
_ROUTINE_UC: LiteralString = "WITH granted AS (" + _UPSERT_ROUTINE_UNLESS_COMPLETED + ")"
_TAKEOVER: LiteralString = "WITH granted AS (" + _UPSERT_TAKEOVER + ")" + _GRANT_EVENT
_TAKEOVER_UC: LiteralString = (
    "WITH granted AS (" + _UPSERT_TAKEOVER_UNLESS_COMPLETED + ")" + _GRANT_EVENT
)

# -- name: grant_routine --
# The grant of a new or released key (not a takeover: nothing granted then), without
# opening the events table unless routine events are on. Keyed by (routine events, the
# end of the job's pending row: "" | "end" | "stamp", unless completed).
GRANT_ROUTINE: Mapping[tuple[bool, str, bool], LiteralString] = {
    (False, "", False): _UPSERT_ROUTINE,
    (False, "", True): _UPSERT_ROUTINE_UNLESS_COMPLETED,
    (False, "end", False): _ROUTINE + _END_PENDING + _SELECT_GRANTED,
    (False, "end", True): _ROUTINE_UC + _END_PENDING + _SELECT_GRANTED,
    (False, "stamp", False): _ROUTINE + _STAMP_PENDING + _SELECT_GRANTED,
    (False, "stamp", True): _ROUTINE_UC + _STAMP_PENDING + _SELECT_GRANTED,
    (True, "", False): _ROUTINE + _GRANT_EVENT + _SELECT_GRANTED_BEFORE,
    (True, "", True): _ROUTINE_UC + _GRANT_EVENT + _SELECT_GRANTED_BEFORE,
    (True, "end", False): _ROUTINE + _GRANT_EVENT + _END_PENDING + _SELECT_GRANTED_BEFORE,
    (True, "end", True): _ROUTINE_UC + _GRANT_EVENT + _END_PENDING + _SELECT_GRANTED_BEFORE,
    (True, "stamp", False): _ROUTINE + _GRANT_EVENT + _STAMP_PENDING + _SELECT_GRANTED_BEFORE,
    (True, "stamp", True): _ROUTINE_UC + _GRANT_EVENT + _STAMP_PENDING + _SELECT_GRANTED_BEFORE,
}

# -- name: grant_takeover --
# The full grant: a new, released or expired key, over the row the snapshot read, its
# event, the displaced job to the outbox. Keyed by (pending row's end, unless completed).
GRANT_TAKEOVER: Mapping[tuple[str, bool], LiteralString] = {
    ("", False): _TAKEOVER + _DISPLACED + _SELECT_GRANTED_BEFORE,
    ("", True): _TAKEOVER_UC + _DISPLACED + _SELECT_GRANTED_BEFORE,
    ("end", False): _TAKEOVER + _DISPLACED + _END_PENDING + _SELECT_GRANTED_BEFORE,
    ("end", True): _TAKEOVER_UC + _DISPLACED + _END_PENDING + _SELECT_GRANTED_BEFORE,
    ("stamp", False): _TAKEOVER + _DISPLACED + _STAMP_PENDING + _SELECT_GRANTED_BEFORE,
    ("stamp", True): _TAKEOVER_UC + _DISPLACED + _STAMP_PENDING + _SELECT_GRANTED_BEFORE,
}

_HOLDER: LiteralString = (
    """WITH holder AS (
        SELECT id, token, owner, expires_at,
               GREATEST(EXTRACT(EPOCH FROM expires_at - statement_timestamp()), 0)::float8
                   AS remaining
        FROM celery_fenced_lease WHERE key = %(key)s
          AND (%(last)s::boolean
               OR (released_at IS NULL AND expires_at > statement_timestamp()))),
    ev AS (
        """
    + EVENT_INSERT
    + """
        SELECT id, 'busy', token, %(task_id)s, %(owner)s, statement_timestamp(),
               jsonb_build_object('holder', owner)
        FROM holder)"""
)

# -- name: busy --
# The busy event, with the key's holder (any row when ``%(last)s``, else only a held
# one: none and the grant is tried again). Keyed by whether the job's pending row, not
# started, ends too.
BUSY: Mapping[bool, LiteralString] = {
    False: _HOLDER + "\n    SELECT token, owner, expires_at, remaining FROM holder",
    True: _HOLDER
    + """,
    pend AS (DELETE FROM celery_fenced_pendingjob WHERE task_id = %(task_id)s
             AND nesting <= %(nesting)s AND started_token IS NULL
             AND EXISTS (SELECT 1 FROM holder))
    SELECT token, owner, expires_at, remaining FROM holder""",
}

#: the name of permit ``g`` of the key (:func:`celery_fenced.permits.permit_key`)
_PERMIT_NAME: LiteralString = "%(key)s::text || chr(31) || g::text"
#: the names of the key's first ``%(limit)s`` permits, made by the statement: the plans
#: made for a statement's values count as many names as its generic plan does, so
#: PostgreSQL keeps the generic plan (given as a parameter, a small limit's few names
#: made those plans look so much cheaper that the grant was planned again at every run)
_NAMES: LiteralString = (
    "ARRAY(SELECT " + _PERMIT_NAME + " FROM generate_series(0, %(limit)s - 1) g)"
)
#: the names of the permits above a lowered limit (``%(limit)s`` and up: the head keeps
#: the highest limit ever asked), read from the head only when it has any
_ABOVE: LiteralString = (
    "SELECT "
    + _PERMIT_NAME
    + " FROM head h, generate_series(%(limit)s, h.permits - 1) g WHERE h.permits > %(limit)s"
)
_PERMIT_COMPLETED: LiteralString = (
    """
          AND NOT EXISTS ("""
    + _COMPLETED
    + """)
          AND NOT EXISTS (SELECT 1 FROM celery_fenced_lease l
                          WHERE l.key = ANY(ARRAY[%(key)s::text] || """
    + _NAMES
    + """
                                            || ARRAY("""
    + _ABOVE
    + """))
                            AND """
    + _MARKED
    + ")"
)
# the first ``%(limit)s`` permits' names (``_NAMES``): the statement plans as a few index
# lookups. ``free``: the permits this job may take, as the snapshot
# shows them (read once: the statement's answer when it grants none, ``_PERMIT_OR_LOST``)
_PERMIT_START: LiteralString = (
    """WITH clock AS MATERIALIZED (  -- read after the snapshot
        SELECT clock_timestamp() AS now),
    head AS (
        SELECT token, permits FROM celery_fenced_lease
        WHERE key = %(key)s AND permits >= %(limit)s AND released_at IS NOT NULL),
    free AS MATERIALIZED (
        SELECT p.id FROM celery_fenced_lease p
        WHERE p.key = ANY("""
    + _NAMES
    + """) AND EXISTS (SELECT 1 FROM head)
          AND """
)
_PERMIT_ABOVE: LiteralString = (
    """
          AND NOT EXISTS (  -- a holder of a permit above a lowered limit
              SELECT 1 FROM celery_fenced_lease x
              WHERE x.key IN ("""
    + _ABOVE
    + """)
                AND (x.released_at IS NULL) IS TRUE
                AND x.expires_at > statement_timestamp())"""
)
#: a released permit (the routine grant) or an expired one too (the takeover)
_PERMIT_RELEASED: LiteralString = "p.released_at IS NOT NULL"
_PERMIT_FREE: LiteralString = (
    "(p.released_at IS NOT NULL OR p.expires_at <= statement_timestamp())"
)
_PERMIT_HEAD: LiteralString = _PERMIT_START + _PERMIT_FREE + _PERMIT_ABOVE
#: the routine grant leaves a lowered limit (the head has more permits) to the takeover's
#: statement, and plans without its check
_PERMIT_ROUTINE_HEAD: LiteralString = (
    _PERMIT_START + _PERMIT_RELEASED + "\n          AND (SELECT permits FROM head) = %(limit)s"
)
#: the end of ``free``, and ``pick``: one of them locked, its row checked again at its
#: latest version (the condition that follows)
_PERMIT_NOT_HELD: LiteralString = """
          AND NOT EXISTS (  -- this job holds another permit of the key
              SELECT 1 FROM celery_fenced_lease s
              WHERE s.permit_job = md5(%(key)s::text || chr(31) || %(task_id)s::text)
                AND (s.released_at IS NULL) IS TRUE AND s.id <> p.id)),
    pick AS (
        SELECT p.id FROM celery_fenced_lease p
        WHERE p.id IN (SELECT f.id FROM free f)
          AND """
#: the new grant's columns every permit grant sets
_PERMIT_SET: LiteralString = """
            token = (SELECT token FROM head) + nextval('celery_fenced_permit_token'),
            owner = %(owner)s, task_id = %(task_id)s::text, task_name = %(task_name)s,
            acquired_at = (SELECT now FROM clock),
            renewed_at = (SELECT now FROM clock),
            expires_at = (SELECT now FROM clock) + (%(ttl)s)::float8 * interval '1 second',
            released_at = NULL,
            release_state = '',
            job = %(job)s,
            reclaim_state = '',
            permit_job = CASE WHEN %(task_id)s::text <> ''
                         THEN md5(%(key)s::text || chr(31) || %(task_id)s::text) END,"""
#: the row as this statement's snapshot read it: not a grant, nor a completing release,
#: committed since
_PERMIT_UNCHANGED: LiteralString = """
          AND l.xmin = (SELECT s.xmin FROM celery_fenced_lease s WHERE s.id = pick.id)
        RETURNING l.id, l.token, l.expires_at, l.reclaimed_from, l.completed_digest, l.key)"""
#: one row when the snapshot shows a permit this job may take (none: none free, the job
#: completed, or it holds another): the grant's, or NULLs when another statement locked
#: that permit first (``SKIP LOCKED``) or changed it since the snapshot
#: (``_PERMIT_UNCHANGED``) — a new statement (a new snapshot) may find one free
_PERMIT_OR_LOST: LiteralString = """
    FROM (SELECT FROM free LIMIT 1) f LEFT JOIN granted g ON true"""
#: the routine grant: the lowest released permit, no takeover (so no displaced job), its
#: ``acquired`` event only with routine events
_PERMIT_ROUTINE_GRANT: LiteralString = (
    _PERMIT_NOT_HELD
    + _PERMIT_RELEASED
    + """
        ORDER BY p.id
        LIMIT 1 FOR UPDATE SKIP LOCKED),
    granted AS (
        UPDATE celery_fenced_lease l SET"""
    + _PERMIT_SET
    + """
            reclaimed_from = '', reclaim_attempts = 0, reclaim_claimed_at = NULL
        FROM pick WHERE l.id = pick.id AND l.released_at IS NOT NULL"""
    + _PERMIT_UNCHANGED
)
_PERMIT_ACQUIRED: LiteralString = (
    """,
    ev AS (
        """
    + EVENT_INSERT
    + """
        SELECT g.id, 'acquired', g.token, %(task_id)s::text, %(owner)s, (SELECT now FROM clock),
               '{}'::jsonb
        FROM granted g)"""
)
_PERMIT_GRANT: LiteralString = (
    _PERMIT_NOT_HELD
    + _PERMIT_FREE
    + """
        -- this job's own expired permit, else a released one before an expired one (a
        -- paused holder is not displaced while one is free)
        ORDER BY (p.released_at IS NULL AND p.task_id = %(task_id)s::text) DESC,
                 p.released_at IS NULL, p.id
        LIMIT 1 FOR UPDATE SKIP LOCKED),
    granted AS (
        UPDATE celery_fenced_lease l SET
            token = (SELECT token FROM head) + nextval('celery_fenced_permit_token'),
            owner = %(owner)s, task_id = %(task_id)s::text, task_name = %(task_name)s,
            acquired_at = (SELECT now FROM clock),
            renewed_at = (SELECT now FROM clock),
            expires_at = (SELECT now FROM clock) + (%(ttl)s)::float8 * interval '1 second',
            released_at = NULL,
            release_state = '',
            reclaimed_from = CASE WHEN l.released_at IS NULL THEN l.owner ELSE '' END,
            job = %(job)s,
            reclaim_attempts = CASE WHEN l.released_at IS NULL
                                         AND l.task_id = %(task_id)s::text AND l.task_id <> ''
                               THEN l.reclaim_attempts ELSE 0 END,
            reclaim_state = '',
            reclaim_claimed_at = CASE WHEN l.released_at IS NULL
                                           AND l.task_id = %(task_id)s::text
                                           AND l.task_id <> ''
                                 THEN l.reclaim_claimed_at END,
            permit_job = CASE WHEN %(task_id)s::text <> ''
                         THEN md5(%(key)s::text || chr(31) || %(task_id)s::text) END
        FROM pick WHERE l.id = pick.id
          AND (l.released_at IS NOT NULL OR l.expires_at <= statement_timestamp())
          -- the row as this statement's snapshot read it: not a grant, nor a completing
          -- release, committed since
          AND l.xmin = (SELECT s.xmin FROM celery_fenced_lease s WHERE s.id = pick.id)
        RETURNING l.id, l.token, l.expires_at, l.reclaimed_from, l.completed_digest, l.key),
    ev AS (
        """
    + EVENT_INSERT
    + """
        SELECT g.id, CASE WHEN g.reclaimed_from = '' THEN 'acquired' ELSE 'reclaimed' END,
               g.token, %(task_id)s::text, %(owner)s, (SELECT now FROM clock),
               CASE WHEN g.reclaimed_from = '' THEN '{}'::jsonb ELSE
               jsonb_build_object('previous_owner', g.reclaimed_from,
                                  'previous_token', p.token,
                                  'previous_acquired_at', p.acquired_at) END
        FROM granted g JOIN celery_fenced_lease p ON p.id = g.id
        WHERE g.reclaimed_from <> '' OR %(routine_events)s)"""
    + _DISPLACED_BY_ID
)
_PERMIT_SELECT: LiteralString = (
    """
    SELECT g.id, g.token, g.expires_at, g.reclaimed_from, g.completed_digest, g.key,
           (SELECT p.expires_at FROM celery_fenced_lease p WHERE p.id = g.id)"""
    + _PERMIT_OR_LOST
)
_PERMIT: LiteralString = _PERMIT_HEAD + _PERMIT_GRANT
_PERMIT_UC: LiteralString = _PERMIT_HEAD + _PERMIT_COMPLETED + _PERMIT_GRANT

# -- name: grant_permit --
# A free permit of the key (``%(limit)s`` of them), its event, the displaced job to the
# outbox; the token the head's floor plus the sequence's next value, the times the clock
# read once after the snapshot. Keyed by (pending row's end, unless completed).
GRANT_PERMIT: Mapping[tuple[str, bool], LiteralString] = {
    ("", False): _PERMIT + _PERMIT_SELECT,
    ("", True): _PERMIT_UC + _PERMIT_SELECT,
    ("end", False): _PERMIT + _END_PENDING + _PERMIT_SELECT,
    ("end", True): _PERMIT_UC + _END_PENDING + _PERMIT_SELECT,
    ("stamp", False): _PERMIT + _STAMP_PENDING + _PERMIT_SELECT,
    ("stamp", True): _PERMIT_UC + _STAMP_PENDING + _PERMIT_SELECT,
}

_PERMIT_ROUTINE_SELECT: LiteralString = (
    """
    SELECT g.id, g.token, g.expires_at, g.reclaimed_from, g.completed_digest, g.key,
           NULL::timestamptz"""
    + _PERMIT_OR_LOST
)
_PERMIT_ROUTINE: LiteralString = _PERMIT_ROUTINE_HEAD + _PERMIT_ROUTINE_GRANT
_PERMIT_ROUTINE_UC: LiteralString = (
    _PERMIT_ROUTINE_HEAD + _PERMIT_COMPLETED + _PERMIT_ROUTINE_GRANT
)

# -- name: grant_permit_routine --
# :data:`GRANT_PERMIT` for a released permit only: no takeover, so neither its event nor a
# displaced job, and the events table opened only with routine events (the cheaper
# statement, planned in a fraction of the time; most grants). Keyed by (routine events,
# pending row's end, unless completed).
GRANT_PERMIT_ROUTINE: Mapping[tuple[bool, str, bool], LiteralString] = {
    (False, "", False): _PERMIT_ROUTINE + _PERMIT_ROUTINE_SELECT,
    (False, "", True): _PERMIT_ROUTINE_UC + _PERMIT_ROUTINE_SELECT,
    (False, "end", False): _PERMIT_ROUTINE + _END_PENDING + _PERMIT_ROUTINE_SELECT,
    (False, "end", True): _PERMIT_ROUTINE_UC + _END_PENDING + _PERMIT_ROUTINE_SELECT,
    (False, "stamp", False): _PERMIT_ROUTINE + _STAMP_PENDING + _PERMIT_ROUTINE_SELECT,
    (False, "stamp", True): _PERMIT_ROUTINE_UC + _STAMP_PENDING + _PERMIT_ROUTINE_SELECT,
    (True, "", False): _PERMIT_ROUTINE + _PERMIT_ACQUIRED + _PERMIT_ROUTINE_SELECT,
    (True, "", True): _PERMIT_ROUTINE_UC + _PERMIT_ACQUIRED + _PERMIT_ROUTINE_SELECT,
    (True, "end", False): _PERMIT_ROUTINE
    + _PERMIT_ACQUIRED
    + _END_PENDING
    + _PERMIT_ROUTINE_SELECT,
    (True, "end", True): _PERMIT_ROUTINE_UC
    + _PERMIT_ACQUIRED
    + _END_PENDING
    + _PERMIT_ROUTINE_SELECT,
    (True, "stamp", False): _PERMIT_ROUTINE
    + _PERMIT_ACQUIRED
    + _STAMP_PENDING
    + _PERMIT_ROUTINE_SELECT,
    (True, "stamp", True): _PERMIT_ROUTINE_UC
    + _PERMIT_ACQUIRED
    + _STAMP_PENDING
    + _PERMIT_ROUTINE_SELECT,
}

# -- name: permit_token --
# A permit's token: the head's floor (``%(floor)s``) plus the sequence's next value.
PERMIT_TOKEN: LiteralString = "SELECT %(floor)s + nextval('celery_fenced_permit_token')"

# -- name: estimated_rows --
# The planner's estimate of ``%(table)s``'s rows (a quoted name).
ESTIMATED_ROWS: LiteralString = "SELECT reltuples FROM pg_class WHERE oid = to_regclass(%(table)s)"

# -- fragments: the release (``r``) and what goes with it -----------------------------------
_RELEASE_WHERE: LiteralString = """
        WHERE key = %(key)s AND token = %(token)s
          AND (%(only_owner)s::text IS NULL OR owner = %(only_owner)s::text)
          AND (released_at IS NULL) IS TRUE
        RETURNING id, token)"""
_RELEASE: LiteralString = (
    """WITH r AS (
        UPDATE celery_fenced_lease SET released_at = statement_timestamp(), job = NULL,
            release_state = %(state)s"""
    + _RELEASE_WHERE
)
_RELEASE_COMPLETING: LiteralString = (
    """WITH r AS (
        UPDATE celery_fenced_lease SET released_at = statement_timestamp(), job = NULL,
            release_state = %(state)s,
            completed_digest = %(digest)s::text, completed_retries = %(retries)s,
            completed_at = statement_timestamp()"""
    + _RELEASE_WHERE
)
#: a completing release that moves the marker it replaces (another job's, read from the
#: snapshot) to ``Completion``
_RELEASE_MOVING: LiteralString = (
    """WITH old AS (SELECT completed_digest, completed_retries, completed_at
                FROM celery_fenced_lease WHERE key = %(key)s),
    r AS (
        UPDATE celery_fenced_lease SET released_at = statement_timestamp(), job = NULL,
            release_state = %(state)s,
            completed_digest = %(digest)s::text, completed_retries = %(retries)s,
            completed_at = statement_timestamp()"""
    + _RELEASE_WHERE
    + """,
    moved AS (
        INSERT INTO celery_fenced_completion (digest, retries, completed_at)
        SELECT o.completed_digest, o.completed_retries, o.completed_at
        FROM old o, r WHERE o.completed_digest NOT IN ('', %(digest)s::text))"""
)
_RELEASE_EVENT: LiteralString = (
    """,
    ev AS (
        """
    + EVENT_INSERT
    + """
        SELECT id, 'released', token, %(task_id)s, %(owner)s, statement_timestamp(),
               (%(detail)s)::jsonb
        FROM r)"""
)
#: the result lock of ``%(lock)s`` (see ``lock_for_result``), taken only if released
_RESULT_LOCK: LiteralString = (
    ",\n    lk AS (SELECT pg_advisory_xact_lock(hashtextextended(%(lock)s, 0)) FROM r)"
)
#: the task's result row (``%(result_<column>)s``), written under the result lock
_RESULT_WRITE: LiteralString = (
    _RESULT_LOCK
    + """,
    res AS (
        INSERT INTO django_celery_results_taskresult """
    + RESULT_COLUMNS
    + """
        SELECT %(result_task_id)s, %(result_periodic_task_name)s, %(result_task_name)s,
               %(result_task_args)s, %(result_task_kwargs)s, %(result_status)s,
               %(result_worker)s, %(result_content_type)s, %(result_content_encoding)s,
               %(result_result)s, %(result_date_created)s, %(result_date_started)s,
               %(result_date_done)s, %(result_traceback)s, %(result_meta)s
        FROM lk
        ON CONFLICT (task_id) DO UPDATE SET """
    + RESULT_UPDATE
    + ")"
)
_SELECT_RELEASED: LiteralString = "\n    SELECT r.token FROM r"
_SELECT_RELEASED_LOCKED: LiteralString = "\n    SELECT r.token FROM r, lk"

# -- name: release --
# Release the grant (only ``%(only_owner)s``'s, when given) in state ``%(state)s``, with
# its completion marker (``%(digest)s``, ``%(retries)s``), and the ``released`` event
# (``%(detail)s``) with routine events. Keyed by (the marker: "" | "complete" | "move",
# the event, the result: "" | "lock" | "write").
RELEASE: Mapping[tuple[str, bool, str], LiteralString] = {
    ("", False, ""): _RELEASE + _SELECT_RELEASED,
    ("", True, ""): _RELEASE + _RELEASE_EVENT + _SELECT_RELEASED,
    ("complete", False, ""): _RELEASE_COMPLETING + _SELECT_RELEASED,
    ("complete", True, ""): _RELEASE_COMPLETING + _RELEASE_EVENT + _SELECT_RELEASED,
    ("move", False, ""): _RELEASE_MOVING + _SELECT_RELEASED,
    ("move", True, ""): _RELEASE_MOVING + _RELEASE_EVENT + _SELECT_RELEASED,
    ("", False, "lock"): _RELEASE + _RESULT_LOCK + _SELECT_RELEASED_LOCKED,
    ("", True, "lock"): _RELEASE + _RELEASE_EVENT + _RESULT_LOCK + _SELECT_RELEASED_LOCKED,
    ("complete", False, "lock"): _RELEASE_COMPLETING + _RESULT_LOCK + _SELECT_RELEASED_LOCKED,
    ("complete", True, "lock"): _RELEASE_COMPLETING
    + _RELEASE_EVENT
    + _RESULT_LOCK
    + _SELECT_RELEASED_LOCKED,
    ("move", False, "lock"): _RELEASE_MOVING + _RESULT_LOCK + _SELECT_RELEASED_LOCKED,
    ("move", True, "lock"): _RELEASE_MOVING
    + _RELEASE_EVENT
    + _RESULT_LOCK
    + _SELECT_RELEASED_LOCKED,
    ("", False, "write"): _RELEASE + _RESULT_WRITE + _SELECT_RELEASED_LOCKED,
    ("", True, "write"): _RELEASE + _RELEASE_EVENT + _RESULT_WRITE + _SELECT_RELEASED_LOCKED,
    ("complete", False, "write"): _RELEASE_COMPLETING + _RESULT_WRITE + _SELECT_RELEASED_LOCKED,
    ("complete", True, "write"): _RELEASE_COMPLETING
    + _RELEASE_EVENT
    + _RESULT_WRITE
    + _SELECT_RELEASED_LOCKED,
    ("move", False, "write"): _RELEASE_MOVING + _RESULT_WRITE + _SELECT_RELEASED_LOCKED,
    ("move", True, "write"): _RELEASE_MOVING
    + _RELEASE_EVENT
    + _RESULT_WRITE
    + _SELECT_RELEASED_LOCKED,
}

# -- name: force_release --
# Release the key's grant whoever holds it (only ``%(task_id)s``'s, or only token
# ``%(token)s``, when given), with its event (by ``%(by)s``).
FORCE_RELEASE: LiteralString = (
    """WITH r AS (
        UPDATE celery_fenced_lease SET released_at = statement_timestamp(), job = NULL
        WHERE key = %(key)s AND (released_at IS NULL) IS TRUE
          AND (%(task_id)s::text IS NULL OR task_id = %(task_id)s::text)
          AND (%(token)s::bigint IS NULL OR token = %(token)s::bigint)
        RETURNING id, token, owner, task_id, acquired_at),
    ev AS (
        """
    + EVENT_INSERT
    + """
        SELECT id, 'force_released', token, task_id, owner, statement_timestamp(),
               jsonb_build_object('by', %(by)s::text, 'acquired_at', acquired_at)
        FROM r)
    SELECT token, owner FROM r"""
)

# -- name: lock_for_result --
# A transaction-scoped advisory lock named ``%(lock)s`` (the task's row may not exist yet).
LOCK_FOR_RESULT: LiteralString = "SELECT pg_advisory_xact_lock(hashtextextended(%(lock)s, 0))"

# -- name: prove_current --
# The key's row locked: its token, and whether that grant is held.
PROVE_CURRENT: LiteralString = """SELECT token,
        released_at IS NULL AND expires_at > statement_timestamp()
    FROM celery_fenced_lease WHERE key = %(key)s FOR UPDATE"""

_ELIGIBLE: LiteralString = """released_at IS NULL AND job IS NOT NULL
        AND expires_at < (statement_timestamp() - (%(grace)s)::float8 * interval '1 second')
        AND (reclaim_state = '' OR (reclaim_state = 'resent' AND reclaim_claimed_at
             < (statement_timestamp() - (%(resend_after)s)::float8 * interval '1 second')))"""

# -- name: claim --
# Claim up to ``%(limit)s`` grants expired ``%(grace)s`` ago with a job (concurrent
# reclaimers take different rows): re-sent, or abandoned past ``%(max)s`` attempts, with
# the ``abandoned`` events (``%(reason)s``). The condition is repeated outside the batch:
# a row a concurrent reclaimer claimed first is skipped.
CLAIM: LiteralString = (
    """WITH c AS (
    UPDATE celery_fenced_lease SET
        reclaim_attempts = CASE WHEN reclaim_attempts < %(max)s
                           THEN reclaim_attempts + 1 ELSE reclaim_attempts END,
        reclaim_state = CASE WHEN reclaim_attempts < %(max)s
                        THEN 'resent' ELSE 'abandoned' END,
        reclaim_claimed_at = statement_timestamp()
    WHERE id IN (SELECT id FROM celery_fenced_lease WHERE """
    + _ELIGIBLE
    + """
                 ORDER BY expires_at LIMIT %(limit)s FOR UPDATE SKIP LOCKED)
      AND """
    + _ELIGIBLE
    + CLAIM_RETURNING
    + """),
    ev AS (
        """
    + EVENT_INSERT
    + """
        SELECT id, 'abandoned', token, task_id, owner, statement_timestamp(),
               jsonb_build_object('task', task_name, 'attempts', reclaim_attempts,
                                  'max', %(max)s::int, 'reason', %(reason)s::text)
        FROM c WHERE reclaim_state = 'abandoned')
    SELECT * FROM c"""
)

#: a key's lease row before any grant (token 0, released): the key's SQL between them
_NEVER_GRANTED_HEAD: LiteralString = (
    "INSERT INTO celery_fenced_lease " + LEASE_COLUMNS + "\n        SELECT "
)
_NEVER_GRANTED_TAIL: LiteralString = """, 0, '', '', %(task_name)s, statement_timestamp(),
               statement_timestamp(), statement_timestamp(), statement_timestamp(), '',
               NULL, 0, '', NULL, '', '', 0"""

_UNTIL_DONE_ENDED: LiteralString = """(p.abandoned_at IS NOT NULL
        OR (p.expires_at <= statement_timestamp() AND p.started_token IS NULL)
        OR (p.started_token IS NOT NULL AND EXISTS (
            SELECT 1 FROM celery_fenced_lease l WHERE l.key = p.key
            AND (l.token > p.started_token
                 OR (l.token = p.started_token
                     AND (l.released_at IS NOT NULL
                          OR l.expires_at <= statement_timestamp()))))))"""
_UNTIL_STARTED_ENDED: LiteralString = """(p.abandoned_at IS NOT NULL
        OR (p.expires_at <= statement_timestamp() AND p.started_token IS NULL)
        OR p.started_token IS NOT NULL)"""

_RECORD_UNIQUE_HEAD: LiteralString = (
    """WITH ins AS (
    INSERT INTO celery_fenced_pendingjob """
    + PENDING_COLUMNS
    + """
    VALUES (%(task_id)s, %(task_name)s, %(key)s, %(job)s, statement_timestamp(),
        COALESCE(%(eta_at)s, statement_timestamp()
                             + (%(eta_in)s)::float8 * interval '1 second'),
        COALESCE(%(expires_at)s, statement_timestamp()
                                 + (%(expires_in)s)::float8 * interval '1 second'),
        COALESCE(%(resend_at)s, statement_timestamp()
                                + (%(resend_in)s)::float8 * interval '1 second'),
        0, %(unsent)s, NULL, '', %(unique_key)s, %(unique_until)s, NULL, %(plain)s,
        %(nesting)s)
    ON CONFLICT DO NOTHING RETURNING task_id, key),
    head AS ("""
    + _NEVER_GRANTED_HEAD
    + "key"
    + _NEVER_GRANTED_TAIL
    + """ FROM ins
             ON CONFLICT (key) DO NOTHING),
    standing AS (
        SELECT p.task_id, COALESCE("""
)
_RECORD_UNIQUE_TAIL: LiteralString = (
    """, false) AS ended
        FROM celery_fenced_pendingjob p
        WHERE p.unique_key = %(key)s AND NOT EXISTS (SELECT 1 FROM ins)),
    refused AS (
        SELECT task_id FROM standing WHERE NOT ended AND task_id <> %(task_id)s),
    made AS ("""
    + _NEVER_GRANTED_HEAD
    + "%(key)s"
    + _NEVER_GRANTED_TAIL
    + """ FROM refused
        ON CONFLICT (key) DO NOTHING
        RETURNING id, token, owner),
    row AS (
        SELECT id, token, owner FROM made
        UNION ALL
        SELECT id, token, owner FROM celery_fenced_lease
        WHERE key = %(key)s AND EXISTS (SELECT 1 FROM refused)
          AND NOT EXISTS (SELECT 1 FROM made)),
    ev AS (
        """
    + EVENT_INSERT
    + """
        SELECT r.id, 'deduplicated', NULLIF(r.token, 0), f.task_id, '',
               statement_timestamp(),
               jsonb_build_object('refused_task_id', %(task_id)s::text,
                                  'task_name', %(full_task_name)s::text)
        FROM row r, refused f)
    SELECT true, task_id, NULL::boolean, NULL::bigint, NULL::text FROM ins
    UNION ALL
    SELECT false, s.task_id, s.ended, r.token, r.owner
    FROM standing s LEFT JOIN row r ON true"""
)

# -- name: record_unique_pending --
# A ``lease_unique`` copy's pending row, nothing on any conflict, and its key's lease row
# (token 0, never granted) in the same statement; refused (its key's copy stands), that
# copy's pending row read and — unless it has ended (abandoned, expired before it
# started, or (``until_done``) started under a grant that has ended, (``until_started``)
# started) or is this
# very job — the ``deduplicated`` event written on the key's lease row (created, token 0,
# if the standing copy has not started yet). One row: (recorded, task id, ended, the
# key's token, owner); none on a conflict on the task id alone. Keyed by the mode.
RECORD_UNIQUE_PENDING: Mapping[str, LiteralString] = {
    "until_done": _RECORD_UNIQUE_HEAD + _UNTIL_DONE_ENDED + _RECORD_UNIQUE_TAIL,
    "until_started": _RECORD_UNIQUE_HEAD + _UNTIL_STARTED_ENDED + _RECORD_UNIQUE_TAIL,
}

# -- name: delete_ended_copy --
# Delete key ``%(key)s``'s ``lease_unique`` copy's pending row if it has ended (as in
# ``record_unique_pending``). Keyed by the ``lease_unique`` mode.
DELETE_ENDED_COPY: Mapping[str, LiteralString] = {
    "until_done": "DELETE FROM celery_fenced_pendingjob p WHERE unique_key = %(key)s AND "
    + _UNTIL_DONE_ENDED
    + " RETURNING id",
    "until_started": "DELETE FROM celery_fenced_pendingjob p WHERE unique_key = %(key)s AND "
    + _UNTIL_STARTED_ENDED
    + " RETURNING id",
}
