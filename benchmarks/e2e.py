"""Rows 1 and 2: no-op tasks through real workers, and the SQL each task execution sends.

One ``celery worker`` per variant (prefork, concurrency 2, Redis broker, PostgreSQL),
all started before the first batch and each on its own queue. Each variant's ``tasks``
are sent in ``e2e_rounds`` batches that alternate between the variants (the order rotates
each round), so the machine's load falls on all of them alike. A batch's time runs from
its first message sent to its last result row's ``date_done``; a variant's time is the
sum over its batches, and a ratio is the median of the per-round ratios. Beside the wall
time, the CPU the batch cost is read from ``/proc``: the worker's processes, PostgreSQL's
(every connection) and Redis's — what other load on the machine disturbs much less.
"""

from __future__ import annotations

import pickle
import re
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import (
    WORKER_ROLE,
    Context,
    Counted,
    Line,
    batches_time,
    cpu_per_task,
    cpu_seconds,
    median_or_none,
    ratios,
    rotated,
    servers_cpu_parts,
    spread,
    statements_per_task,
    statements_sent,
    worker_env,
)

PLAIN_BACKEND = "django_celery_results.backends.database:DatabaseBackend"
FENCED_BACKEND = "celery_fenced.backends:FencedDatabaseBackend"
TRANSACTION_CONTROL = ("BEGIN", "COMMIT", "ROLLBACK", "SAVEPOINT", "RELEASE")


@dataclass(frozen=True)
class Variant:
    name: str
    label: str
    task: str
    backend: str
    reuse: bool = False  # keep database connections across tasks
    events: str = "anomalies"  # fenced_events: "all" records every grant and release too
    #: how the runner publishes: ``"send_task"`` by name (Celery's message alone), or
    #: ``"delay"``, the task's own ``apply_async`` as user code calls it (a fenced job
    #: through the outbox: its row recorded, then the message sent)
    publish: str = "send_task"
    #: the variant whose worker runs these jobs (by default its own)
    worker: str = ""

    @property
    def runs_on(self) -> str:
        return self.worker or self.name


VARIANTS = (
    Variant("plain", "plain Task + DatabaseBackend", "bench.noop_plain", PLAIN_BACKEND),
    Variant("fenced", "FencedTask + FencedDatabaseBackend", "bench.noop_fenced", FENCED_BACKEND),
    # the full audit trail: an acquired and a released event per execution
    Variant(
        "fenced-all",
        "fenced, fenced_events='all'",
        "bench.noop_fenced",
        FENCED_BACKEND,
        events="all",
    ),
    Variant(
        "redis-lock", "plain Task + Redis SET NX lock", "bench.noop_redis_lock", PLAIN_BACKEND
    ),
    # Celery opens a database connection per task unless told to keep them; without that
    # cost, what the lease costs shows more.
    Variant("plain-reuse", "plain, connections kept", "bench.noop_plain", PLAIN_BACKEND, True),
    Variant("fenced-reuse", "fenced, connections kept", "bench.noop_fenced", FENCED_BACKEND, True),
    # FencedTask acks late (a lost worker's job is redelivered): this separates what late
    # acknowledgement costs from what the lease costs
    Variant(
        "plain-acks-late-reuse",
        "plain, acks_late, connections kept",
        "bench.noop_plain_acks_late",
        PLAIN_BACKEND,
        True,
    ),
    # the floor of "fenced-reuse": a plain task acknowledged late that sends the fenced
    # execution's two statements raw, prepared, and runs no package code
    Variant(
        "floor-reuse",
        "floor: plain acks_late + the fenced statements raw, prepared, kept",
        "bench.noop_floor",
        PLAIN_BACKEND,
        True,
    ),
    # what user code does: ``.delay()`` (``apply_async``), a fenced job through the outbox,
    # on the same workers as the two "connections kept" variants
    Variant(
        "plain-delay",
        "plain .delay(), connections kept",
        "bench.noop_plain",
        PLAIN_BACKEND,
        True,
        publish="delay",
        worker="plain-reuse",
    ),
    Variant(
        "fenced-delay",
        "fenced .delay() through the outbox, connections kept",
        "bench.noop_fenced",
        FENCED_BACKEND,
        True,
        publish="delay",
        worker="fenced-reuse",
    ),
)


def _queue(variant: Variant) -> str:
    return f"bench-{variant.runs_on}"


