"""The demo application's own tables, fenced with a token column."""

from __future__ import annotations

from django.db import models

from celery_fenced.fencing import FencingTokenField


class Report(models.Model):
    """A report rebuilt by a fenced task; only the current lease holder may write it."""

    name = models.CharField(max_length=100, unique=True)
    body = models.TextField(blank=True, default="")
    built_by = models.CharField(max_length=255, blank=True, default="")
    fencing_token = FencingTokenField()

    def __str__(self) -> str:
        return f"{self.name} (token {self.fencing_token})"


class LedgerEntry(models.Model):
    """One applied effect of a job; (job, effect) is unique so an effect applies once."""

    job = models.CharField(max_length=100)
    effect = models.CharField(max_length=100)
    token = models.BigIntegerField()
    worker = models.CharField(max_length=255, blank=True, default="")
    at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["job", "effect"], name="demo_ledger_once")]

    def __str__(self) -> str:
        return f"{self.job}/{self.effect} (token {self.token})"


class ChaosEntry(models.Model):
    """An applied effect of a chaos job (``tests/chaos.py``): an append-only ledger.

    Deliberately without a unique constraint: a second application of a job's effect, or
    a write under a token that was no longer current, must be *visible* to the checker,
    not prevented by the table. Rows are written only inside a ``guard()`` of the job's
    lease. ``grant_seen`` and ``end_seen`` are read by the insert statement itself, so they
    show the lease's event history as that write saw it: the highest token granted so far,
    and whether this token's grant had already ended.
    """

    job = models.CharField(max_length=100, db_index=True)
    lease_key = models.CharField(max_length=255)
    token = models.BigIntegerField()
    owner = models.CharField(max_length=255)
    worker = models.CharField(max_length=255, blank=True, default="")
    task_id = models.CharField(max_length=255, blank=True, default="")
    via = models.CharField(max_length=20)
    written_at = models.DateTimeField()
    grant_seen = models.BigIntegerField(null=True)
    end_seen = models.BooleanField(default=False)

    def __str__(self) -> str:
        return f"{self.job} (token {self.token} by {self.worker})"


class ChaosSlot(models.Model):
    """One row per chaos job written with ``fenced_update``: ``applied`` counts the writes."""

    job = models.CharField(max_length=100, unique=True)
    applied = models.IntegerField(default=0)
    fencing_token = FencingTokenField()

    def __str__(self) -> str:
        return f"{self.job} applied {self.applied}x (token {self.fencing_token})"
