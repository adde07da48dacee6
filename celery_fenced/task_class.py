"""The lease options of a task class, checked when the class is made."""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable
from typing import Any

from celery_fenced import keys, validators
from celery_fenced.exceptions import FencedConfigurationError

#: a fenced task's options, as class attributes (``@app.task(..., lease_ttl=30)``)
OPTIONS = tuple(f"lease_{name}" for name in validators.TASK_OPTION_NAMES)
#: options that a task would silently ignore without their ``lease_`` prefix
UNPREFIXED = ("on_busy", "renew_interval")


def validate_task_class(cls: type) -> None:
    """Check a task class's explicit lease options; errors name the task and option."""
    name = getattr(cls, "name", None) or cls.__name__
    where = f"task {name!r}"
    _names_known(cls, where)
    ttl = cls.__dict__.get("lease_ttl")
    if ttl is not None:
        validators.validate_positive_seconds(ttl, f"{where} option lease_ttl")
    on_busy = cls.__dict__.get("lease_on_busy")
    if on_busy is not None:
        validators.validate_on_busy(on_busy, f"{where} option lease_on_busy")
    interval = cls.__dict__.get("lease_renew_interval")
    if interval is not None:
        validators.validate_renew_interval(
            interval,
            validators.validate_positive_seconds(
                getattr(cls, "lease_ttl", None) or 1e9, "lease_ttl"
            ),
            f"{where} option lease_renew_interval",
        )
    reclaim = cls.__dict__.get("lease_reclaim")
    if reclaim is not None:
        validators.validate_reclaim(reclaim, f"{where} option lease_reclaim")
    outbox = cls.__dict__.get("lease_outbox")
    if outbox is not None:
        validators.validate_bool(outbox, f"{where} option lease_outbox")
    unique = cls.__dict__.get("lease_unique")
    if unique is not None:
        validators.validate_unique(unique, f"{where} option lease_unique")
    validators.validate_limit(cls.__dict__.get("lease_limit"), f"{where} option lease_limit")
    atomic = cls.__dict__.get("lease_atomic")
    if atomic is not None:
        validators.validate_bool(atomic, f"{where} option lease_atomic")
    key = cls.__dict__.get("lease_key")
    if key is not None:
        if isinstance(key, str):
            run = cls.__dict__.get("run")
            func = getattr(run, "__func__", run)
            if isinstance(run, staticmethod) or func is None:
                keys.check_template(name, key, func)
            else:
                keys.check_template(name, key, _without_self(func))
        elif not callable(key):
            raise FencedConfigurationError(
                f"{where} option lease_key must be a str.format template or a callable "
                f"(args, kwargs) -> str, got {key!r}"
            )
        elif inspect.isfunction(key):
            # a plain function in a class body would be bound as a method of the task
            cls.lease_key = staticmethod(key)  # type: ignore[attr-defined]


def _names_known(cls: type, where: str) -> None:
    """A misspelt option (``lease_tll``) or one without its prefix (``on_busy``) would be
    an attribute Celery keeps and nothing reads: the task would run with the defaults."""
    for attribute in cls.__dict__:
        if attribute.startswith("lease_") and attribute not in OPTIONS:
            close = difflib.get_close_matches(attribute, OPTIONS, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise FencedConfigurationError(
                f"{where} has an unknown option {attribute}{hint} "
                f"(the options are {', '.join(OPTIONS)})"
            )
        if attribute in UNPREFIXED:
            raise FencedConfigurationError(
                f"{where} option {attribute} is not read: a fenced task's options start "
                f"with lease_ (lease_{attribute})"
            )


def _without_self(func: Callable[..., Any]) -> Callable[..., Any]:
    params = list(inspect.signature(func).parameters.values())
    if not params:
        return func
    return functools.partial(func, None)
