"""Permits (``lease_limit``): up to N holders of one key, each on a lease row of its own.

Permit ``i`` of key ``k`` is the lease row ``k`` + :data:`SEPARATOR` + ``i`` — a key no
caller can take (:func:`celery_fenced.keys.check_key` refuses the separator). Each such
row is a lease like any other: renewal, loss, release, reclaim, ``guard()``,
``fenced_update`` and the result backend work on it unchanged. The key's own row holds
what the permits share: how many permit rows exist (``permits``) and the floor of their
tokens, which are one increasing sequence across the key's permits.
"""

from __future__ import annotations

#: between a key and its permit's number; refused in keys
SEPARATOR = "\x1f"


def permit_key(key: str, index: int) -> str:
    """The lease row key of permit ``index`` (from 0) of ``key``."""
    return f"{key}{SEPARATOR}{index}"


def split(lease_key: str) -> tuple[str, int | None]:
    """``(key, permit index)`` of a lease row key; the index is None for a plain lease."""
    key, separator, index = lease_key.rpartition(SEPARATOR)
    if not separator or not index.isdigit():
        return lease_key, None
    return key, int(index)


def describe(lease_key: str) -> str:
    """A lease row key as people read it: ``report:7 (permit 2)``."""
    key, index = split(lease_key)
    return lease_key if index is None else f"{key} (permit {index})"
