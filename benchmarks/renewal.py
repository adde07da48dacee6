"""Row 5: renewal statements per second with 200 leases held by one process.

One ``celery_fenced.renewal.Renewer`` (the per-process renewal thread of a worker) holds
``renew_leases`` leases taken with ``acquire()`` on PostgreSQL (ttl 3 s, so each is renewed
every second). They are taken one by one over a renewal interval — tasks start at
different times, the batching's hard case — and then PostgreSQL counts the renewal
statements over the window. A design that renews each lease with its own statement sends
``leases / (ttl / 3)`` per second.
"""

from __future__ import annotations

import time

from benchmarks.common import Context, Line


def run(ctx: Context) -> list[Line]:
    from django.db import connections

    from celery_fenced import acquire
    from celery_fenced.renewal import Renewer

    profile = ctx.profile
    count, ttl = profile.renew_leases, profile.renew_ttl
    interval = ttl / 3
    renewer = Renewer()
    leases = []
    for n in range(count):
        lease = acquire(f"renew:{n}", ttl=ttl)
        leases.append(lease)
        renewer.register(lease)
        time.sleep(interval / count)
    time.sleep(interval)  # one full interval: the steady state
    try:
        with ctx.count_statements() as read:
            started = time.monotonic()
            time.sleep(profile.renew_window)
            window = time.monotonic() - started
            rows = [
                r
                for r in read()
                if "renewed_at" in r.query and r.query.lstrip().startswith("WITH")
            ]
    finally:
        for lease in leases:
            renewer.unregister(lease)
        lost = sum(lease.lost for lease in leases)
        for lease in leases:
            if not lease.lost:
                lease.release()
        connections.close_all()
    statements = sum(row.calls for row in rows)
    renewed = sum(row.rows for row in rows)
    naive = count / interval
    per_second = statements / window
    ctx.data["renewal"] = {
        "leases": count,
        "ttl": ttl,
        "window": window,
        "statements": statements,
        "leases_renewed": renewed,
        "lost": lost,
    }
    # a lease lost on a loaded machine (a smoke run beside other work) is a measurement,
    # reported in the line; only a run of documented numbers refuses it
    if lost and profile.name != "smoke":
        raise RuntimeError(f"{lost} of {count} leases were lost during the renewal benchmark")
    return [
        Line(
            row="5 renewal",
            case=(
                f"{count} leases in one process, ttl {ttl:g} s: renewal statements/s "
                f"({renewed / window:,.0f} lease renewals/s, "
                f"{renewed / max(statements, 1):.0f} per statement"
                f"{f'; {lost} lost' if lost else ''})"
            ),
            measured=f"{per_second:.1f}/s",
            baseline=f"{naive:,.0f}/s (one per lease)",
            ratio=per_second / naive if window > 0 else None,
            target="batched (≤ 0.10x)",
            kind="max",
            limit=0.10,
        )
    ]
