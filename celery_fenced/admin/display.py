"""How the admin shows a lease's values: badges, short task ids, times."""

from __future__ import annotations

import datetime as dt
import json
from typing import TYPE_CHECKING, Any

from django.contrib import admin
from django.utils.html import format_html
from django.utils.safestring import SafeString

from celery_fenced import operations
from celery_fenced.models import Lease, LeaseEvent

if TYPE_CHECKING:
    LeaseModelAdmin = admin.ModelAdmin[Lease]
    EventModelAdmin = admin.ModelAdmin[LeaseEvent]
else:
    LeaseModelAdmin = EventModelAdmin = admin.ModelAdmin


STATE_COLOURS = {
    operations.HELD: "#2e7d32",
    operations.EXPIRED: "#ef8f00",
    operations.RELEASED: "#6c7a89",
}


def detail_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True) if value else ""


def task_id_head(task_id: str) -> str:
    return task_id if len(task_id) <= 13 else f"{task_id[:8]}…"


def badge(text: str, colour: str) -> SafeString:
    return format_html(
        '<span class="fenced-badge fenced-{}" style="background:{};color:#fff;'
        "padding:1px 8px;border-radius:9px;font-size:11px;font-weight:600;"
        'white-space:nowrap">{}</span>',
        text,
        colour,
        text.replace("_", " "),
    )


#: narrow columns: a short task id, times on one line, the detail wrapped (fits 1366 px)
CHANGE_LIST = "admin/celery_fenced/change_list.html"


def short_id(task_id: str) -> SafeString | str:
    """A task id as its first 8 characters, the whole id in the tooltip (a UUID would
    wrap onto four lines of a changelist column)."""
    if len(task_id) <= 13:
        return task_id
    return format_html('<span title="{}">{}…</span>', task_id, task_id[:8])


def when(value: dt.datetime | None) -> str:
    """A database timestamp to the millisecond, in UTC: lease times are short."""
    if value is None:
        return "—"
    return value.astimezone(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
