"""How the admin shows a lease's values: badges, short keys, owners and task ids, times."""

from __future__ import annotations

import datetime as dt
import json
import re
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

#: the characters of a key, an owner or a job shown in a list column (the whole value
#: is in the tooltip)
KEY_SHOWN = 24
OWNER_SHOWN = 18

#: the default key: ``task name:32 hex digits`` (celery_fenced.keys.default_key)
_DEFAULT_KEY = re.compile(r"(?P<task>.+):(?P<digest>[0-9a-f]{32})")
#: an execution's owner: ``host:boot:pid:thread`` (celery_fenced.owners)
_OWNER = re.compile(r"(?P<host>.+):[0-9a-f]{8}:(?P<pid>\d+):(?P<thread>\d+)")


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


#: narrow columns: short keys, owners, task ids and times (whole in their tooltips), the
#: detail wrapped (fits 1366 px with Django's navigation sidebar open)
CHANGE_LIST = "admin/celery_fenced/change_list.html"


def short_id(task_id: str) -> SafeString | str:
    """A task id as its first 8 characters, the whole id in the tooltip (a UUID would
    wrap onto four lines of a changelist column)."""
    if len(task_id) <= 13:
        return task_id
    return format_html('<span title="{}">{}…</span>', task_id, task_id[:8])


def key_head(key: str) -> str:
    """A key as a list column shows it: a default key (``billing.tasks.send:<32 hex>``)
    as the task's last name and 8 digits (``send:3f2a1b9c…``), any other key longer than
    :data:`KEY_SHOWN` cut there."""
    default = _DEFAULT_KEY.fullmatch(key)
    if default:
        return f"{default['task'].rsplit('.', 1)[-1][: KEY_SHOWN - 10]}:{default['digest'][:8]}…"
    return key if len(key) <= KEY_SHOWN else f"{key[: KEY_SHOWN - 1]}…"


def short_key(key: str, shown: str = "") -> SafeString | str:
    """``shown`` (default: :func:`key_head` of ``key``), the whole key in the tooltip
    when they differ."""
    shown = shown or key_head(key)
    return key if shown == key else format_html('<span title="{}">{}</span>', key, shown)


def owner_head(owner: str) -> str:
    """An owner as a list column shows it: an execution's ``celery@host:boot:pid:thread``
    as ``host:pid`` (the boot id and thread tell processes apart, not people), any other
    owner longer than :data:`OWNER_SHOWN` cut there."""
    execution = _OWNER.fullmatch(owner)
    if execution:
        host = execution["host"].removeprefix("celery@")
        if len(host) > OWNER_SHOWN:
            host = f"{host[: OWNER_SHOWN - 1]}…"
        return f"{host}:{execution['pid']}"
    return owner if len(owner) <= OWNER_SHOWN else f"{owner[: OWNER_SHOWN - 1]}…"


def short_owner(owner: str) -> SafeString | str:
    """:func:`owner_head` of ``owner``, the whole owner in the tooltip."""
    if not owner:
        return "—"
    shown = owner_head(owner)
    return owner if shown == owner else format_html('<span title="{}">{}</span>', owner, shown)


def when(value: dt.datetime | None) -> str:
    """A database timestamp to the millisecond, in UTC: lease times are short."""
    if value is None:
        return "—"
    return value.astimezone(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def compact_when(value: dt.datetime | None, now: dt.datetime) -> SafeString | str:
    """A timestamp in UTC as a list column shows it, :func:`when` in the tooltip: the time
    of day when it is of ``now``'s day (the database's clock), else the day and minute,
    else (another year) the date."""
    if value is None:
        return "—"
    at, today = value.astimezone(dt.timezone.utc), now.astimezone(dt.timezone.utc)
    if at.date() == today.date():
        shown = at.strftime("%H:%M:%S")
    elif at.year == today.year:
        shown = at.strftime("%m-%d %H:%M")
    else:
        shown = at.strftime("%Y-%m-%d")
    return format_html('<span title="{}">{}</span>', when(value), shown)
