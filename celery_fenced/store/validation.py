"""Names and limits of a lease: its key, its owner, its ttl, the database it lives in."""

from __future__ import annotations

import functools
import os
import socket
import threading

from django.db import router

from celery_fenced import conf, permits, validators
from celery_fenced.exceptions import FencedError
from celery_fenced.keys import check_key
from celery_fenced.models import OWNER_MAX_LENGTH, Lease


def database_alias(using: str | None = None, settings: conf.FencedSettings | None = None) -> str:
    """The database alias of the lease table: ``using``, ``fenced_database`` or the router's.

    ``settings``: the settings already loaded by the caller (default: loaded here)."""
    if using is not None:
        return using
    configured = (settings or conf.load()).database
    return configured or router.db_for_write(Lease)


def default_owner() -> str:
    """``host:pid:thread:random`` — unique per call, readable in the admin."""
    return f"{_host()}:{os.getpid()}:{threading.get_ident() % 100000}:{os.urandom(4).hex()}"


@functools.cache
def _host() -> str:
    """This machine's name, asked once per process (a system call each time otherwise)."""
    return socket.gethostname()


def validate_key(key: object) -> str:
    """``key`` if the lease table can store it, else :class:`InvalidLeaseKey` (a ValueError)."""
    return check_key(key)


def validate_lease_key(key: object) -> str:
    """:func:`validate_key`, or the key of a permit's row (``lease_limit``): a key, the
    separator and the permit's number."""
    if isinstance(key, str):
        base, index = permits.split(key)
        if index is not None:
            check_key(base)
            return key
    return check_key(key)


def validate_owner(owner: object) -> str:
    if not isinstance(owner, str) or not owner:
        raise ValueError(f"owner must be a non-empty string, got {owner!r}")
    if len(owner) > OWNER_MAX_LENGTH:
        raise ValueError(f"owner must be at most {OWNER_MAX_LENGTH} characters, got {len(owner)}")
    return owner


def validate_ttl(ttl: object) -> float:
    try:
        return validators.validate_positive_seconds(ttl, "ttl")
    except FencedError as exc:
        raise ValueError(str(exc)) from None
