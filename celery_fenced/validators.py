"""Checks of one setting's or task option's value: each returns it or raises naming it."""

from __future__ import annotations

import difflib
import math
from typing import Any

from django.db import connections

from celery_fenced import extras
from celery_fenced.exceptions import FencedConfigurationError

ON_BUSY_CHOICES = ("retry", "skip", "fail")
#: what the audit trail records: the anomalies only, or every grant and release too
EVENTS_CHOICES = ("anomalies", "all")
TASK_OPTION_NAMES = (
    "ttl",
    "key",
    "on_busy",
    "renew_interval",
    "reclaim",
    "outbox",
    "unique",
    "limit",
    "atomic",
)
#: the most permits a key can have (``lease_limit``)
MAX_LIMIT = 10_000
#: ``lease_unique``: no second copy queued while one is waiting, or waiting or running
UNIQUE_CHOICES = ("until_started", "until_done")
#: task name prefixes a glob pattern never selects (an exact name still does)
NEVER_BY_PATTERN = ("celery.", "celery_fenced.")


def validate_positive_seconds(value: object, name: str) -> float:
    """Return ``value`` as seconds, or raise naming ``name`` and what is allowed."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise FencedConfigurationError(
            f"{name} must be a number of seconds greater than 0, got {value!r}"
        )
    seconds = float(value)
    if not math.isfinite(seconds) or seconds <= 0:
        raise FencedConfigurationError(
            f"{name} must be a number of seconds greater than 0, got {value!r}"
        )
    return seconds


def validate_seconds(value: object, name: str) -> float:
    """Return ``value`` as seconds >= 0, or raise naming ``name`` and what is allowed."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise FencedConfigurationError(
            f"{name} must be a number of seconds (0 or more), got {value!r}"
        )
    seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0:
        raise FencedConfigurationError(
            f"{name} must be a number of seconds (0 or more), got {value!r}"
        )
    return seconds


def validate_reclaim(value: object, name: str) -> bool | None:
    """``None`` (the default rule), ``True`` or ``False``; anything else is an error."""
    if value is not None and not isinstance(value, bool):
        raise FencedConfigurationError(
            f"{name} must be True, False or None (reclaim tasks keyed by the default key "
            f"only), got {value!r}"
        )
    return value


def validate_reclaim_max(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise FencedConfigurationError(f"{name} must be an integer of 1 or more, got {value!r}")
    return value


def validate_on_busy(value: object, name: str) -> str:
    if value not in ON_BUSY_CHOICES:
        raise FencedConfigurationError(
            f"{name} must be one of {', '.join(map(repr, ON_BUSY_CHOICES))}, got {value!r}"
        )
    return str(value)


def validate_events(value: object, name: str) -> str:
    if value not in EVENTS_CHOICES:
        raise FencedConfigurationError(
            f"{name} must be one of {', '.join(map(repr, EVENTS_CHOICES))}, got {value!r}"
        )
    return str(value)


def validate_bool(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        raise FencedConfigurationError(f"{name} must be True or False, got {value!r}")
    return value


def validate_unique(value: object, name: str) -> str | None:
    """``None`` (no uniqueness) or one of :data:`UNIQUE_CHOICES`."""
    if value is not None and value not in UNIQUE_CHOICES:
        raise FencedConfigurationError(
            f"{name} must be one of {', '.join(map(repr, UNIQUE_CHOICES))} or None, got {value!r}"
        )
    return None if value is None else str(value)


def validate_limit(value: object, name: str) -> int | None:
    """``None`` (one holder, the plain lease) or the number of permits: an int from 1 to
    :data:`MAX_LIMIT`."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_LIMIT:
        raise FencedConfigurationError(
            f"{name} must be an integer from 1 to {MAX_LIMIT} (permits: holders of the key "
            f"at once) or None (one holder), got {value!r}"
        )
    return value


def validate_metrics_port(value: object, name: str) -> int | None:
    """``None`` or a TCP port (1 to 65535) for the worker's metrics; it needs
    ``prometheus_client`` (the extra ``metrics``)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise FencedConfigurationError(
            f"{name} must be a TCP port (an integer from 1 to 65535) or None, got {value!r}"
        )
    if not extras.metrics_installed():
        raise FencedConfigurationError(
            f"{name} needs prometheus_client: pip install 'celery-fenced[metrics]' "
            "(or set it to None)"
        )
    return value


def validate_renew_interval(value: object, ttl: float, name: str) -> float:
    interval = validate_positive_seconds(value, name)
    if interval >= ttl:
        raise FencedConfigurationError(
            f"{name} must be shorter than the lease ttl ({ttl:g}s), got {value!r}"
        )
    return interval


def did_you_mean(unknown: set[Any], allowed: tuple[str, ...]) -> str:
    """`` (did you mean 'ttl'?)`` when an unknown name is close to an allowed one."""
    guesses = {
        name: close[0]
        for name in sorted(unknown, key=repr)
        if isinstance(name, str)
        and (close := difflib.get_close_matches(name, allowed, n=1, cutoff=0.6))
    }
    if not guesses:
        return ""
    if len(unknown) == 1:
        return f" (did you mean {next(iter(guesses.values()))!r}?)"
    return f" (did you mean {', '.join(f'{g!r} for {n!r}' for n, g in guesses.items())}?)"


def validate_beat_key(value: object, name: str) -> str | None:
    """``None`` (the default key) or a non-empty lease key for the beat leader."""
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise FencedConfigurationError(
            f"{name} must be a non-empty string (the beat leader's lease key) or None, "
            f"got {value!r}"
        )
    return value


def validate_database(alias: object) -> None:
    """``fenced_database``: an alias of ``DATABASES``."""
    if not isinstance(alias, str) or alias not in connections.settings:
        known = ", ".join(sorted(connections.settings))
        raise FencedConfigurationError(
            f"fenced_database must name a database alias in DATABASES ({known}), got {alias!r}"
        )
