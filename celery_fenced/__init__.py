"""celery-fenced: expiring leases and fencing tokens for Celery tasks on Django."""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from celery_fenced.context import current_lease
from celery_fenced.exceptions import (
    AlreadyCompleted,
    FencedConfigurationError,
    FencedError,
    InvalidLeaseKey,
    LeaseBusy,
    LeaseLost,
    StaleToken,
    UncommittedJob,
)

if TYPE_CHECKING:
    from celery_fenced.execution import FencedTask
    from celery_fenced.fencing import FencingTokenField, fenced_update
    from celery_fenced.store import HeldLease, acquire, force_release

try:
    __version__ = version("celery-fenced")  # written once, in pyproject.toml
except PackageNotFoundError:  # pragma: no cover - run from a source tree not installed
    __version__ = "0+unknown"

__all__ = [
    "AlreadyCompleted",
    "FencedConfigurationError",
    "FencedError",
    "FencedTask",
    "FencingTokenField",
    "HeldLease",
    "InvalidLeaseKey",
    "LeaseBusy",
    "LeaseLost",
    "StaleToken",
    "UncommittedJob",
    "acquire",
    "current_lease",
    "fenced_update",
    "force_release",
]

# Names that need Django's app registry are imported on first use, so that
# ``from celery_fenced import FencedTask`` works in a Celery module loaded before
# ``django.setup()``.
_LAZY = {
    "FencedTask": "celery_fenced.execution",
    "FencingTokenField": "celery_fenced.fencing",
    "fenced_update": "celery_fenced.fencing",
    "HeldLease": "celery_fenced.store",
    "acquire": "celery_fenced.store",
    "force_release": "celery_fenced.store",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'celery_fenced' has no attribute {name!r}")
    # imported here: it imports Django, which ``import celery_fenced`` does not
    from celery_fenced.installed import require_apps

    require_apps()  # names both apps, instead of Django's error about a model class
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # found directly from now on: this lookup costs a call's time
    return value
