"""MariaDB's and MySQL's statements (:class:`~celery_fenced.store.dialects.mysql.MySQL`).

Times are ``CURRENT_TIMESTAMP(6)``, to the microsecond (``CURRENT_TIMESTAMP`` alone is to
the second). Keys are compared in the ``key`` column's collation, through its unique
index.

The one exception to named parameters: ``LOCKED_ROWS`` and ``RENEW`` take a variable
number of rows. Their ``{rows}`` slot is filled, at call time, with their one row
(``*_ROW``, positional parameters) repeated once per row and joined by ``*_JOIN``
(:func:`~celery_fenced.store.dialects.mysql.repeated`): fixed text, never a value. A list
in one parameter (``JSON_TABLE``) would compare the keys in the JSON's collation (a
``_bin`` one wins over the column's) and lose the unique index.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from celery_fenced.store.dialects.statements.common import EVENT_INSERT

if TYPE_CHECKING:
    from collections.abc import Mapping

    from typing_extensions import LiteralString

# -- name: now --
# The database's clock.
SELECT_NOW: LiteralString = "SELECT CURRENT_TIMESTAMP(6)"

# -- name: record_pending --
# The outbox's row of a published job, started afresh on a re-publish of the task id: its
# ETA, expiry and resend time given (``*_at``) or relative to now (``*_us``
# microseconds; NULL: none).
RECORD_PENDING: LiteralString = """INSERT INTO celery_fenced_pendingjob
      (task_id, task_name, `key`, job, published_at, eta, expires_at, resend_at, sends,
       unsent, abandoned_at, abandoned_reason, unique_key, unique_until, started_token,
       plain, nesting)
    VALUES (%(task_id)s, %(task_name)s, %(key)s, %(job)s, CURRENT_TIMESTAMP(6),
        COALESCE(%(eta_at)s, CURRENT_TIMESTAMP(6) + INTERVAL %(eta_us)s MICROSECOND),
        COALESCE(%(expires_at)s,
                 CURRENT_TIMESTAMP(6) + INTERVAL %(expires_us)s MICROSECOND),
        COALESCE(%(resend_at)s, CURRENT_TIMESTAMP(6) + INTERVAL %(resend_us)s MICROSECOND),
        0, FALSE, NULL, '', NULL, '', NULL, %(plain)s, %(nesting)s)
    ON DUPLICATE KEY UPDATE task_name = VALUES(task_name), `key` = VALUES(`key`),
        job = VALUES(job), published_at = VALUES(published_at), eta = VALUES(eta),
        expires_at = VALUES(expires_at), resend_at = VALUES(resend_at), sends = 0,
        unsent = FALSE, abandoned_at = NULL, abandoned_reason = '', unique_key = NULL,
        unique_until = '', started_token = NULL, plain = VALUES(plain),
        nesting = VALUES(nesting)"""

# -- name: locked_row --
# The key's row locked, with the database's time.
LOCKED_ROW: LiteralString = """SELECT id, token, released_at, expires_at, CURRENT_TIMESTAMP(6)
    FROM celery_fenced_lease WHERE `key` = %(key)s FOR UPDATE"""

# -- name: locked_rows --
# The rows of the keys (``{rows}``: ``LOCKED_ROWS_ROW`` per key) locked, through the keys'
# unique index always: on a small table the optimizer scans the whole table instead,
# locking each row it reads (then deadlocks with a first grant inserting a row).
LOCKED_ROWS: LiteralString = """SELECT * FROM celery_fenced_lease
    FORCE INDEX (celery_fenced_lease_key_uniq)
    WHERE `key` IN ({rows}) FOR UPDATE"""
LOCKED_ROWS_ROW: LiteralString = "%s"
LOCKED_ROWS_JOIN: LiteralString = ", "

# -- name: lock_for_result --
# The task's result lock: the row of its bucket (65,536 of them, by CRC-32) in
# ``celery_fenced_result_lock``, made the first time and kept; a record lock only.
LOCK_FOR_RESULT: LiteralString = """INSERT INTO celery_fenced_result_lock (bucket)
    VALUES (CRC32(%(task_id)s) & 65535) ON DUPLICATE KEY UPDATE bucket = bucket"""

# -- name: renew --
# Renew the grants given (``{rows}``: ``RENEW_ROW`` per grant: key, token, owner, ttl in
# microseconds, and the time read before) still held.
RENEW: LiteralString = """UPDATE celery_fenced_lease l JOIN ({rows}) v
      ON l.`key` = v.k AND l.token = v.t AND l.owner = v.o
    SET l.renewed_at = v.now, l.expires_at = v.now + INTERVAL v.us MICROSECOND
    WHERE l.released_at IS NULL AND l.expires_at > v.now"""
RENEW_ROW: LiteralString = (
    "SELECT %s AS k, %s AS t, %s AS o, %s AS us, CAST(%s AS DATETIME(6)) AS now"
)
RENEW_JOIN: LiteralString = " UNION ALL "

# -- name: renewed --
# The grants ``renew`` renewed (``{rows}`` as there), by their new ``renewed_at``.
RENEWED: LiteralString = """SELECT l.`key`, l.token, l.expires_at
    FROM celery_fenced_lease l JOIN ({rows}) v
      ON l.`key` = v.k AND l.token = v.t AND l.owner = v.o
    WHERE l.renewed_at = v.now AND l.released_at IS NULL"""

# -- name: share_lock --
# The key's row share-locked (before its event: see ``MySQL.record_event``).
SHARE_LOCK: LiteralString = (
    "SELECT id FROM celery_fenced_lease WHERE `key` = %(key)s LOCK IN SHARE MODE"
)

# -- name: insert_event --
# An event of the lease row ``%(lease_id)s``.
INSERT_EVENT: LiteralString = (
    EVENT_INSERT
    + """
    VALUES (%(lease_id)s, %(kind)s, %(token)s, %(task_id)s, %(owner)s, CURRENT_TIMESTAMP(6),
            %(detail)s)"""
)

# -- name: release --
# Release the grant of ``%(key)s`` with token ``%(token)s`` held by ``%(owner)s``, in state
# ``%(state)s``: a release that neither completes a job nor records an event (the
# affected-row count tells whether the grant was still held).
RELEASE: LiteralString = """UPDATE celery_fenced_lease
    SET released_at = CURRENT_TIMESTAMP(6), job = NULL, release_state = %(state)s
    WHERE `key` = %(key)s AND token = %(token)s AND owner = %(owner)s
      AND released_at IS NULL"""

# -- name: grant_permit --
# MariaDB: a released permit of the key granted (its rows' keys are ``%(first)s`` and up,
# below ``%(after)s``: the key and the separator, the key and the byte after it), when the
# key's head has exactly ``%(limit)s`` permits (so no permit row above them) and this job
# (``%(permit_job)s``, NULL for none) holds none of them (nor completed them: keyed by
# whether the grant looks). The permit row is the one row locked: the first free one in
# the key index's order, where the scan stops (``SKIP LOCKED``: one another acquirer holds
# is passed over; the head and the other subqueries are plain reads). Its token is the
# head's floor plus the sequence's next value; its times the clock read once the row is
# locked (``SYSDATE(6)``: a release committed before is seen, and the grant does not start
# before it). The ``INSERT`` of an existing key
# updates that row (``ON DUPLICATE KEY UPDATE``) and hands it back (``RETURNING``:
# MariaDB's ``UPDATE`` has none). The duplicate is always found on the keys' unique
# index: the server checks a unique index of NOT NULL columns before one of nullable
# columns, the unreleased permits' jobs' (a virtual column). A delivery of the same job
# granted another permit meanwhile makes the update break that index (IntegrityError):
# it never updates the other permit's row.
_PERMIT_INSERT: LiteralString = """INSERT INTO celery_fenced_lease
      (`key`, token, owner, task_id, task_name, acquired_at, renewed_at, expires_at,
       released_at, reclaimed_from, job, reclaim_attempts, reclaim_state,
       reclaim_claimed_at, completed_digest, release_state, permits, permit_job)
    SELECT p.`key`, h.token + NEXTVAL(celery_fenced_permit_token), %(owner)s, %(task_id)s,
           %(task_name)s, p.now, p.now, p.now + INTERVAL %(us)s MICROSECOND, NULL, '',
           %(job)s, 0, '', NULL, '', '', 0, %(permit_job)s
    FROM (SELECT l.`key`, SYSDATE(6) AS now
          FROM celery_fenced_lease l FORCE INDEX (celery_fenced_lease_key_uniq)
          WHERE l.`key` >= %(first)s AND l.`key` < %(after)s AND l.released_at IS NOT NULL
          ORDER BY l.`key` LIMIT 1 FOR UPDATE SKIP LOCKED) p
    JOIN (SELECT token FROM celery_fenced_lease
          WHERE `key` = %(key)s AND permits = %(limit)s AND released_at IS NOT NULL) h
