"""Reports of a task's outcome made outside its grant: whether they may be recorded."""

from __future__ import annotations

import logging
from typing import Any

from django.db import transaction

from celery_fenced import signals
from celery_fenced.models import Lease, LeaseEvent
from celery_fenced.store import dialects
from celery_fenced.store.outbox import mark_ended
from celery_fenced.store.types import Delivery
from celery_fenced.store.validation import database_alias

logger = logging.getLogger("celery_fenced.store")


def process_holds(task_id: str, process: str, *, using: str | None = None) -> bool:
    """Whether the pool process ``process`` (an owner prefix, ``host:boot:pid:``) holds an
    unreleased grant of ``task_id``."""
    grants = dialects.for_alias(database_alias(using)).task_grants(task_id)
    return any(owner.startswith(process) for _key, _token, owner, _live in grants)


def keep_for_outcome(task_id: str, process: str, *, using: str | None = None) -> bool:
    """Lock the pool process ``process``'s unreleased grants of ``task_id`` until the end of
    the caller's transaction; whether it still holds one. A takeover since (the grant had
    expired) makes it False; none can happen while the lock is held."""
    rows = (
        Lease._default_manager.using(database_alias(using))
        .select_for_update()
        .filter(task_id=task_id, released_at__isnull=True, owner__startswith=process)
        .values_list("pk", flat=True)
    )
    return bool(list(rows))


def settle_elsewhere(
    task_id: str,
    *,
    process: str | None,
    by: str,
    using: str | None = None,
    ending: Delivery | None = None,
    release: bool = True,
) -> bool:
    """Whether an outcome of ``task_id`` reported outside its grant may be recorded.

    For writes that carry no lease: the worker's main process reporting that the process
    ``process`` (an owner prefix, ``host:boot:pid:``, or one execution's owner, for a report
    made by the thread that ran the delivery; None for a delivery that never started)
    ended — a hard time limit, a lost pool child, a revoke — or a delivery that failed
    before its grant. That process's own live grant of ``task_id`` is ended (force-released:
    the next grant comes at once, and the old holder stays fenced out); no other grant is.
    Returns False while another execution holds a grant of ``task_id``: that execution
    owns the job's outcome, and this report must change nothing. For an execution that
    ran, any unreleased grant of another process counts (live, or expired and not yet
    taken over: this one was taken over, so it is stale); for a delivery that never
    started (``process`` None), only a live one: an expired grant's holder is gone or
    stale, and the expired message's ``REVOKED`` is the job's outcome until it comes back.
    Returns False too when the process holds no grant of ``task_id`` any more because
    another execution of it took its grant over: that one's outcome is the job's, even
    once it has ended (a second hard time limit's report would send the errbacks again).

    ``release=False`` decides and changes nothing: the process's grant is kept while its
    outcome is written, then ended by a second call with ``ending``, the delivery whose job
    that outcome ends (the FAILURE of a pool process that ended: the job's outcome, as its
    own FAILURE would be). ``ending`` is marked ended in the transaction that releases the
    grant, before the release, and in the outcome's own transaction where the result and
    lease databases are one: a copy of the message finds the key held until then, and a
    completed duplicate after — it could not run in between and turn the FAILURE into a
    SUCCESS after the errbacks went out, nor find the job marked ended with no outcome
    written (the reporting process stopped in between).
    """
    alias = database_alias(using)
    dialect = dialects.for_alias(alias)
    grants = dialect.task_grants(task_id)
    if (
        process is not None
        and not any(_owned_by(owner, process) for _, _, owner, _ in grants)
        and _taken_over_by_the_task(alias, task_id, process)
    ):
        logger.info(
            "task %s ended (%s) in %s, whose grant another execution of it took over: "
            "nothing recorded",
            task_id,
            by,
            process,
            extra={"task_id": task_id},
        )
        return False
    others = False
    for key, token, owner, live in grants:
        if process is None and not live:
            continue
        if process is not None and _owned_by(owner, process):
            if not release:
                continue
            ended = _release_ending(alias, dialect, key, by, task_id, token, ending)
            if ended is None and _taken_over_by_the_task(alias, task_id, process):
                # taken over between the read of its grants and the release
                logger.info(
                    "task %s ended (%s) in %s, whose grant another execution of it took "
                    "over: nothing recorded",
                    task_id,
                    by,
                    process,
                    extra={"task_id": task_id},
                )
                return False
            if ended is not None:
                ending = None  # marked with the release
                logger.info(
                    "task %s ended (%s): released its grant of %r (token %s)",
                    task_id,
                    by,
                    key,
                    token,
                    extra={"task_id": task_id, "lease_key": key, "fencing_token": token},
                )
                signals.send(
                    signals.lease_released,
                    Lease,
                    key=key,
                    token=token,
                    owner=owner,
                    task_id=task_id,
                    forced=True,
                )
        else:
            others = True
    if release and not others and ending is not None:  # its grant had ended already
        mark_ended(alias, ending)
    return not others


def _release_ending(
    alias: str,
    dialect: Any,
    key: str,
    by: str,
    task_id: str,
    token: int,
    ending: Delivery | None,
) -> Any:
    """Force-release ``token`` of ``key``, marking ``ending`` ended first in the same
    transaction (not at all when the release finds the grant gone)."""
    if ending is None:
        return dialect.force_release(key, by, task_id=task_id, token=token)
    with transaction.atomic(using=alias):
        mark_ended(alias, ending)
        ended = dialect.force_release(key, by, task_id=task_id, token=token)
        if ended is None:
            transaction.set_rollback(True, using=alias)
        return ended


def _owned_by(owner: str, process: str) -> bool:
    """Whether lease owner ``owner`` is ``process`` (an owner, or a ``host:boot:pid:`` prefix)."""
    return owner == process or (process.endswith(":") and owner.startswith(process))


def _taken_over_by_the_task(alias: str, task_id: str, process: str) -> bool:
    """Whether another process's execution of ``task_id`` took a grant of ``process``
    over (a ``reclaimed`` event, always recorded, names the grant's previous owner)."""
    takeovers = LeaseEvent._default_manager.using(alias).filter(
        kind=LeaseEvent.Kind.RECLAIMED, task_id=task_id
    )
    return any(
        _owned_by(str((detail or {}).get("previous_owner", "")), process)
        and not _owned_by(owner, process)
        for owner, detail in takeovers.values_list("owner", "detail")
    )
