"""Row 7: permits — grant-and-release cycles of one key's permits.

Threads of one process loop ``acquire(key, limit=N)`` then ``release()``, N threads for
N permits (each finds one free), against what a user would use instead for N at a time:
N single leases on N keys of their own, one thread each. And one thread's cycle on one
permit (``limit=1``) against the single lease: what the permit's statement costs. On
PostgreSQL, and on MariaDB when the runner started it (alias ``mariadb``), each database
against its own single leases. Rounds alternate the variants; cycles per second over all
threads.
And the floor, on PostgreSQL: the statements the store sends for a permit's and a single
lease's grant and release (captured from it), sent raw on a psycopg connection per thread
that prepares them, one thread and N: the ratio the database itself gives.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from statistics import median
from typing import Any

from benchmarks.common import Context, Line, statements_sent

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
    raw = _RawStatements(ctx, alias, prefix) if alias == "default" else None
    if raw is not None:  # the floor: the same statements, prepared, without the API
        variants["raw single"] = (1, raw.single(f"{prefix}:rs"))
        variants["raw permit 1"] = (1, raw.permit(f"{prefix}:rp1", 1))
        for limit in (4, 16):
            variants[f"raw keys {limit}"] = (limit, raw.single(f"{prefix}:rk{limit}"))
            variants[f"raw permits {limit}"] = (limit, raw.permit(f"{prefix}:rp{limit}", limit))
    measured: dict[str, list[float]] = {name: [] for name in variants}
    try:
        for _threads, take in variants.values():  # warm: the rows made, the plans cached
            take(0).release()  # type: ignore[attr-defined]
        for _ in range(rounds):
            for name, (threads, take) in variants.items():
                measured[name].append(cycles(threads, take))
    finally:
        from celery_fenced.models import Lease

        if raw is not None:
            raw.close()
        Lease.objects.using(alias).filter(key__startswith=prefix).delete()
        connections.close_all()
    numbers = {"seconds": seconds, "rounds": rounds, "cycles_per_second": measured}
    if alias == "default":
        ctx.data["permits"] = numbers
    else:
        ctx.data[f"permits_{alias}"] = numbers

    def line(case: str, ours: str, theirs: str, *, target: bool = True) -> Line:
        ratios = [a / b for a, b in zip(measured[ours], measured[theirs], strict=True)]
        return Line(
            row="7 permits",
            case=label + case,
            measured=f"{median(measured[ours]):,.0f} cycles/s",
            baseline=f"{median(measured[theirs]):,.0f} cycles/s",
            ratio=median(ratios),
            spread=f"{min(ratios):.2f}-{max(ratios):.2f}",
            **({"target": "≥ 0.70x", "kind": "min", "limit": 0.70} if target else {}),
        )

    floors = (
        [
            line(
                "its floor: one permit's statements raw and prepared, one thread, vs the "
                "single lease's",
                "raw permit 1",
                "raw single",
                target=False,
            ),
            *(
                line(
                    f"its floor: {limit} permits' statements raw and prepared, {limit} "
                    f"threads, vs {limit} single leases'",
                    f"raw permits {limit}",
                    f"raw keys {limit}",
                    target=False,
                )
                for limit in (4, 16)
            ),
        ]
        if raw is not None
        else []
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
        *floors,
    ]


class _RawStatements:
    """The statements the store sends for a single lease's and a permit's grant and
    release (captured from it once), sent raw on a psycopg connection per thread that
    prepares them: the floor of row 7, what is left without the API's Python."""

    def __init__(self, ctx: Context, alias: str, prefix: str) -> None:
        self.alias = alias
        self.conninfo = ctx.conninfo()
        self.lease = _captured(alias, f"{prefix}:probe-lease", None)
        self.permits = _captured(alias, f"{prefix}:probe-permits", 1)
        self._local = threading.local()
        self._opened: list[Any] = []
        self._lock = threading.Lock()

    def _connection(self) -> Any:
        import psycopg

        connection = getattr(self._local, "connection", None)
        if connection is None:
            connection = psycopg.connect(self.conninfo, autocommit=True, prepare_threshold=0)
            self._local.connection = connection
            with self._lock:
                self._opened.append(connection)
        return connection

    def single(self, prefix: str) -> Callable[[int], object]:
        return lambda n: self._cycle(self.lease, f"{prefix}:{n}", None)

    def permit(self, key: str, limit: int) -> Callable[[int], object]:
        """Cycles of one of ``limit`` permits of ``key`` (its rows made by the API first:
        the captured statement grants a released permit only)."""
        from celery_fenced import acquire

        acquire(key, ttl=30, limit=limit, using=self.alias).release()
        return lambda n: self._cycle(self.permits, key, limit)

    def _cycle(self, captured: Any, key: str, limit: int | None) -> object:
        (grant, grant_params), (release, release_params) = captured
        owner = f"raw:{threading.get_ident()}"
        connection = self._connection()
        fields = {**grant_params, "key": key, "owner": owner}
        if limit is not None:
            fields["limit"] = limit
        for _attempt in range(10_000):  # none free, or a race lost: as the store, again
            rows = connection.execute(grant, fields).fetchall()
            if rows and rows[0][0] is not None:
                break
        else:
            raise RuntimeError(f"the captured grant statement never granted {key!r}")
        held = rows[0][5] if limit is not None else key  # a permit's row has its own key
        ending = {**release_params, "key": held, "token": rows[0][1], "owner": owner}
        if ending.get("only_owner") is not None:
            ending["only_owner"] = owner
        connection.execute(release, ending).fetchall()
        return _Released()

    def close(self) -> None:
        for connection in self._opened:
            connection.close()


class _Released:
    """What a raw cycle returns: released already (the loop calls ``release()``)."""

    def release(self) -> None:
        pass


def _captured(alias: str, key: str, limit: int | None) -> list[tuple[str, dict[str, Any]]]:
    """The two statements the store sends to grant ``key`` (a permit of it, with
    ``limit``) and release it, on its second grant (the first makes a permit's rows)."""
    from celery_fenced import acquire
    from celery_fenced.store import dialects

    acquire(key, ttl=30, limit=limit, using=alias).release()
    with statements_sent(dialects.PostgreSQL) as log:
        acquire(key, ttl=30, limit=limit, using=alias).release()
    if len(log) != 2:
        raise RuntimeError(f"a grant and a release sent {len(log)} statements, not 2")
    return log
