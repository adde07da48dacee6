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
