"""What every benchmark shares: the run profile, the servers' handles, statistics, table lines."""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple
from unittest import mock

#: the role the worker processes connect as, so PostgreSQL counts their statements apart
WORKER_ROLE = "bench_worker"


@dataclass(frozen=True)
class Profile:
    """How much to measure: ``full`` (the documented numbers), ``quick`` or ``smoke``."""

    name: str
    tasks: int  # row 1: tasks per variant, sent in ``e2e_rounds`` interleaved batches
    e2e_rounds: int
    count_tasks: int  # row 2: tasks whose statements are counted
    cycle_seconds: float  # row 3: seconds per measurement
    cycle_rounds: int
    processes: tuple[int, ...]
    keys: tuple[int, ...]
    small_rows: int  # row 4
    large_rows: int
    latency_samples: int  # per database, over all chunks
    renew_leases: int  # row 5
    renew_ttl: float
    renew_window: float

    @classmethod
    def named(cls, name: str, tasks: int | None = None) -> Profile:
        profiles = {
            "full": cls(
                name="full",
                tasks=2000,
                e2e_rounds=8,
                count_tasks=200,
                cycle_seconds=0.6,
                cycle_rounds=5,
                processes=(1, 8),
                keys=(1, 10_000),
                small_rows=1_000,
                large_rows=1_000_000,
                latency_samples=2000,
                renew_leases=200,
                renew_ttl=3.0,
                renew_window=9.0,
            ),
            "quick": cls(
                name="quick",
                tasks=300,
                e2e_rounds=2,
                count_tasks=100,
                cycle_seconds=0.4,
                cycle_rounds=3,
                processes=(1, 8),
                keys=(1, 10_000),
                small_rows=1_000,
                large_rows=100_000,
                latency_samples=400,
                renew_leases=200,
                renew_ttl=3.0,
                renew_window=3.0,
            ),
            "smoke": cls(
                name="smoke",
                tasks=10,
                e2e_rounds=2,
                count_tasks=5,
                cycle_seconds=0.1,
                cycle_rounds=1,
                processes=(1, 2),
                keys=(1, 100),
                small_rows=100,
                large_rows=1_000,
                latency_samples=20,
                renew_leases=20,
                renew_ttl=3.0,
                renew_window=1.0,
            ),
        }
        profile = profiles[name]
        if tasks is not None:
            profile = cls(**{**profile.__dict__, "tasks": tasks})
        return profile


@dataclass
class Context:
    """The servers and scratch space of one run."""

    profile: Profile
    pg: dict[str, str]  # host, port, admin user
    database: str  # the benchmark database (alias ``default``)
    redis_url: str
    sqlite_path: Path
    work: Path
    scale_databases: tuple[str, str]
    servers: Path  # the servers' directory (PostgreSQL's data, Redis's pid file)
    #: MariaDB's ``FENCED_MARIADB_*`` when a benchmark compares it (alias ``mariadb``)
    mariadb: dict[str, str] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)  # raw numbers, for the details

    def conninfo(self, dbname: str | None = None, user: str | None = None) -> str:
        return (
            f"host={self.pg['host']} port={self.pg['port']} "
            f"user={user or self.pg['user']} dbname={dbname or self.database}"
        )

    def admin(self, dbname: str | None = None) -> Any:
        """A new autocommit psycopg connection as the admin role."""
        import psycopg

        return psycopg.connect(self.conninfo(dbname), autocommit=True)

    @contextmanager
    def count_statements(self) -> Iterator[Callable[[], list[Counted]]]:
        """Track statements with pg_stat_statements while the block runs.

        Yields a function returning each statement's :class:`Counted` of the benchmark
        database since the block began. Tracking is off outside such blocks, so that the
        throughput benchmarks do not pay for it.
        """
        with self.admin() as conn:
            conn.execute("ALTER SYSTEM SET pg_stat_statements.track = 'top'")
            conn.execute("SELECT pg_reload_conf()")
            time.sleep(0.5)  # every backend applies the reload before its next statement
            conn.execute("SELECT pg_stat_statements_reset()")

            def read() -> list[Counted]:
                rows = conn.execute(
                    """SELECT r.rolname, s.query, s.calls, s.rows, s.total_exec_time
                       FROM pg_stat_statements s JOIN pg_roles r ON r.oid = s.userid
                       WHERE s.dbid = (SELECT oid FROM pg_database WHERE datname = %s)""",
                    [self.database],
                ).fetchall()
                return [
                    Counted(str(a), str(b), int(c), int(d), float(e)) for a, b, c, d, e in rows
                ]

            try:
                yield read
            finally:
                conn.execute("ALTER SYSTEM SET pg_stat_statements.track = 'none'")
                conn.execute("SELECT pg_reload_conf()")


