"""Code run in separate OS processes by the concurrency and clock tests."""

from __future__ import annotations

import os
import random
from typing import Any

from devtools.workers import setup_django


def race_rounds(alias: str, key: str, rounds: int, barrier: Any, results: Any) -> None:
    """Each round: all processes try to acquire ``key`` at once; the winner releases."""
    setup_django()
    from django.db import connections

    from celery_fenced import LeaseBusy, acquire

    outcomes = []
    for round_no in range(rounds):
        barrier.wait()
        lease = None
        try:
            lease = acquire(key, ttl=60, using=alias)
            outcomes.append((round_no, lease.token))
        except LeaseBusy:
            outcomes.append((round_no, None))
        barrier.wait()  # everyone has tried before the winner lets go
        if lease is not None:
            assert lease.release()
    connections.close_all()
    results.put((os.getpid(), outcomes))


def race_keys(
    alias: str, keys: list[str], count: int, seed: int, barrier: Any, results: Any
) -> None:
    """Acquire and release ``count`` random ``keys``, recording every token won."""
    setup_django()
    from django.db import connections

    from celery_fenced import LeaseBusy, acquire

    rng = random.Random(seed)
    order = rng.sample(keys, count)
    barrier.wait()
    won, busy = [], 0
    for key in order:
        try:
            lease = acquire(key, ttl=60, using=alias)
        except LeaseBusy:
            busy += 1
            continue
        won.append((key, lease.token))
        assert lease.release()
    connections.close_all()
    results.put((won, busy))


def skewed_clock(alias: str, shift_minutes: int, results: Any) -> None:
    """With the Python clock shifted, report the store's expiry decisions."""
    import time_machine

    setup_django()
    import datetime as dt

    from celery_fenced import LeaseBusy, acquire

    traveller = time_machine.travel(dt.timedelta(minutes=shift_minutes), tick=True)
    traveller.start()
    decisions: dict[str, Any] = {"python_now": dt.datetime.now(dt.timezone.utc).isoformat()}
    try:
        acquire("held", ttl=60, using=alias)
        decisions["held"] = "acquired"
    except LeaseBusy as exc:
        decisions["held"] = "busy"
        decisions["remaining"] = exc.remaining
    lease = acquire("expired", ttl=60, using=alias)
    decisions["expired"] = lease.token
    decisions["expires_in"] = (lease.expires_at - dt.datetime.now(dt.timezone.utc)).total_seconds()
    traveller.stop()
    results.put(decisions)
