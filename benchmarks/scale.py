"""Row 4: does acquire slow down as the lease table grows, and how long does pruning take?

Two PostgreSQL databases, migrated alike: one with ``small_rows`` lease rows, one with
``large_rows`` (1,000 vs 1,000,000 in the full run), bulk-inserted with
``generate_series``, each with as many events (history that a real installation keeps).
1% of the rows are held leases, the rest released. The samples alternate between the two
databases in chunks of 50 (the order rotating), each one ``acquire()`` of a random released
key, timed, then its untimed ``release()``.

Pruning: the events of the large database (all older than a day), deleted by
``celery_fenced.operations.prune_events`` (what ``manage.py fenced prune`` runs) when the
package has it, otherwise by a batched ``DELETE`` by id ranges of 10,000.
"""

from __future__ import annotations

import random
import time

from benchmarks.common import (
    Context,
    Line,
    insert_select,
    median,
    millis,
    percentile,
    rate,
    ratio,
)

CHUNK = 50
PRUNE_BATCH = 10_000


def _populate(alias: str, rows: int) -> None:
    from django.db import connections

    from celery_fenced.models import Lease, LeaseEvent

    held = "mod(g, 100) = 0"
    past = "now() - interval '3 days'"
    leases = insert_select(
        alias,
        Lease,
        {
            "key": "'job:' || g",
            "token": "1 + mod(g, 7)",
            "owner": "'host-' || mod(g, 97) || ':' || g",
            "task_id": "md5(g::text)",
            "task_name": "'app.tasks.job' || mod(g, 50)",
            "acquired_at": past,
            "renewed_at": past,
            "expires_at": f"CASE WHEN {held} THEN now() + interval '1 day' "
            f"ELSE {past} + interval '30 seconds' END",
            "released_at": f"CASE WHEN {held} THEN NULL ELSE {past} + interval '5 seconds' END",
        },
        f"FROM generate_series(1, {int(rows)}) g",
    )
    events = insert_select(
        alias,
        LeaseEvent,
        {
            "lease_id": f"l.id + mod(g, {int(rows)})",
            "kind": "CASE WHEN mod(g, 2) = 0 THEN 'acquired' ELSE 'released' END",
            "token": "1",
            "task_id": "md5(g::text)",
            "owner": "'host'",
            "at": past,
            "detail": "'{}'::jsonb",
        },
        f"FROM generate_series(1, {int(rows)}) g, "
        "(SELECT min(id) AS id FROM celery_fenced_lease) l",
    )
    with connections[alias].cursor() as cursor:
        # history is consistent by construction; skip the per-row foreign-key triggers
        cursor.execute("SET session_replication_role = replica")
        cursor.execute(*leases)
        cursor.execute(*events)
        cursor.execute("SET session_replication_role = DEFAULT")
        cursor.execute("VACUUM ANALYZE celery_fenced_lease")
        cursor.execute("VACUUM ANALYZE celery_fenced_leaseevent")


def _sample(alias: str, rows: int, count: int, rng: random.Random) -> list[float]:
    from celery_fenced import acquire

    samples = []
    for _ in range(count):
        n = rng.randrange(1, rows + 1)
        if n % 100 == 0:  # a held lease: take its neighbour
            n -= 1
        started = time.perf_counter()
        lease = acquire(f"job:{n}", ttl=30, using=alias)
        samples.append(time.perf_counter() - started)
        lease.release()
    return samples


def _gauges(alias: str, count: int = 20) -> list[float]:
    """Seconds of each reading of the metrics view's database gauges (1% of rows held)."""
    from celery_fenced import metrics

    metrics.database_gauges(alias)  # warm
    timings = []
    for _ in range(count):
        started = time.perf_counter()
        metrics.database_gauges(alias)
        timings.append(time.perf_counter() - started)
    return timings


def _prune(alias: str) -> tuple[float, int, str]:
    """Delete the large database's events; (seconds, events deleted, how)."""
    import importlib

    from django.db import connections

    try:
        prune_events = importlib.import_module("celery_fenced.operations").prune_events
    except (ImportError, AttributeError):
        prune_events = None
    if prune_events is not None:
        started = time.perf_counter()
        deleted = int(prune_events(older_than_days=1, using=alias))
        took = time.perf_counter() - started
        return took, deleted, "`celery_fenced.operations.prune_events`"
    with connections[alias].cursor() as cursor:
        cursor.execute("SELECT min(id), max(id) FROM celery_fenced_leaseevent")
        low, high = cursor.fetchone()
        started = time.perf_counter()
        deleted = 0
        for start in range(low, high + 1, PRUNE_BATCH):
            cursor.execute(
                """DELETE FROM celery_fenced_leaseevent
                   WHERE id >= %s AND id < %s AND at < now() - interval '1 day'""",
                [start, start + PRUNE_BATCH],
            )
            deleted += cursor.rowcount
        took = time.perf_counter() - started
    how = f"batched DELETE by id ranges of {PRUNE_BATCH:,} (the package has no prune function)"
    return took, deleted, how


def run(ctx: Context) -> list[Line]:
    profile = ctx.profile
    small, large = ctx.scale_databases
    sizes = {small: profile.small_rows, large: profile.large_rows}
    started = time.perf_counter()
    for alias, rows in sizes.items():
        _populate(alias, rows)
    populate_seconds = time.perf_counter() - started
    rng = random.Random(42)
    for alias, rows in sizes.items():  # warm up: connections, caches
        _sample(alias, rows, 20, rng)
    samples: dict[str, list[float]] = {small: [], large: []}
    chunks = max(1, profile.latency_samples // CHUNK)
    for chunk in range(chunks):
        order = (small, large) if chunk % 2 == 0 else (large, small)
        for alias in order:
            samples[alias] += _sample(
                alias, sizes[alias], min(CHUNK, profile.latency_samples), rng
            )
    gauges = {alias: _gauges(alias) for alias in (small, large)}
    prune_seconds, pruned, how = _prune(large)
    ctx.data["scale"] = {
        "rows": sizes,
        "populate_seconds": populate_seconds,
        "samples": {a: sorted(s) for a, s in samples.items()},
        "prune": {"seconds": prune_seconds, "events": pruned, "how": how},
        "metrics_gauges": gauges,
    }
    p50 = {a: median(s) for a, s in samples.items()}
    p99 = {a: percentile(s, 0.99) for a, s in samples.items()}
    big, few = f"{sizes[large]:,}", f"{sizes[small]:,}"
    prune_rate = rate(pruned / prune_seconds) if prune_seconds > 0 else "n/a"
    return [
        Line(
            row="4 scale",
            case=f"acquire p50, {big} vs {few} lease rows",
            measured=millis(p50[large]),
            baseline=millis(p50[small]),
            ratio=ratio(p50[large], p50[small]),
            target="≤ 1.20x",
            kind="max",
            limit=1.20,
        ),
        Line(
            row="4 scale",
            case=f"acquire p99, {big} vs {few} lease rows",
            measured=millis(p99[large]),
            baseline=millis(p99[small]),
            ratio=ratio(p99[large], p99[small]),
            target="≤ 1.20x",
            kind="max",
            limit=1.20,
        ),
        Line(
            row="4 scale",
            case=f"the metrics view's database gauges (p50 of 20), {big} vs {few} lease rows",
            measured=millis(median(gauges[large])),
            baseline=millis(median(gauges[small])),
            ratio=ratio(median(gauges[large]), median(gauges[small])),
        ),
        Line(
            row="4 scale",
            case=f"prune {pruned:,} events: {how}",
            measured=f"{prune_seconds:.1f} s ({prune_rate})",
            baseline="",
        ),
    ]
