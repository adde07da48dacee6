"""The lease table and its audit trail. Fields and constraints only: the store does the I/O."""

from __future__ import annotations

from typing import Any

import django
from django.db import models
from django.db.models import Q

KEY_MAX_LENGTH = 255
OWNER_MAX_LENGTH = 255
#: a permit's row is its key's, with a suffix no key can take (see celery_fenced.permits)
PERMIT_SUFFIX_ROOM = 8


def _check(condition: Q, name: str) -> models.CheckConstraint:
    # Django 5.1 renamed ``check=`` to ``condition=``; 4.2 only knows ``check=``.
    kwargs: dict[str, Any] = (
        {"condition": condition} if django.VERSION >= (5, 1) else {"check": condition}
    )
    return models.CheckConstraint(name=name, **kwargs)


class ReclaimState(models.TextChoices):
    NONE = "", "-"
    RESENT = "resent", "re-sent"
    ABANDONED = "abandoned", "abandoned"


class Lease(models.Model):
    """One row per job key: the current (or last) grant and its fencing token."""

    key = models.CharField(max_length=KEY_MAX_LENGTH + PERMIT_SUFFIX_ROOM)
    token = models.BigIntegerField(help_text="Fencing token of the current or last grant.")
    owner = models.CharField(max_length=OWNER_MAX_LENGTH)
    task_id = models.CharField(max_length=255, blank=True, default="")
    task_name = models.CharField(max_length=255, blank=True, default="")
    acquired_at = models.DateTimeField()
    renewed_at = models.DateTimeField()
    expires_at = models.DateTimeField()
    released_at = models.DateTimeField(null=True, blank=True)
    reclaimed_from = models.CharField(
        max_length=OWNER_MAX_LENGTH,
        blank=True,
        default="",
        help_text="Owner whose expired grant this grant took over ('' when the key was free).",
    )
    # Reclaim: what is needed to send the job again if its grant expires unfinished.
    # NULL (not "") is "nothing to re-send": the reclaimer's partial index skips it.
    job = models.TextField(  # noqa: DJ001
        null=True,
        blank=True,
        help_text="The job to re-send if this grant expires unfinished: task name, arguments "
        "and routing, as JSON (kombu's json serializer). Empty when not reclaimable.",
    )
    reclaim_attempts = models.PositiveIntegerField(
        default=0,
        help_text="Times the reclaimer re-sent this task id after its grant expired; "
        "reset by a grant for another task id or after a release.",
    )
    reclaim_state = models.CharField(
        max_length=16, blank=True, default="", choices=ReclaimState.choices
    )
    reclaim_claimed_at = models.DateTimeField(
        null=True, blank=True, help_text="When the reclaimer last claimed this lease."
    )
    permit_job = models.CharField(  # noqa: DJ001
        max_length=32,
        null=True,
        blank=True,
        help_text="On a permit's row: a digest of the key and the task id of its grant. "
        "Unique among unreleased permits: one job holds one permit of a key at a time.",
    )
    permits = models.PositiveIntegerField(
        default=0,
        help_text="lease_limit: on a key's own row, how many permit rows the key has (each "
        "a lease of its own); 0: a plain lease.",
    )
    # Completion marker: the last job completed under this key, written by the statement
    # that proves and releases its grant; the grant statement reads it under the row lock.
    completed_digest = models.CharField(
        max_length=32,
        blank=True,
        default="",
        help_text="Digest of the task id and message of the last job completed under this "
        "key (SUCCESS or FAILURE); a redelivery of it is not run again.",
    )
    completed_retries = models.IntegerField(
        null=True, blank=True, help_text="The retry count of that completed delivery."
    )
    completed_at = models.DateTimeField(
        null=True, blank=True, help_text="When that job completed (the database's clock)."
    )
    release_state = models.CharField(
        max_length=16,
        blank=True,
        default="",
        help_text="How the last grant was released: the task's state (SUCCESS, FAILURE, "
        "RETRY, REPLACED, ...); blank while held, or for a release without a state.",
    )

    class Meta:
        verbose_name = "lease"
        constraints = [
            models.UniqueConstraint(fields=["key"], name="celery_fenced_lease_key_uniq"),
            _check(Q(token__gte=0), "celery_fenced_lease_token_not_negative"),
            _check(Q(expires_at__gte=models.F("acquired_at")), "celery_fenced_lease_expiry_order"),
        ]
        indexes = [
            models.Index(fields=["expires_at"], name="celery_fenced_lease_expires"),
            models.Index(fields=["task_name"], name="celery_fenced_lease_task"),
            models.Index(fields=["task_id"], name="celery_fenced_lease_task_id"),
            models.Index(fields=["-acquired_at"], name="celery_fenced_lease_acquired"),
        ]
        # Not declared here, made by the migrations for each database family (see
        # 0008_mysql_family): on PostgreSQL and SQLite the partial unique index
        # ``celery_fenced_lease_one_permit_per_job`` (permit_job among unreleased permits;
        # on PostgreSQL its predicate says ``(released_at IS NULL) IS TRUE``: 0018)
        # and the partial indexes ``celery_fenced_lease_reclaim`` (expires_at of
        # unreleased grants with a job) and ``celery_fenced_lease_unreleased``; on the MySQL
        # family a unique index on a generated column, and the keys' binary collation.
        permissions = [("force_release_lease", "Can force-release a lease")]

    def __str__(self) -> str:
        return f"{self.key} (token {self.token})"


