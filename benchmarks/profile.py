"""A deterministic profile of the worker's hot path: N fenced tasks against N plain ones.

``python -m benchmarks.profile [--tasks N] [--top K]`` (on demand; never run by the tests).
Both run in this one process through Celery's own tracer (``build_tracer``, as a pool
process runs a delivery, with the worker's optimizations installed), with the
connections kept, on PostgreSQL (``FENCED_PG_*``,
database ``BENCH_PG_NAME``, migrated here): ``bench.noop_fenced`` (``FencedTask``, its
result stored by ``FencedDatabaseBackend``) against ``bench.noop_plain`` (a plain task,
stored by django-celery-results' ``DatabaseBackend``). Each runs under ``cProfile``; the
report prints, per task, the top functions by cumulative time and the calls of
celery-fenced's own functions, side by side. Call counts are exact; times are the
profiler's (inflated by it, and noisy on a shared machine): read them as shares.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import uuid
from collections.abc import Callable
from typing import Any

Stats = dict[tuple[str, int, str], tuple[int, int, float, float, Any]]


def _setup() -> Any:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "benchmarks.settings")
    os.environ.setdefault("BENCH_DB_REUSE", "1")
    os.environ.setdefault("BENCH_RESULT_BACKEND", "celery_fenced.backends:FencedDatabaseBackend")
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    from testproject.celery import app

    app.loader.import_default_modules()
    from celery.app.trace import setup_worker_optimizations

    # as in a worker's pool process: Celery's own shortcut past Task.__call__
    setup_worker_optimizations(app, hostname="profile@localhost")
    from django_celery_results.backends.database import DatabaseBackend

    import benchmarks.tasks  # noqa: F401  (registers the tasks)

    # the plain task's result goes through django-celery-results' own backend
    app.tasks["bench.noop_plain"].backend = DatabaseBackend(app=app)
    return app


def _runner(app: Any, name: str) -> Callable[[int], Any]:
    """A function delivering job ``n`` of task ``name`` through Celery's tracer."""
    from celery.app.trace import build_tracer

    task = app.tasks[name]
    trace = build_tracer(task.name, task, app=app, hostname="profile@localhost")
    prefix = uuid.uuid4().hex[:8]

    def deliver(n: int) -> Any:
        task_id = f"{prefix}-{n}"
        request = {
            "id": task_id,
            "task": name,
            "args": [n],
            "kwargs": {},
            "delivery_info": {"exchange": "", "routing_key": "celery", "priority": 0},
            "hostname": "profile@localhost",
            "is_eager": False,
        }
        return trace(task_id, [n], {}, request)

    return deliver


def _profile(deliver: Callable[[int], Any], tasks: int) -> Stats:
    for n in range(-20, 0):  # warm: connections, plans, caches
        deliver(n)
    profiler = cProfile.Profile()
    profiler.enable()
    for n in range(tasks):
        deliver(n)
    profiler.disable()
    return pstats.Stats(profiler).stats  # type: ignore[attr-defined,no-any-return]


def _name(func: tuple[str, int, str]) -> str:
    path, line, function = func
    for marker in ("site-packages/", "/celery_fenced/", "/benchmarks/", "lib/python3"):
        if marker in path:
            path = path.split(marker, 1)[1]
            if marker == "/celery_fenced/":
                path = "celery_fenced/" + path
            break
    return f"{path}:{line}({function})" if line else function


def _ours(func: tuple[str, int, str]) -> bool:
    return "/celery_fenced/" in func[0]


def report(fenced: Stats, plain: Stats, tasks: int, top: int) -> str:
    """The side-by-side tables (per task: cumulative ms, calls)."""

    def cumulative(stats: Stats) -> dict[tuple[str, int, str], tuple[float, float]]:
        return {f: (ct / tasks * 1000, nc / tasks) for f, (_cc, nc, _tt, ct, _) in stats.items()}

    ours, theirs = cumulative(fenced), cumulative(plain)
    total_f = sum(tt for _cc, _nc, tt, _ct, _ in fenced.values()) / tasks * 1000
    total_p = sum(tt for _cc, _nc, tt, _ct, _ in plain.values()) / tasks * 1000
    lines = [
        f"{tasks} tasks each; profiled time per task: fenced {total_f:.3f} ms, "
        f"plain {total_p:.3f} ms ({total_f / total_p:.2f}x)",
        "",
        f"{'fenced: cumulative ms/task':>28} {'calls/task':>10} | {'plain ms':>8} "
        f"{'calls':>6} | function",
    ]
    for func, (ms, calls) in sorted(ours.items(), key=lambda item: -item[1][0])[:top]:
        p_ms, p_calls = theirs.get(func, (0.0, 0.0))
        lines.append(f"{ms:28.3f} {calls:10.1f} | {p_ms:8.3f} {p_calls:6.1f} | {_name(func)}")
    lines += ["", f"{'celery-fenced functions: calls/task':>36} {'cum ms/task':>11} | function"]
    mine = [(f, v) for f, v in ours.items() if _ours(f)]
    for func, (ms, calls) in sorted(mine, key=lambda item: -item[1][0]):
        lines.append(f"{calls:36.1f} {ms:11.3f} | {_name(func)}")
    lines += ["", f"{'extra calls/task (fenced - plain)':>36} {'fenced':>8} | function"]
    extra = sorted(
        ((f, calls - theirs.get(f, (0.0, 0.0))[1], calls) for f, (_ms, calls) in ours.items()),
        key=lambda item: -item[1],
    )
    for func, more, calls in extra[:top]:
        lines.append(f"{more:36.1f} {calls:8.1f} | {_name(func)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=500, help="tasks of each kind")
    parser.add_argument("--top", type=int, default=40, help="rows of the cumulative table")
    args = parser.parse_args(argv)
    app = _setup()
    fenced = _profile(_runner(app, "bench.noop_fenced"), args.tasks)
    plain = _profile(_runner(app, "bench.noop_plain"), args.tasks)
    print(report(fenced, plain, args.tasks, args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
