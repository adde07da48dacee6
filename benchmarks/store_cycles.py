"""Acquire+release cycles per second through celery_fenced.acquire / .release().

Run from the repo root with the test services up (see tests/run.sh), e.g.::

    eval "$(python -m tests.services start /tmp/bench)"
    python -m benchmarks.store_cycles --seconds 5

Prints cycles/s for 1 and 8 processes, 1 key and 10,000 keys, on SQLite and PostgreSQL,
and the SQL statements each operation sends.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import tempfile
import time
from typing import Any


def _setup(sqlite_path: str) -> None:
    os.environ["FENCED_SQLITE_PATH"] = sqlite_path
    os.environ.setdefault("FENCED_PG_NAME", "postgres")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")
    import django

    django.setup()


def _cycles(
    sqlite_path: str, alias: str, keys: int, seconds: float, barrier: Any, out: Any
) -> None:
    _setup(sqlite_path)
    from celery_fenced import LeaseBusy, acquire

    rng = random.Random(os.getpid())
    barrier.wait()
    done = busy = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        key = f"bench:{rng.randrange(keys)}"
        try:
            lease = acquire(key, ttl=30, using=alias)
        except LeaseBusy:
            busy += 1
            continue
        lease.release()
        done += 1
    out.put((done, busy))


def _prepare(sqlite_path: str) -> None:
    _setup(sqlite_path)
    from django.core.management import call_command
    from django.db import connections

    for alias in ("default", "postgres"):
        call_command("migrate", database=alias, verbosity=0)
    from celery_fenced.models import Lease

    for alias in ("default", "postgres"):
        Lease.objects.using(alias).all().delete()
    connections.close_all()


def _statements(sqlite_path: str) -> dict[str, dict[str, int]]:
    from django.db import connections
    from django.test.utils import CaptureQueriesContext

    from celery_fenced import acquire

    control = ("BEGIN", "COMMIT", "SAVEPOINT", "RELEASE", "ROLLBACK")
    counts: dict[str, dict[str, int]] = {}
    for alias in ("default", "postgres"):
        conn = connections[alias]
        row: dict[str, int] = {}
        with CaptureQueriesContext(conn) as q:
            lease = acquire("bench:statements", ttl=30, using=alias)
        row["acquire"] = sum(not s["sql"].upper().startswith(control) for s in q)
        with CaptureQueriesContext(conn) as q:
            lease.renew()
        row["renew"] = sum(not s["sql"].upper().startswith(control) for s in q)
        with CaptureQueriesContext(conn) as q:
            lease.release()
        row["release"] = sum(not s["sql"].upper().startswith(control) for s in q)
        counts[alias] = row
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    if not os.environ.get("FENCED_PG_PORT"):
        raise SystemExit("start the services first: see this module's docstring")
    sqlite_path = os.path.join(tempfile.mkdtemp(), "bench.sqlite3")
    _prepare(sqlite_path)
    counts = _statements(sqlite_path)
    print("statements (without BEGIN/COMMIT):")
    for alias, row in counts.items():
        print(f"  {'sqlite' if alias == 'default' else 'postgres':9} {row}")
    ctx = multiprocessing.get_context("spawn")
    print(f"\n{'database':9} {'procs':>5} {'keys':>6} {'cycles/s':>9} {'busy/s':>8}")
    for alias in ("default", "postgres"):
        for procs in (1, 8):
            for keys in (1, 10_000):
                barrier, out = ctx.Barrier(procs), ctx.Queue()
                workers = [
                    ctx.Process(
                        target=_cycles,
                        args=(sqlite_path, alias, keys, args.seconds, barrier, out),
                    )
                    for _ in range(procs)
                ]
                for w in workers:
                    w.start()
                results = [out.get(timeout=args.seconds + 120) for _ in workers]
                for w in workers:
                    w.join()
                done = sum(r[0] for r in results)
                busy = sum(r[1] for r in results)
                name = "sqlite" if alias == "default" else "postgres"
                print(
                    f"{name:9} {procs:>5} {keys:>6} {done / args.seconds:>9.0f} "
                    f"{busy / args.seconds:>8.0f}"
                )


if __name__ == "__main__":
    main()