class Completion(models.Model):
    """A completed job's marker, moved off its lease row when another job completed there.

    The lease row keeps the last completed job of its key; the one before it comes here,
    so that its redelivery is still recognised within ``fenced_duplicate_window`` (pruned
    after that). A key used by one job only never writes a row here.
    """

    digest = models.CharField(max_length=32, help_text="Digest of the task id and message.")
    retries = models.IntegerField(help_text="The retry count of the completed delivery.")
    completed_at = models.DateTimeField(help_text="When it completed (the database's clock).")

    class Meta:
        verbose_name = "completed job"
        indexes = [
            models.Index(fields=["digest"], name="celery_fenced_completion_dig"),
            models.Index(fields=["completed_at"], name="celery_fenced_completion_at"),
        ]

    def __str__(self) -> str:
        return f"{self.digest} (retries {self.retries})"


class PendingJob(models.Model):
    """A fenced job published but not yet granted: what the outbox sends again if lost.

    Written by ``apply_async`` (in the caller's transaction when one is open on the lease
    database; the message goes to the broker when it commits) and deleted by the
    statement that grants the job's lease (or finds its key busy), so a job is always in
    one place: pending here, granted on its lease row, or finished. The reclaimer sends
    a row again when ``resend_at`` has passed (``fenced_outbox_resend_after`` after the
    job's ETA or its last sending).
    """

    task_id = models.CharField(max_length=255, unique=True)
    task_name = models.CharField(max_length=255)
    key = models.CharField(
        max_length=KEY_MAX_LENGTH, blank=True, default="", help_text="The job's lease key."
    )
    job = models.TextField(help_text="The job as JSON: task, args, kwargs and routing.")
    published_at = models.DateTimeField(help_text="When it was recorded (the database's clock).")
    eta = models.DateTimeField(null=True, blank=True, help_text="Not to run before this.")
    expires_at = models.DateTimeField(
        null=True, blank=True, help_text="Celery's expires: never sent again after this."
    )
    resend_at = models.DateTimeField(help_text="When the reclaimer sends it again, if still here.")
    sends = models.IntegerField(default=0, help_text="Times the reclaimer sent it again.")
    unsent = models.BooleanField(
        default=False, help_text="The broker refused the first sending (sent again at once)."
    )
    abandoned_at = models.DateTimeField(
        null=True, blank=True, help_text="Given up after fenced_reclaim_max sendings."
    )
    abandoned_reason = models.CharField(max_length=255, blank=True, default="")
    unique_key = models.CharField(
        max_length=KEY_MAX_LENGTH,
        null=True,
        blank=True,
        unique=True,
        help_text="The key of a lease_unique job: one queued copy per key.",
    )
    unique_until = models.CharField(
        max_length=16,
        blank=True,
        default="",
        help_text="lease_unique: until_started or until_done (this row is kept while it runs).",
    )
    started_token = models.BigIntegerField(
        null=True,
        blank=True,
        help_text="until_done: the token of its grant (running while that grant is held).",
    )
    plain = models.BooleanField(
        "follow-up task",
        default=False,
        help_text="Not a job of its own but a task a fenced task's outcome sends on (a "
        "callback, errback, chain step or chord body). It takes no lease: this row ends "
        "when a worker starts it (when it is sent, for a fenced task), not at a grant; "
        "until then the reclaimer sends it again if it is lost.",
    )
    nesting = models.PositiveIntegerField(
        default=0,
        help_text="How many times the task replaced itself before this message (Celery's "
        "replaced_task_nesting; the task id stays): a copy of an earlier message of the "
        "task id does not end this row.",
    )

    class Meta:
        verbose_name = "pending job"
        indexes = [
            models.Index(fields=["resend_at"], name="celery_fenced_pending_due"),
        ]

    def __str__(self) -> str:
        return f"{self.task_name}[{self.task_id}]"