def _start_workers(ctx: Context, variants: Sequence[Variant] = VARIANTS) -> dict[str, Any]:
    """One worker per variant, on the variant's queue, ready: name -> ``Worker``."""
    from devtools.workers import Worker

    env = {
        **worker_env(ctx),
        "FENCED_PG_USER": WORKER_ROLE,
        "BENCH_FLOOR_STATEMENTS": str(_capture_floor(ctx)),
    }
    workers: dict[str, Any] = {}
    try:
        for variant in variants:
            if variant.runs_on != variant.name:
                continue  # published differently, to another variant's worker
            workers[variant.name] = Worker(
                f"bench-{variant.name}",
                database="postgres",
                queue=_queue(variant),
                concurrency=2,
                env={
                    **env,
                    "BENCH_RESULT_BACKEND": variant.backend,
                    "BENCH_DB_REUSE": "1" if variant.reuse else "0",
                    "FENCED_EVENTS": variant.events,
                },
                log_dir=ctx.work,
            )
        for worker in workers.values():
            worker.wait_ready(timeout=180)
    except BaseException:
        for worker in workers.values():
            worker.stop()
        raise
    return workers


def _capture_floor(ctx: Context) -> Path:
    """The two statements a fenced execution of ``bench.noop_fenced`` sends (its grant,
    then the release that writes its result row), captured from one run through Celery's
    tracer with the fenced backend, on its key's second grant; saved for the floor's task
    (``bench.noop_floor``) with the workers' connection string."""
    from celery.app.trace import build_tracer

    import benchmarks.tasks  # noqa: F401 - registers the tasks in this process
    from celery_fenced.backends import FencedDatabaseBackend
    from celery_fenced.store import dialects
    from testproject.celery import app

    task = app.tasks["bench.noop_fenced"]
    task.backend = FencedDatabaseBackend(app=app)
    try:
        trace = build_tracer(task.name, task, app=app, hostname="floor@capture")

        def run_once() -> None:
            task_id = f"floor-capture-{uuid.uuid4().hex}"
            request = {
                "id": task_id,
                "task": task.name,
                "args": [-1],
                "kwargs": {},
                "delivery_info": {"exchange": "", "routing_key": "floor", "priority": 0},
                "hostname": "floor@capture",
                "is_eager": False,
            }
            outcome = trace(task_id, [-1], {}, request)
            if outcome.info is not None:
                raise RuntimeError(f"the floor's capture run failed: {outcome}")

        run_once()  # the key's row made, as every key's is after the warm-up
        with statements_sent(dialects.PostgreSQL) as sent:
            run_once()
    finally:
        task.backend = None
    if len(sent) != 2:
        raise RuntimeError(f"a fenced execution sent {len(sent)} statements, not 2: {sent}")
    path = ctx.work / "floor-statements.pickle"
    with path.open("wb") as out:
        pickle.dump((ctx.conninfo(user=WORKER_ROLE), sent[0], sent[1]), out)
    return path


def _truncate_results() -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE django_celery_results_taskresult")


def _progress() -> tuple[int, int, float | None]:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            """SELECT count(*), count(*) FILTER (WHERE status <> 'SUCCESS'),
                      extract(epoch FROM max(date_done))
               FROM django_celery_results_taskresult"""
        )
        done, failed, last = cursor.fetchone()
    return int(done), int(failed), (float(last) if last is not None else None)


def run_batch(
    ctx: Context, variant: Variant, count: int, workers: dict[str, Any]
) -> tuple[float, dict[str, float]]:
    """Send ``count`` tasks of ``variant``: seconds from the first send to the last result,
    and CPU seconds spent meanwhile by the worker, PostgreSQL and Redis (:data:`PARTS`)."""
    from testproject.celery import app

    _truncate_results()
    worker = workers[variant.runs_on].process.pid  # its process group (a new session)

    def cpu_parts() -> dict[str, float]:
        return {"worker": cpu_seconds(group=worker), **servers_cpu_parts(ctx)}

    cpu = cpu_parts()
    run = uuid.uuid4().hex[:6]
    send = app.send_task if variant.publish == "send_task" else _delay(app, variant.task)
    started = time.time()
    for job in range(count):
        send(
            variant.task,
            args=[job],
            queue=_queue(variant),
            task_id=f"{variant.name}-{run}-{job}",
        )
    deadline = time.monotonic() + 60 + count * 0.2
    while True:
        done, failed, last = _progress()
        if failed:
            raise RuntimeError(
                f"{failed} {variant.name} tasks did not succeed; worker log:\n"
                + workers[variant.runs_on].output()[-3000:]
            )
        if done >= count and last is not None:
            spent = {part: seconds - cpu[part] for part, seconds in cpu_parts().items()}
            return last - started, spent
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{variant.name}: {done}/{count} results after the deadline; worker log:\n"
                + workers[variant.runs_on].output()[-3000:]
            )
        time.sleep(0.2)