"""
_PERMIT_NOT_HELD: LiteralString = """    WHERE (%(permit_job)s IS NULL OR NOT EXISTS (
        SELECT 1 FROM celery_fenced_lease s
        WHERE s.permit_job_unreleased = %(permit_job)s))
"""
#: the job (``%(digest)s``, ``%(retries)s``) not completed within the last ``%(window_us)s``
#: microseconds, under the key or any of its permits, nor moved to ``Completion``
_PERMIT_NOT_COMPLETED: LiteralString = """      AND NOT EXISTS (
        SELECT 1 FROM celery_fenced_lease m
        WHERE (m.`key` = %(key)s OR (m.`key` >= %(first)s AND m.`key` < %(after)s))
          AND m.completed_digest = %(digest)s AND m.completed_retries >= %(retries)s
          AND m.completed_at > CURRENT_TIMESTAMP(6) - INTERVAL %(window_us)s MICROSECOND)
      AND NOT EXISTS (
        SELECT 1 FROM celery_fenced_completion c
        WHERE c.digest = %(digest)s AND c.retries >= %(retries)s
          AND c.completed_at > CURRENT_TIMESTAMP(6) - INTERVAL %(window_us)s MICROSECOND)
"""
_PERMIT_GRANTED: LiteralString = """    ON DUPLICATE KEY UPDATE
        token = VALUES(token), owner = VALUES(owner),
        task_id = VALUES(task_id), task_name = VALUES(task_name),
        acquired_at = VALUES(acquired_at), renewed_at = VALUES(renewed_at),
        expires_at = VALUES(expires_at), released_at = NULL, reclaimed_from = '',
        job = VALUES(job), reclaim_attempts = 0, reclaim_state = '',
        reclaim_claimed_at = NULL, release_state = '', permit_job = VALUES(permit_job)
    RETURNING id, token, expires_at, completed_digest, `key`"""
#: keyed by whether the grant looks for a completed duplicate first
GRANT_PERMIT: Mapping[bool, LiteralString] = {
    False: _PERMIT_INSERT + _PERMIT_NOT_HELD + _PERMIT_GRANTED,
    True: _PERMIT_INSERT + _PERMIT_NOT_HELD + _PERMIT_NOT_COMPLETED + _PERMIT_GRANTED,
}

# -- name: permit_token --
# MariaDB: a permit's token, the head's floor (``%(floor)s``) plus the sequence's next value.
PERMIT_TOKEN: LiteralString = "SELECT %(floor)s + NEXTVAL(celery_fenced_permit_token)"