class LeaseEvent(models.Model):
    """The audit trail of a key: grants, releases, losses and rejected writes."""

    class Kind(models.TextChoices):
        ACQUIRED = "acquired"
        RECLAIMED = "reclaimed"
        RELEASED = "released"
        LOST = "lost"
        BUSY = "busy"
        STALE_WRITE_REJECTED = "stale_write_rejected"
        FORCE_RELEASED = "force_released"
        DUPLICATE = "duplicate"
        RESENT = "resent"
        ABANDONED = "abandoned"
        DEDUPLICATED = "deduplicated"

    lease = models.ForeignKey(Lease, on_delete=models.CASCADE, related_name="events")
    kind = models.CharField(max_length=32, choices=Kind.choices)
    token = models.BigIntegerField(null=True, blank=True)
    task_id = models.CharField(max_length=255, blank=True, default="")
    owner = models.CharField(max_length=OWNER_MAX_LENGTH, blank=True, default="")
    at = models.DateTimeField()
    detail = models.JSONField(default=dict, blank=True)

    class Meta:
        verbose_name = "lease event"
        ordering = ["-at", "-id"]
        indexes = [
            models.Index(fields=["lease", "-at"], name="celery_fenced_event_lease_at"),
            models.Index(fields=["kind", "-at"], name="celery_fenced_event_kind_at"),
            models.Index(fields=["task_id"], name="celery_fenced_event_task_id"),
            models.Index(fields=["at"], name="celery_fenced_event_at"),
        ]

    def __str__(self) -> str:
        return f"{self.kind} token={self.token} at {self.at:%Y-%m-%d %H:%M:%S}"


class BeatEntry(models.Model):
    """A periodic task of a fenced beat (``celery_fenced.beat``): its last sent tick.

    Shared by every host that runs beat under one ``fenced_beat_key``, written only by
    the leader, under its proven token, in the transaction that records the tick's job
    in the outbox: a tick is sent once, whoever leads.
    """

    beat_key = models.CharField(max_length=KEY_MAX_LENGTH, help_text="fenced_beat_key.")
    name = models.CharField(max_length=200, help_text="The schedule entry's name.")
    last_tick = models.DateTimeField(
        null=True, blank=True, help_text="The tick last sent (the leader's clock)."
    )
    sends = models.PositiveBigIntegerField(default=0, help_text="Ticks sent so far.")
    token = models.BigIntegerField(
        null=True, blank=True, help_text="The leader's fencing token that sent the last tick."
    )
    task_id = models.CharField(
        max_length=255, blank=True, default="", help_text="The task id of the last tick's job."
    )

    class Meta:
        verbose_name = "beat entry"
        verbose_name_plural = "beat entries"
        constraints = [
            models.UniqueConstraint(
                fields=["beat_key", "name"], name="celery_fenced_beat_entry_uniq"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.beat_key})"
