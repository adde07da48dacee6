"""PostgreSQL's statements (:class:`~celery_fenced.store.dialects.postgresql.PostgreSQL`).

Times are ``statement_timestamp()``, plus or minus ``%(x)s::float8`` seconds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from celery_fenced.store.dialects.statements.common import (
    EVENT_INSERT,
    PENDING_COLUMNS,
    PENDING_RESET,
)

if TYPE_CHECKING:
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

# -- name: completed --
# Whether the delivery's job completed: the key's marker, or a ``Completion`` row.
COMPLETED: LiteralString = (
    """SELECT 1 FROM celery_fenced_lease l WHERE l.key = %(key)s
        AND l.completed_digest = %(digest)s AND l.completed_retries >= %(retries)s
        AND l.completed_at > """
    + _AGO_WINDOW
    + """
    UNION ALL
    SELECT 1 FROM celery_fenced_completion c
    WHERE c.digest = %(digest)s AND c.retries >= %(retries)s AND c.completed_at > """
    + _AGO_WINDOW
)

# -- name: renew --
# Renew the grants of ``%(leases)s`` (a JSON array of [key, token, owner, ttl]) still held.
RENEW: LiteralString = """WITH v(k, t, o, ttl) AS (
        SELECT e->>0, (e->>1)::bigint, e->>2, (e->>3)::float8
        FROM jsonb_array_elements((%(leases)s)::jsonb) e)
    UPDATE celery_fenced_lease SET renewed_at = statement_timestamp(),
        expires_at = statement_timestamp() + v.ttl * interval '1 second'
    FROM v
    WHERE celery_fenced_lease.key = v.k AND celery_fenced_lease.token = v.t
      AND celery_fenced_lease.owner = v.o AND celery_fenced_lease.released_at IS NULL
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
      AND released_at IS NULL AND expires_at > statement_timestamp()"""

# -- name: current_token --
# The key's current (or last) token.
CURRENT_TOKEN: LiteralString = "SELECT token FROM celery_fenced_lease WHERE key = %(key)s"
