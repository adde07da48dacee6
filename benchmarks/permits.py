"""Row 7: permits — grant-and-release cycles of one key's permits.

Threads of one process loop ``acquire(key, limit=N)`` then ``release()``, N threads for
N permits (each finds one free), against what a user would use instead for N at a time:
N single leases on N keys of their own, one thread each. And one thread's cycle on one
permit (``limit=1``) against the single lease: what the permit's statement costs. On
PostgreSQL, and on MariaDB when the runner started it (alias ``mariadb``), each database
against its own single leases. Rounds alternate the variants; cycles per second over all
threads.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from statistics import median

from benchmarks.common import Context, Line

#: the databases compared, by alias, as the cases name them
DATABASES = {"default": "", "mariadb": "MariaDB: "}


def run(ctx: Context) -> list[Line]:
    from django.conf import settings

    lines: list[Line] = []
    for alias, label in DATABASES.items():
        if alias in settings.DATABASES:
            lines += _run(ctx, alias, label)
    return lines


def _run(ctx: Context, alias: str, label: str) -> list[Line]:
    from django.db import connections

    from celery_fenced import acquire

    seconds = ctx.profile.cycle_seconds * 2
    rounds = ctx.profile.cycle_rounds
    prefix = f"bench-permits-{uuid.uuid4().hex[:6]}"

    def cycles(threads: int, take: Callable[[int], object]) -> float:
        """Cycles per second of ``threads`` threads, each calling ``take(thread)`` and
        releasing what it returns, for ``seconds``."""
        counts = [0] * threads
        start = threading.Barrier(threads + 1)
        stop = time.monotonic() + 3600.0
        deadline = [stop]

        def loop(n: int) -> None:
            try:
                start.wait()
                while time.monotonic() < deadline[0]:
                    take(n).release()  # type: ignore[attr-defined]
                    counts[n] += 1
            finally:
                connections.close_all()

        workers = [threading.Thread(target=loop, args=(n,)) for n in range(threads)]
        for worker in workers:
            worker.start()
        began = time.monotonic()
        deadline[0] = began + seconds
        start.wait()
        for worker in workers:
            worker.join()
        return sum(counts) / (time.monotonic() - began)

    def permits(limit: int) -> Callable[[int], object]:
        key = f"{prefix}:p{limit}"
        return lambda n: acquire(key, ttl=30, limit=limit, using=alias)

    def single(key: str) -> Callable[[int], object]:
        return lambda n: acquire(f"{key}:{n}", ttl=30, using=alias)

    variants: dict[str, tuple[int, Callable[[int], object]]] = {
        "single": (1, single(f"{prefix}:s")),
        "permit 1": (1, permits(1)),
    }
    for limit in (4, 16):
        variants[f"permits {limit}"] = (limit, permits(limit))
        variants[f"keys {limit}"] = (limit, single(f"{prefix}:k{limit}"))
    measured: dict[str, list[float]] = {name: [] for name in variants}
    try:
        for _threads, take in variants.values():  # warm: the rows made, the plans cached
            take(0).release()  # type: ignore[attr-defined]
        for _ in range(rounds):
            for name, (threads, take) in variants.items():
                measured[name].append(cycles(threads, take))
    finally:
        from celery_fenced.models import Lease

        Lease.objects.using(alias).filter(key__startswith=prefix).delete()
        connections.close_all()
    numbers = {"seconds": seconds, "rounds": rounds, "cycles_per_second": measured}
    if alias == "default":
        ctx.data["permits"] = numbers
    else:
        ctx.data[f"permits_{alias}"] = numbers

    def line(case: str, ours: str, theirs: str) -> Line:
        ratios = [a / b for a, b in zip(measured[ours], measured[theirs], strict=True)]
        return Line(
            row="7 permits",
            case=label + case,
            measured=f"{median(measured[ours]):,.0f} cycles/s",
            baseline=f"{median(measured[theirs]):,.0f} cycles/s",
            ratio=median(ratios),
            spread=f"{min(ratios):.2f}-{max(ratios):.2f}",
            target="≥ 0.70x",
            kind="min",
            limit=0.70,
        )

    return [
        line("one permit (limit=1), one thread, vs the single lease", "permit 1", "single"),
        *(
            line(
                f"{limit} permits of one key, {limit} threads, vs {limit} single leases "
                "on keys of their own",
                f"permits {limit}",
                f"keys {limit}",
            )
            for limit in (4, 16)
        ),
    ]
