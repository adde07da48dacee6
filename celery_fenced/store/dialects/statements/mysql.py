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
# The task's result row locked: made (then deleted again by ``delete_result``) when the
# task has none yet; an exclusive lock even on a duplicate.
LOCK_FOR_RESULT: LiteralString = """INSERT INTO django_celery_results_taskresult
      (task_id, status, content_type, content_encoding, date_created, date_done)
    VALUES (%(task_id)s, 'PENDING', '', '', CURRENT_TIMESTAMP(6), CURRENT_TIMESTAMP(6))
    ON DUPLICATE KEY UPDATE id = id"""

# -- name: delete_result --
# Delete the result row ``%(id)s`` (made by ``lock_for_result``).
DELETE_RESULT: LiteralString = "DELETE FROM django_celery_results_taskresult WHERE id = %(id)s"

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