def _delay(app: Any, name: str) -> Any:
    """A ``send_task``-shaped call of task ``name``'s own ``apply_async``."""
    import benchmarks.tasks  # noqa: F401 - registers the tasks in this process

    task = app.tasks[name]

    def send(_name: str, **options: Any) -> Any:
        return task.apply_async(**options)

    return send


def _statements(ctx: Context, variant: Variant, workers: dict[str, Any]) -> dict[str, Any]:
    """Statements the worker role sent per task of ``variant``, counted by PostgreSQL."""
    count = ctx.profile.count_tasks
    _truncate_results()
    with ctx.count_statements() as read:
        run_batch(ctx, variant, count, workers)
        time.sleep(0.5)  # nothing should follow the result row; make sure of it
        rows = [r for r in read() if r[0] == WORKER_ROLE]
    total = sum(row.calls for row in rows)
    control = sum(
        row.calls for row in rows if row.query.lstrip().upper().startswith(TRANSACTION_CONTROL)
    )
    return {
        "total": total / count,
        "data": (total - control) / count,
        "control": control / count,
        "exec_ms": sum(row.exec_ms for row in rows) / count,
        "statements": _grouped(rows, count),
    }


def _grouped(rows: list[Counted], count: int) -> list[tuple[str, float]]:
    """Calls per task by statement, savepoints (each with its own name) counted together."""
    calls: dict[str, int] = {}
    for row in rows:
        text = re.sub(r'SAVEPOINT "[^"]*"', "SAVEPOINT …", " ".join(row.query.split()))[:120]
        calls[text] = calls.get(text, 0) + row.calls
    return sorted(((q, n / count) for q, n in calls.items()), key=lambda x: -x[1])


