"""Riding out a database that is away for a moment: a restart, a failover, a dropped link."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from django.db import InterfaceError, OperationalError, connections

logger = logging.getLogger(__name__)
T = TypeVar("T")

#: pauses (seconds) between attempts while the database is away: about 15 s in all
PAUSES = (0.5, 1.0, 2.0, 4.0, 8.0)


def attempt_through(
    attempt: Callable[[], T],
    aliases: Sequence[str],
    failing: str,
    extra: dict[str, Any] | None = None,
) -> T:
    """``attempt()``, again after a pause each time the database is away (``PAUSES``).

    A failed attempt's transaction went with its connection, so nothing of it stands; the
    connections of ``aliases`` (Django's and the thread's kept ones, see
    :mod:`celery_fenced.store.owned`) are closed so the next attempt opens new ones. Inside a
    transaction of the caller's nothing can be tried again: the error is raised. Each
    pause is logged as ``"<failing> (<error>); trying again in <pause> s"``.
    """
    from celery_fenced import store  # importable before Django's apps are ready

    for pause in (*PAUSES, None):
        try:
            return attempt()
        except (OperationalError, InterfaceError) as exc:
            if pause is None or any(connections[a].in_atomic_block for a in aliases):
                raise
            logger.warning("%s (%s); trying again in %.1f s", failing, exc, pause, extra=extra)
            for alias in aliases:
                connections[alias].close()
                store.close_kept_connection(alias)
            time.sleep(pause)
    raise AssertionError("unreachable")  # pragma: no cover
