"""Testing helpers for your own fenced tasks, and their pytest plugin.

The plugin (``-p celery_fenced.testing``, also loaded by pytest when the package is
installed) adds one fixture, ``fenced``: a :class:`~celery_fenced.testing.helpers.Fenced`
that takes keys over, loses leases, captures the lease events of the test and asserts
that a result was fenced out. Until a test asks for it, the plugin does nothing: it
imports neither Django nor the rest of the package, and adds no hook and no option.

The helpers are importable without the fixture, for any test runner::

    from celery_fenced.testing import assert_fenced_out, take_over
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from celery_fenced.testing.helpers import (
        TAKER,
        CapturedEvent,
        Fenced,
        Takeover,
        assert_fenced_out,
        assert_lease,
        lose,
        recorded_events,
        take_over,
        taken_over_after_grant,
    )

__all__ = [
    "TAKER",
    "CapturedEvent",
    "Fenced",
    "Takeover",
    "assert_fenced_out",
    "assert_lease",
    "fenced",
    "lose",
    "recorded_events",
    "take_over",
    "taken_over_after_grant",
]

HELPERS = "celery_fenced.testing.helpers"


def __getattr__(name: str) -> Any:
    # the helpers need Django's app registry, which pytest loads its plugins before
    if name in __all__:
        return getattr(importlib.import_module(HELPERS), name)
    raise AttributeError(f"module 'celery_fenced.testing' has no attribute {name!r}")


@pytest.fixture
def fenced() -> Iterator[Fenced]:
    """Take keys over, lose leases, capture this test's lease events, assert outcomes.

    Its grants are released and its signal receivers disconnected when the test ends.
    Use it in ``django_db(transaction=True)`` tests: the renewer and the takeovers read
    the lease rows from their own connections.
    """
    helpers = importlib.import_module(HELPERS)  # Django's app registry: ready by now
    helper: Fenced = helpers.Fenced()
    helper.start()
    try:
        yield helper
    finally:
        helper.stop()
