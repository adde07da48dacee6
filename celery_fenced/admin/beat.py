"""The fenced beat's entries: each one's last sent tick (read-only)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.contrib import admin

from celery_fenced.admin.filters import ReadOnlyMixin
from celery_fenced.models import BeatEntry

if TYPE_CHECKING:
    BeatModelAdmin = admin.ModelAdmin[BeatEntry]
else:
    BeatModelAdmin = admin.ModelAdmin


@admin.register(BeatEntry)
class BeatEntryAdmin(ReadOnlyMixin, BeatModelAdmin):
    list_display = ("name", "beat_key", "last_tick", "sends", "token", "task_id")
    list_filter = ("beat_key",)
    search_fields = ("=name", "=beat_key")
    ordering = ("beat_key", "name")