class Counted(NamedTuple):
    """One statement as pg_stat_statements counted it."""

    role: str
    query: str
    calls: int
    rows: int
    #: milliseconds the server spent executing it, all calls together
    exec_ms: float


@dataclass(frozen=True)
class Line:
    """One line of the results table."""

    row: str
    case: str
    measured: str
    baseline: str
    ratio: float | None = None
    ratio_text: str = ""
    target: str = ""
    #: ``"max"`` (ratio must be at most ``limit``), ``"min"`` (at least), None (no target)
    kind: str | None = None
    limit: float | None = None
    spread: str = ""  # min-max of the per-round ratios
    plot: bool = True  # drawn in the chart (a true ratio, not a difference)

    @property
    def met(self) -> str:
        if self.kind is None or self.ratio is None or self.limit is None:
            return ""
        ok = self.ratio <= self.limit if self.kind == "max" else self.ratio >= self.limit
        return "yes" if ok else "**no**"

    @property
    def shown_ratio(self) -> str:
        if self.ratio_text:
            return self.ratio_text
        if self.ratio is None:
            return ""
        text = f"{self.ratio:.2f}x"
        return f"{text} ({self.spread})" if self.spread else text


def _stat(pid: int | str) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # gone, or not Linux
        return None
    return text[text.rindex(")") + 2 :].split()


def _ticks(fields: list[str]) -> int:
    """utime + stime + cutime + cstime: the process's CPU and its reaped children's."""
    return sum(int(x) for x in fields[11:15])


def cpu_seconds(*, group: int | None = None, parent: int | None = None) -> float:
    """CPU seconds of a process group, or of a process with its children, dead ones included.

    ``group``: every process of that group (a worker and its pool); ``parent``: that
    process and its live children (a server and its connections; exited children are
    in the parent's ``cutime``).
    """
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat(entry.name)
        if fields is None:
            continue
        in_group = group is not None and int(fields[2]) == group
        in_tree = parent is not None and parent in (int(entry.name), int(fields[1]))
        if in_group or in_tree:
            total += _ticks(fields)
    return total / os.sysconf("SC_CLK_TCK")


def servers_cpu_parts(ctx: Context) -> dict[str, float]:
    """CPU seconds used so far by this run's PostgreSQL (all connections) and by Redis."""
    postmaster = int((ctx.servers / "pgdata" / "postmaster.pid").read_text().split()[0])
    redis = int((ctx.servers / "redis.pid").read_text().strip())
    return {"PostgreSQL": cpu_seconds(parent=postmaster), "Redis": cpu_seconds(parent=redis)}


@contextmanager
def statements_sent(dialect: type) -> Iterator[list[tuple[str, dict[str, Any]]]]:
    """The statements the store sends through ``dialect``'s ``_fetch`` inside the block,
    each with its parameters, as they are sent."""
    sent: list[tuple[str, dict[str, Any]]] = []
    fetch = dialect._fetch  # type: ignore[attr-defined]

    def recording(self: Any, sql: str, params: Any) -> list[tuple[Any, ...]]:
        sent.append((sql, dict(params)))
        return fetch(self, sql, params)  # type: ignore[no-any-return]

    with mock.patch.object(dialect, "_fetch", recording):
        yield sent