def run(ctx: Context) -> list[Line]:
    profile = ctx.profile
    workers = _start_workers(ctx)
    try:
        for variant in VARIANTS:  # warm up: imports, connections, the lease rows
            run_batch(ctx, variant, min(profile.tasks, 50), workers)
        times: dict[str, list[float]] = {v.name: [] for v in VARIANTS}
        cpu: dict[str, list[float]] = {v.name: [] for v in VARIANTS}
        parts: dict[str, dict[str, list[float]]] = {v.name: {} for v in VARIANTS}
        batch = max(1, profile.tasks // profile.e2e_rounds)
        for round_no in range(profile.e2e_rounds):
            for variant in rotated(VARIANTS, round_no):
                wall, spent = run_batch(ctx, variant, batch, workers)
                times[variant.name].append(wall)
                cpu[variant.name].append(sum(spent.values()))
                for part, seconds in spent.items():
                    parts[variant.name].setdefault(part, []).append(seconds)
        counted = ("plain", "fenced", "fenced-all")
        counts = {v.name: _statements(ctx, v, workers) for v in VARIANTS if v.name in counted}
    finally:
        for worker in workers.values():
            worker.stop()
    ctx.data["e2e"] = {"batch": batch, "seconds": times, "cpu_seconds": cpu, "cpu_parts": parts}
    ctx.data["statements"] = counts
    return _lines(batch, times, cpu, counts, parts)


def _lines(
    batch: int,
    times: dict[str, list[float]],
    cpu: dict[str, list[float]],
    counts: dict[str, dict[str, Any]],
    parts: dict[str, dict[str, list[float]]],
) -> list[Line]:
    def per_round(name: str, base: str, values: dict[str, list[float]]) -> list[float]:
        return ratios(values[name], values[base])

    def per_task(name: str) -> str:
        return cpu_per_task(cpu[name], batch)

    def shown(name: str) -> str:
        return batches_time(times[name], batch)

    tasks = batch * len(next(iter(times.values())))
    batches = f"{len(next(iter(times.values())))} batches of {batch:,}"

    lines = []
    # (variant, baseline, case, target): ("max", limit) or None
    compared: tuple[tuple[str, str, str, float | None], ...] = (
        ("fenced", "plain", "fenced vs plain", 1.10),
        ("fenced-all", "plain", "fenced, fenced_events='all', vs plain", None),
        ("fenced-reuse", "plain-reuse", "fenced vs plain, connections kept", 1.10),
        ("redis-lock", "plain", "Redis lock vs plain", None),
        ("fenced-reuse", "plain-acks-late-reuse", "fenced vs plain acks_late, kept", 1.05),
        # the floor: what is left of the two lines above with no package code running
        ("floor-reuse", "plain-reuse", "floor (the statements raw) vs plain, kept", None),
        ("floor-reuse", "plain-acks-late-reuse", "floor vs plain acks_late, kept", None),
        ("fenced-reuse", "floor-reuse", "fenced vs its floor, kept", None),
        ("fenced-delay", "plain-delay", ".delay(): fenced (outbox) vs plain, kept", None),
    )
    for name, base, case, limit in compared:
        r = per_round(name, base, times)
        lines.append(
            Line(
                row="1 end to end",
                case=f"{tasks:,} no-op tasks ({batches}): {case}",
                measured=shown(name),
                baseline=shown(base),
                ratio=median_or_none(r),
                spread=spread(r),
                target=f"≤ {limit:.2f}x" if limit else "",
                kind="max" if limit else None,
                limit=limit,
            )
        )
    cpu_limits = {("fenced-reuse", "plain-reuse"): 1.10}
    for name, base, case, _ in compared:
        r = per_round(name, base, cpu)
        limit = cpu_limits.get((name, base))
        lines.append(
            Line(
                row="1 end to end",
                case=f"CPU (worker + PostgreSQL + Redis): {case}",
                measured=per_task(name),
                baseline=per_task(base),
                ratio=median_or_none(r),
                spread=spread(r),
                target=f"≤ {limit:.2f}x" if limit else "",
                kind="max" if limit else None,
                limit=limit,
            )
        )
    # where the kept variants' CPU goes: the worker's processes, PostgreSQL, Redis
    for part in parts["fenced-reuse"]:
        r = ratios(parts["fenced-reuse"][part], parts["plain-reuse"][part])
        lines.append(
            Line(
                row="1 end to end",
                case=f"CPU of {part} alone: fenced vs plain, connections kept",
                measured=cpu_per_task(parts["fenced-reuse"][part], batch),
                baseline=cpu_per_task(parts["plain-reuse"][part], batch),
                ratio=median_or_none(r),
                spread=spread(r),
            )
        )
    plain, fenced, every = counts["plain"], counts["fenced"], counts["fenced-all"]

    statements = statements_per_task

    lines.append(
        Line(
            row="2 round trips",
            case="SQL statements per task, fenced vs plain",
            measured=statements(fenced),
            baseline=statements(plain),
            ratio=fenced["total"] - plain["total"],
            ratio_text=f"{fenced['total'] - plain['total']:+.1f}",
            target="≤ +1",
            kind="max",
            limit=1.0,
            plot=False,
        )
    )
    lines.append(
        Line(
            row="2 round trips",
            case="the same, fenced_events='all' (statements; each event is a row more)",
            measured=statements(every),
            baseline=statements(plain),
            ratio=every["total"] - plain["total"],
            ratio_text=f"{every['total'] - plain['total']:+.1f}",
            plot=False,
        )
    )
    lines.append(
        Line(
            row="2 round trips",
            case="PostgreSQL's own execution time per task (pg_stat_statements), fenced vs plain",
            measured=f"{fenced['exec_ms'] * 1000:.0f} µs",
            baseline=f"{plain['exec_ms'] * 1000:.0f} µs",
            ratio=fenced["exec_ms"] / plain["exec_ms"] if plain["exec_ms"] else None,
        )
    )
    lines.append(
        Line(
            row="2 round trips",
            case="the same, without BEGIN/COMMIT/SAVEPOINT",
            measured=f"{fenced['data']:.1f}",
            baseline=f"{plain['data']:.1f}",
            ratio=fenced["data"] - plain["data"],
            ratio_text=f"{fenced['data'] - plain['data']:+.1f}",
            plot=False,
        )
    )
    return lines
