"""Row 8: atomic bodies (``lease_atomic``) against ``fenced_update``, end to end.

Measured as row 1 is (:mod:`benchmarks.e2e`): one ``celery worker`` per variant (prefork,
concurrency 2, Redis broker, PostgreSQL, database connections kept, the fenced result
backend), each on its own queue, batches alternating between the variants. Two pairs:

- an atomic no-op (``bench.noop_atomic``) against the fenced no-op (``bench.noop_fenced``):
  what holding the body's transaction open costs;
- an atomic task doing one plain ``QuerySet.update()`` of its job's row
  (``bench.write_atomic``) against a fenced task doing that write with ``fenced_update``
  (``bench.write_fenced``): the two ways of fencing a task's write.

Wall time, CPU (worker, PostgreSQL, Redis) and the statements each execution sends, the
atomic variant's over the other's. The issue that asked for atomic bodies sets no target:
the lines are informational.
"""

from __future__ import annotations

from typing import Any

from benchmarks.common import (
    Context,
    Line,
    batches_time,
    cpu_per_task,
    median_or_none,
    ratios,
    rotated,
    spread,
    statements_per_task,
)
from benchmarks.e2e import FENCED_BACKEND, Variant, _start_workers, _statements, run_batch

ROW = "8 atomic"

VARIANTS = (
    Variant("atomic-noop", "atomic no-op", "bench.noop_atomic", FENCED_BACKEND, True),
    Variant("fenced-noop", "fenced no-op", "bench.noop_fenced", FENCED_BACKEND, True),
    Variant("atomic-write", "atomic, one update()", "bench.write_atomic", FENCED_BACKEND, True),
    Variant("fenced-write", "fenced_update", "bench.write_fenced", FENCED_BACKEND, True),
)

#: (measured, compared with, case)
PAIRS = (
    ("atomic-noop", "fenced-noop", "atomic no-op vs fenced no-op"),
    (
        "atomic-write",
        "fenced-write",
        "one write: atomic body's plain update() vs fenced_update",
    ),
)

#: the ``Report`` rows the write tasks update, by variant (``{job}`` filled in)
ROWS = {"atomic-write": "bench-write-atomic:{job}", "fenced-write": "bench-write-fenced:{job}"}


def _create_rows(jobs: int) -> None:
    """One ``Report`` row per write variant and job number (jobs run ``0..jobs-1``)."""
    from testproject.demo.models import Report

    Report.objects.bulk_create(
        [Report(name=pattern.format(job=job)) for pattern in ROWS.values() for job in range(jobs)],
        ignore_conflicts=True,
    )


def _delete_rows() -> None:
    from testproject.demo.models import Report

    for pattern in ROWS.values():
        Report.objects.filter(name__startswith=pattern.split("{")[0]).delete()


def run(ctx: Context) -> list[Line]:
    profile = ctx.profile
    warm = min(profile.tasks, 50)
    batch = max(1, profile.tasks // profile.e2e_rounds)
    _create_rows(max(warm, batch, profile.count_tasks))
    workers = _start_workers(ctx, VARIANTS)
    try:
        for variant in VARIANTS:  # warm up: imports, connections, the lease rows
            run_batch(ctx, variant, warm, workers)
        times: dict[str, list[float]] = {v.name: [] for v in VARIANTS}
        cpu: dict[str, list[float]] = {v.name: [] for v in VARIANTS}
        for round_no in range(profile.e2e_rounds):
            for variant in rotated(VARIANTS, round_no):
                wall, spent = run_batch(ctx, variant, batch, workers)
                times[variant.name].append(wall)
                cpu[variant.name].append(sum(spent.values()))
        counts = {v.name: _statements(ctx, v, workers) for v in VARIANTS}
    finally:
        for worker in workers.values():
            worker.stop()
        _delete_rows()
    ctx.data["atomic"] = {
        "batch": batch,
        "seconds": times,
        "cpu_seconds": cpu,
        "statements": counts,
    }
    return _lines(batch, times, cpu, counts)


def _lines(
    batch: int,
    times: dict[str, list[float]],
    cpu: dict[str, list[float]],
    counts: dict[str, dict[str, Any]],
) -> list[Line]:
    rounds = len(next(iter(times.values())))
    tasks = f"{batch * rounds:,} tasks ({rounds} batches of {batch:,})"

    def wall(name: str) -> str:
        return batches_time(times[name], batch)

    def per_task(name: str) -> str:
        return cpu_per_task(cpu[name], batch)

    def statements(name: str) -> str:
        return statements_per_task(counts[name])

    lines = []
    for name, base, case in PAIRS:
        r = ratios(times[name], times[base])
        lines.append(
            Line(
                row=ROW,
                case=f"{tasks}, connections kept: {case}",
                measured=wall(name),
                baseline=wall(base),
                ratio=median_or_none(r),
                spread=spread(r),
            )
        )
    for name, base, case in PAIRS:
        r = ratios(cpu[name], cpu[base])
        lines.append(
            Line(
                row=ROW,
                case=f"CPU (worker + PostgreSQL + Redis): {case}",
                measured=per_task(name),
                baseline=per_task(base),
                ratio=median_or_none(r),
                spread=spread(r),
            )
        )
    for name, base, case in PAIRS:
        more = counts[name]["total"] - counts[base]["total"]
        lines.append(
            Line(
                row=ROW,
                case=f"SQL statements per task: {case}",
                measured=statements(name),
                baseline=statements(base),
                ratio=more,
                ratio_text=f"{more:+.1f}",
                plot=False,
            )
        )
    return lines