def insert_select(
    alias: str, model: Any, values: dict[str, str], source: str, prefix: str = ""
) -> tuple[str, list[Any]]:
    """``{prefix} INSERT INTO table (…) SELECT … {source}`` for a bulk insert in SQL.

    ``values`` gives the SQL of a column (literal ``%`` doubled); every other column gets
    its model default as a parameter, so the benchmarks keep working when the package adds
    a field. ``prefix`` and ``source`` take no parameters.
    """
    from django.db import connections

    connection = connections[alias]
    columns, selects, params = [], [], []
    for column in model._meta.concrete_fields:
        if column.column in values:
            columns.append(column.column)
            selects.append(values[column.column])
        elif column.primary_key or (column.null and not column.has_default()):
            continue
        elif column.has_default():
            columns.append(column.column)
            selects.append("%s")
            params.append(column.get_db_prep_save(column.get_default(), connection))
        else:
            raise RuntimeError(f"no value for {model.__name__}.{column.name}: add it here")
    quote = connection.ops.quote_name
    sql = (
        f"{prefix} INSERT INTO {quote(model._meta.db_table)} ({', '.join(map(quote, columns))})"
        f" SELECT {', '.join(selects)} {source}"
    )
    return sql, params


def ratio(measured: float, baseline: float) -> float | None:
    """``measured / baseline``, or None when the baseline measured nothing (a smoke batch
    can take 0 CPU ticks): a measurement never fails the run."""
    return measured / baseline if baseline > 0 else None


def ratios(measured: Sequence[float], baseline: Sequence[float]) -> list[float]:
    """The per-round ratios whose baseline measured something (see :func:`ratio`)."""
    return [a / b for a, b in zip(measured, baseline, strict=True) if b > 0]


def median_or_none(values: Sequence[float]) -> float | None:
    return float(statistics.median(values)) if values else None


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else math.nan


def percentile(values: Sequence[float], share: float) -> float:
    """The ``share`` quantile (0..1) by the nearest-rank method."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    rank = max(1, math.ceil(share * len(ordered)))
    return ordered[rank - 1]


def spread(values: Sequence[float]) -> str:
    """``min-max`` of per-round ratios, or '' for a single round."""
    if len(values) < 2:
        return ""
    return f"{min(values):.2f}-{max(values):.2f}"


def rate(value: float) -> str:
    return f"{value:,.0f}/s"


def seconds(value: float) -> str:
    return f"{value:.2f} s"


def millis(value: float) -> str:
    return f"{value * 1000:.2f} ms"


def batches_time(walls: Sequence[float], batch: int) -> str:
    """The time of batches of ``batch`` tasks (``walls``, seconds each) and their rate."""
    total = sum(walls)
    return f"{seconds(total)} ({rate(batch * len(walls) / total) if total > 0 else 'n/a'})"


def cpu_per_task(spent: Sequence[float], batch: int) -> str:
    """CPU per task of batches of ``batch`` tasks (``spent``, CPU seconds each)."""
    return f"{sum(spent) / (batch * len(spent)) * 1000:.1f} ms CPU/task"


def statements_per_task(count: dict[str, Any]) -> str:
    """Statements per task: all, then the data and transaction-control ones."""
    return f"{count['total']:.1f} ({count['data']:.1f} + {count['control']:.1f} tx)"


def rotated(items: Sequence[Any], by: int) -> list[Any]:
    """``items`` rotated left by ``by``: round r of an interleaved run starts elsewhere."""
    if not items:
        return []
    by %= len(items)
    return [*items[by:], *items[:by]]


def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent


#: the MariaDB database of the benchmarks that compare it (alias ``mariadb``)
MARIADB_DATABASE = "celery_fenced_bench"


def worker_env(ctx: Context) -> dict[str, str]:
    """Environment of processes that open the benchmark databases through Django."""
    return {
        "DJANGO_SETTINGS_MODULE": "benchmarks.settings",
        "BENCH_PG_NAME": ctx.database,
        "BENCH_SQLITE_PATH": str(ctx.sqlite_path),
        "BENCH_SCALE_DATABASES": ",".join(ctx.scale_databases),
        "FENCED_PG_HOST": ctx.pg["host"],
        "FENCED_PG_PORT": ctx.pg["port"],
        "FENCED_PG_USER": ctx.pg["user"],
        "FENCED_REDIS_URL": ctx.redis_url,
        "FENCED_BROKER_URL": ctx.redis_url,
        "FENCED_USE_TEST_DATABASES": "0",
        "PYTHONPATH": str(repo_root()) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        **({"BENCH_MARIADB_NAME": MARIADB_DATABASE, **ctx.mariadb} if ctx.mariadb else {}),
    }
