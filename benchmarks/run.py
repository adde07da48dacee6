"""The benchmarks' one command: ``bash benchmarks/run.sh`` (that is ``python -m benchmarks``).

Starts a throwaway PostgreSQL (with ``pg_stat_statements`` loaded, tracking off except
while statements are counted) and Redis through ``devtools.services``, runs the
benchmarks, prints one table, writes it between the markers of ``docs/benchmarks.md``
with a bar chart ``docs/benchmarks.svg``, and stops the servers.

``--quick`` measures less (about 2 minutes); ``--smoke`` only proves that every benchmark
runs (the test suite uses it; its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import atomic, e2e, locks, permits, publish, renewal, report, scale
from benchmarks.common import (
    MARIADB_DATABASE,
    WORKER_ROLE,
    Context,
    Line,
    Profile,
    repo_root,
    worker_env,
)

PG_OPTIONS = "-c shared_preload_libraries=pg_stat_statements"
DATABASE = "celery_fenced_bench"
SCALE_DATABASES = ("bench_small", "bench_large")

ROWS: dict[str, tuple[str, Callable[[Context], list[Line]]]] = {
    "e2e": ("rows 1-2: end to end, statements per task", e2e.run),
    "locks": ("row 3: lock cycles", locks.run),
    "scale": ("row 4: scale", scale.run),
    "renewal": ("row 5: renewal load", renewal.run),
    "publish": ("row 6: publishing through the outbox", publish.run),
    "permits": ("row 7: permits", permits.run),
    "atomic": ("row 8: atomic bodies against fenced_update", atomic.run),
}


def log(message: str) -> None:
    print(f"# {time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)


def prepare(ctx: Context) -> None:
    """Create the roles and databases, migrate them, configure Django in this process."""
    os.environ.update(worker_env(ctx))
    with ctx.admin("postgres") as conn:
        conn.execute(f"CREATE ROLE {WORKER_ROLE} SUPERUSER LOGIN")
        conn.execute(f"CREATE DATABASE {DATABASE}")
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connections

    if ctx.mariadb:
        import MySQLdb  # type: ignore[import-untyped]

        server = MySQLdb.connect(
            host=ctx.mariadb["FENCED_MARIADB_HOST"],
            port=int(ctx.mariadb["FENCED_MARIADB_PORT"]),
            user=ctx.mariadb["FENCED_MARIADB_USER"],
            password=ctx.mariadb["FENCED_MARIADB_PASSWORD"],
        )
        server.cursor().execute(f"CREATE DATABASE {MARIADB_DATABASE} CHARACTER SET utf8mb4")
        server.close()
    for alias in ("default", "sqlite", *(["mariadb"] if ctx.mariadb else [])):
        call_command("migrate", database=alias, verbosity=0)
    connections.close_all()
    with ctx.admin() as conn:
        conn.execute("CREATE EXTENSION pg_stat_statements")
        # off until a benchmark counts (a -c option would override ALTER SYSTEM)
        conn.execute("ALTER SYSTEM SET pg_stat_statements.track = 'none'")
        conn.execute("SELECT pg_reload_conf()")
    with ctx.admin("postgres") as conn:
        for name in ctx.scale_databases:
            conn.execute(f"CREATE DATABASE {name} TEMPLATE {DATABASE}")


def settle(ctx: Context) -> None:
    """Leave no work of an earlier row to PostgreSQL's background processes.

    A row leaves dead rows (a million of them after the scale row's pruning) that
    autovacuum would clean up while the next row measures, on a machine of two cores.
    Vacuum every benchmark database now, write the checkpoint, and wait until no
    autovacuum worker runs.
    """
    for name in (ctx.database, *ctx.scale_databases):
        with ctx.admin(name) as conn:
            conn.execute("VACUUM (ANALYZE)")
    with ctx.admin() as conn:
        conn.execute("CHECKPOINT")
        deadline = time.monotonic() + 120
        while (
            time.monotonic() < deadline
            and conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'autovacuum worker'"
            ).fetchone()[0]
        ):
            time.sleep(0.2)


def run_alone(ctx: Context, function: Callable[[Context], list[Line]]) -> list[Line]:
    """Run one row in a forked process of its own and bring back its lines and raw data.

    Each row starts from the state ``prepare`` left in this process: no thread, connection
    or cache of an earlier row, and one row's crash is reported, with its traceback.
    """
    import multiprocessing

    fork = multiprocessing.get_context("fork")
    receive, send = fork.Pipe(duplex=False)
    child = fork.Process(target=_row_child, args=(ctx, function, send))
    child.start()
    send.close()
    try:
        outcome = receive.recv()
    except EOFError:
        child.join()
        outcome = ("error", f"the row's process died (exit code {child.exitcode})")
    child.join()
    if outcome[0] == "error":
        raise RuntimeError(f"{function.__module__}: {outcome[1]}")
    lines, data = outcome[1]
    ctx.data.update(data)
    return lines  # type: ignore[no-any-return]


def _row_child(ctx: Context, function: Callable[[Context], list[Line]], send: Any) -> None:
    import traceback

    from django.db import connections

    try:
        lines = function(ctx)
        send.send(("ok", (lines, ctx.data)))
    except BaseException:
        send.send(("error", traceback.format_exc()))
    finally:
        connections.close_all()
        send.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__.split("\n\n")[0]
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="measure less (about 2 minutes)")
    size.add_argument("--smoke", action="store_true", help="tiny runs: prove the code works")
    parser.add_argument("--tasks", type=int, help="tasks per end-to-end batch (default 2,000)")
    parser.add_argument(
        "--only", action="append", choices=sorted(ROWS), help="run only these (repeatable)"
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=repo_root() / "docs" / "benchmarks.md",
        help="Markdown file whose results block is replaced (default docs/benchmarks.md)",
    )
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    parser.add_argument("--json", type=Path, help="also write the raw numbers here")
    args = parser.parse_args(argv)
    profile = Profile.named(
        "smoke" if args.smoke else "quick" if args.quick else "full", args.tasks
    )

    from devtools import services

    began = time.monotonic()
    load_start = report.machine()["load"]
    base = Path(tempfile.mkdtemp(prefix="celery-fenced-bench-servers."))
    base.chmod(0o755)
    work = Path(tempfile.mkdtemp(prefix="celery-fenced-bench."))
    try:
        log(f"{profile.name} run; starting PostgreSQL and Redis in {base}")
        pg = services.start_postgres(base, extra_options=PG_OPTIONS)
        redis_url = services.start_redis(base)["FENCED_REDIS_URL"]
        ctx = Context(
            profile=profile,
            pg={"host": pg["FENCED_PG_HOST"], "port": pg["FENCED_PG_PORT"], "user": "postgres"},
            database=DATABASE,
            redis_url=redis_url,
            sqlite_path=work / "bench.sqlite3",
            work=work,
            scale_databases=SCALE_DATABASES,
            servers=base,
        )
        if "permits" in (args.only or ROWS):  # the one row that compares MariaDB
            log("starting MariaDB")
            ctx.mariadb = services.start_mariadb(base)
        prepare(ctx)
        lines: list[Line] = []
        for name in [n for n in ROWS if not args.only or n in args.only]:
            title, function = ROWS[name]
            settle(ctx)
            log(title)
            lines += run_alone(ctx, function)
        header = {
            "machine": {**report.machine(), "load_start": load_start},
            "versions": report.versions(ctx),
        }
        header["machine"]["load_end"] = header["machine"].pop("load")
        block = report.results_markdown(ctx, lines, header, time.monotonic() - began)
        print(block)
        if not args.no_write:
            svg_path = args.output.with_suffix(".svg")
            svg_path.write_text(report.svg(lines))
            report.write_markdown(args.output, block, svg_path.name)
            log(f"wrote {args.output} and {svg_path}")
        if args.json:
            args.json.write_text(json.dumps(report.dump({**header, **ctx.data}), indent=1))
    finally:
        if "django" in sys.modules:
            from django.db import connections

            connections.close_all()
        services.stop(base)
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    log(f"done in {(time.monotonic() - began) / 60:.1f} min")
    return 0
