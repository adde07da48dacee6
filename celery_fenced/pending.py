"""The outbox's sweep: send again the pending jobs that no worker granted.

A job recorded at publish (:mod:`celery_fenced.outbox`) keeps its pending row until a
worker's grant deletes it. A row that no worker granted ``fenced_outbox_resend_after``
seconds past its ETA (or its last sending) is claimed here and handed to
:mod:`celery_fenced.resend`, which sends it again with the same task id: a job lost by
the broker still runs, once. The periodic task ``celery_fenced.reclaim`` runs this sweep
after the reclaimer's.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any

from django.utils import timezone

from celery_fenced import jobs, resend, store
from celery_fenced.jobs import PLAIN_HEADER
from celery_fenced.resend import Resent

if TYPE_CHECKING:
    from celery import Celery

    from celery_fenced.jobs import Job

__all__ = ["Resent", "resend_pending"]

logger = logging.getLogger("celery_fenced.outbox")


def resend_pending(
    app: Celery | None = None, *, using: str | None = None, limit: int = 100
) -> list[Resent]:
    """Send again every pending job due (``fenced_outbox_resend_after`` past its ETA or
    its last sending) with its task id; abandon it after ``fenced_reclaim_max`` sendings.

    Expired jobs (``expires`` passed ``fenced_outbox_resend_after`` ago, never started)
    get their ``REVOKED`` outcome, never a sending. Each row is claimed by a
    conditional statement, so several reclaimers send each due job once.
    """
    app, settings, alias = resend.sweep_setup(app, limit, using)
    outcomes = [
        resend.revoke(app, ExpiredRow(alias, *row), None)
        for row in store.expired_rows(alias, limit, grace=settings.outbox_resend_after)
    ]

    def claim() -> tuple[list[resend.Claimed], bool]:
        claimed, more = store.claim_due(
            alias, resend_after=settings.outbox_resend_after, limit=limit
        )
        return [DueJob(alias, due, settings.reclaim_max) for due in claimed], more

    return outcomes + resend.sweep(app, claim)


class DueJob(resend.Claimed):
    """A pending job the sweep claimed: due, and never granted (no token, no owner)."""

    logger = logger
    exhausted_message = abandoned_message = (
        logging.ERROR,
        "pending job %(task_name)s[%(task_id)s] abandoned: %(reason)s",
    )
    unsent_message = (
        logging.WARNING,
        "pending job %(task_name)s[%(task_id)s]: could not send it again (%(exc)r); "
        "the next sweep retries",
    )
    resent_message = (
        logging.WARNING,
        "pending job %(task_name)s[%(task_id)s] was never started: sent again "
        "(attempt %(attempt)d of %(max)d)",
    )

    def __init__(self, alias: str, due: store.Due, max_sends: int) -> None:
        super().__init__(
            key=due.key,
            task_id=due.task_id,
            task_name=due.task_name,
            token=None,
            owner="",
            attempt=due.sends,
            job=due.job,
            max_sends=max_sends,
        )
        self.alias, self.due = alias, due

    def exhausted(self) -> str:
        if self.due.sends > self.max_sends:
            return f"never started after {self.max_sends} re-sends"
        return ""

    def send_options(self) -> dict[str, Any]:
        eta = self.due.eta
        return {"eta": eta} if eta is not None and eta > timezone.now() else {}

    def abandon(self, reason: str) -> None:
        store.abandon_pending(self.alias, self.due, reason)

    def unclaim(self) -> None:
        store.unclaim_due(self.alias, self.due)

    def sent(self, job: Job) -> None:
        if self.due.plain and not (job.options.get("headers") or {}).get(PLAIN_HEADER):
            store.forget_pending(self.alias, self.task_id)  # not held until started: sent, it ends


class ExpiredRow(resend.Claimed):
    """A pending job whose ``expires`` passed before any worker started it (its message
    lost, say): its ``REVOKED`` outcome is recorded, as the worker does when an expired
    message arrives (the result backend, the workflow it belongs to), then its row ends;
    never sent again."""

    logger = logger
    unrevoked_message = (
        logging.WARNING,
        "pending job %(task_name)s[%(task_id)s] expired: its REVOKED outcome could not be "
        "recorded (%(exc)s); the next sweep tries again",
    )
    revoked_message = (
        logging.INFO,
        "pending job %(task_name)s[%(task_id)s] expired before any worker started it: "
        "recorded REVOKED",
    )

    def __init__(self, alias: str, row_id: int, task_id: str, task_name: str, job: str) -> None:
        super().__init__(
            key="",
            task_id=task_id,
            task_name=task_name,
            token=None,
            owner="",
            attempt=0,
            job=job,
            max_sends=0,
        )
        self.alias, self.row_id = alias, row_id

    @property
    def extra(self) -> dict[str, Any]:
        return {"task_id": self.task_id}

    def end_revoked(self, app: Celery, job: Job | None) -> bool:
        recorded: Job | None = None
        with contextlib.suppress(ValueError):
            recorded = jobs.decode_job(self.job)
        resend.record_revoked(app, self.task_id, self.task_name, recorded)
        return True

    def revoked(self) -> None:
        store.forget_row(self.alias, self.row_id)
