"""Row 3: lock cycles per second — acquire then release — through our API and its rivals.

Variants, each one acquire and one release per cycle on a random key of ``keys``:

- ``api``: ``celery_fenced.acquire(key, ttl=30)`` and ``.release()`` (PostgreSQL is the
  default database; SQLite is passed as ``using=``);
- ``api-all``: ``api`` with ``fenced_events="all"``: an ``acquired`` and a ``released``
  event per cycle, what the full audit trail costs;
- ``api-using``: the same on PostgreSQL with ``using="default"``, which skips the settings
  lookup ``acquire`` does to find the lease database;
- ``api-prepared``: the same with ``using="prepared"``, the same database through Django's
  opt-in server-side binding with prepared statements (``OPTIONS``:
  ``{"server_side_binding": True, "prepare_threshold": 2}``);
- ``raw``: the very statements the store sends, captured from it at the start of the run,
  sent with psycopg (``ClientCursor``, as Django's) or the ``sqlite3`` module — the floor
  the API can reach;
- ``raw-prepared``: the same statements on a psycopg connection with server-side binding
  that prepares each one at its first run (``prepare_threshold=0``): what the API's kept
  connection sends, with nothing of the API around it;
- ``lean``: what a leaner store could send — the same grant upsert without its event, a
  plain conditional ``UPDATE`` to release, no event either, as prepared statements
  (psycopg's server-side binding): the headroom of the design, not a rival;
- ``redis``: ``SET key token NX PX 30000`` and a compare-and-delete Lua script;
- ``advisory``: ``pg_try_advisory_lock(n)`` and ``pg_advisory_unlock(n)``.

A busy key (another process holds it) counts as a busy attempt, not a cycle; each variant
handles it its own way (the store records a ``busy`` event, as the API does).
The processes are started once and kept: every measurement sends them a command; the
measurements alternate between the variants, the order rotating each round.
"""

from __future__ import annotations

import enum
import json
import multiprocessing
import os
import random
import re
import sqlite3
import time
from collections.abc import Callable
from typing import Any

from benchmarks.common import (
    Context,
    Line,
    insert_select,
    median,
    median_or_none,
    rate,
    ratios,
    rotated,
    spread,
    statements_sent,
)

PG_VARIANTS = (
    "api",
    "api-all",
    "api-using",
    "api-prepared",
    "raw",
    "raw-prepared",
    "lean",
    "redis",
    "advisory",
)
SQLITE_VARIANTS = ("api", "raw")
TTL = 30.0
PROBE_KEY, PROBE_OWNER, PROBE_OTHER = "probe:key", "probe-owner", "probe-other"

#: a parameter of a captured statement: ("key"|"owner"|"token"|"lease_id", None),
#: ("holder", the JSON text naming the probe's holder) or ("const", the value)
Param = tuple[str, Any]
#: per operation (grant, busy, release): its statements, SQL and parameter templates
Statements = dict[str, list[tuple[str, dict[str, Param]]]]


# -- the store's own statements, captured -------------------------------------------------
def capture(alias: str) -> Statements:
    """The statements the store sends to grant, refuse and release, as templates.

    They are recorded while the API takes a probe key, is refused it, and releases it;
    each parameter that was the probe's key, owner, token or lease id becomes a slot the
    raw variant fills with its own, so the templates follow the store when it changes.
    """
    from celery_fenced import LeaseBusy, acquire
    from celery_fenced.models import Lease
    from celery_fenced.store import dialects

    dialect = type(dialects.for_alias(alias))  # the class whose _fetch sends each statement
    for _ in range(5):  # until the probe's token and lease id differ from each other
        recorded: dict[str, list[tuple[str, dict[str, Any]]]] = {}
        with statements_sent(dialect) as log:
            lease = acquire(PROBE_KEY, ttl=TTL, owner=PROBE_OWNER, using=alias)
            recorded["grant"], log[:] = list(log), []
            try:
                acquire(PROBE_KEY, ttl=TTL, owner=PROBE_OTHER, using=alias)
                raise RuntimeError("the probe key was granted twice")
            except LeaseBusy:
                pass
            recorded["busy"], log[:] = list(log), []
            lease.release()
            recorded["release"] = list(log)
        lease_id = Lease._default_manager.using(alias).get(key=PROBE_KEY).pk
        if lease.token != lease_id and lease.token != int(TTL):
            break
    else:
        raise RuntimeError("could not give the probe a token distinct from its lease id")
    requester = {"grant": PROBE_OWNER, "busy": PROBE_OTHER, "release": PROBE_OWNER}
    # plain values (an event kind is the model's enum): the templates go to spawned
    # processes, which unpickle them before Django is set up
    captured: Statements = {
        op: [
            (
                sql,
                {
                    k: _slot(
                        x.value if isinstance(x, enum.Enum) else x,
                        requester[op],
                        lease.token,
                        lease_id,
                    )
                    for k, x in params.items()
                },
            )
            for sql, params in statements
        ]
        for op, statements in recorded.items()
    }
    for op, slots in (("grant", {"key", "owner"}), ("release", {"key", "token", "owner"})):
        found = {kind for _, params in captured[op] for kind, _ in params.values()}
        if not slots <= found:
            raise RuntimeError(f"the store's {op} statements no longer take {slots - found}")
    return captured


def _slot(value: Any, requester: str, token: int, lease_id: int) -> Param:
    if value == PROBE_KEY:
        return ("key", None)
    if value == requester:
        return ("owner", None)
    if isinstance(value, str) and PROBE_OWNER in value:
        return ("holder", value)
    if type(value) is int and value == token:
        return ("token", None)
    if type(value) is int and value == lease_id:
        return ("lease_id", None)
    return ("const", value)


def fill(params: dict[str, Param], values: dict[str, Any]) -> dict[str, Any]:
    """The parameters of a captured statement for this cycle's ``values``."""
    out = {}
    for name, (kind, value) in params.items():
        if kind == "const":
            out[name] = value
        elif kind == "holder":
            out[name] = value.replace(PROBE_OWNER, json.dumps(values["holder"])[1:-1])
        else:
            out[name] = values[kind]
    return out


# -- the cycles, in the measuring processes ---------------------------------------------------
class Cycles:
    """One measuring process's connections and its cycle function per variant."""

    def __init__(self, ctx_env: dict[str, str], statements: dict[str, Statements]) -> None:
        os.environ.update(ctx_env)
        import django

        django.setup()
        import psycopg
        import redis

        from benchmarks.tasks import UNLOCK_SCRIPT

        self.owner = f"raw:{os.getpid()}"
        self.pg_conn = psycopg.connect(
            ctx_env["BENCH_CONNINFO"], autocommit=True, cursor_factory=psycopg.ClientCursor
        )
        self.sqlite = sqlite3.connect(
            ctx_env["BENCH_SQLITE_PATH"], isolation_level=None, timeout=30
        )
        self.sqlite.execute("PRAGMA foreign_keys = ON")  # as Django's connections do
        self.redis = redis.Redis.from_url(ctx_env["FENCED_REDIS_URL"])
        self.unlock = self.redis.register_script(UNLOCK_SCRIPT)
        self.pg, self.lite = statements["postgresql"], statements["sqlite"]
        self.prepared = psycopg.connect(
            ctx_env["BENCH_CONNINFO"], autocommit=True, prepare_threshold=0
        )
        self.lean = psycopg.connect(
            ctx_env["BENCH_CONNINFO"], autocommit=True, prepare_threshold=0
        )
        self.lean_grant, self.lean_release = (
            statements["lean"]["grant"][0],
            statements["lean"]["release"][0],
        )

    def function(self, database: str, variant: str) -> Callable[[int], bool]:
        functions: dict[tuple[str, str], Callable[[int], bool]] = {
            ("postgresql", "api"): self.api_pg,
            ("postgresql", "api-all"): self.api_pg,
            ("postgresql", "api-using"): self.api_pg_using,
            ("postgresql", "api-prepared"): self.api_pg_prepared,
            ("postgresql", "raw"): self.raw_pg,
            ("postgresql", "raw-prepared"): self.raw_pg_prepared,
            ("postgresql", "lean"): self.lean_pg,
            ("postgresql", "redis"): self.redis_lock,
            ("postgresql", "advisory"): self.advisory,
            ("sqlite", "api"): self.api_sqlite,
            ("sqlite", "raw"): self.raw_sqlite,
        }
        from celery import current_app

        # the audit trail's mode, read by acquire() from the settings (a change is seen)
        current_app.conf.fenced_events = "all" if variant == "api-all" else "anomalies"
        return functions[(database, variant)]

    def api_pg(self, n: int) -> bool:
        from celery_fenced import LeaseBusy, acquire

        try:
            lease = acquire(f"cycle:{n}", ttl=TTL)
        except LeaseBusy:
            return False
        lease.release()
        return True

    def api_pg_using(self, n: int) -> bool:
        from celery_fenced import LeaseBusy, acquire

        try:
            lease = acquire(f"cycle:{n}", ttl=TTL, using="default")
        except LeaseBusy:
            return False
        lease.release()
        return True

    def api_pg_prepared(self, n: int) -> bool:
        from celery_fenced import LeaseBusy, acquire

        try:
            lease = acquire(f"cycle:{n}", ttl=TTL, using="prepared")
        except LeaseBusy:
            return False
        lease.release()
        return True

    def api_sqlite(self, n: int) -> bool:
        from celery_fenced import LeaseBusy, acquire

        try:
            lease = acquire(f"cycle:{n}", ttl=TTL, using="sqlite")
        except LeaseBusy:
            return False
        lease.release()
        return True

    def raw_pg(self, n: int) -> bool:
        return self._raw_pg(self.pg_conn, n)

    def raw_pg_prepared(self, n: int) -> bool:
        return self._raw_pg(self.prepared, n)

    def _raw_pg(self, conn: Any, n: int) -> bool:
        values: dict[str, Any] = {"key": f"cycle:{n}", "owner": self.owner}
        cur = conn.cursor()
        # what the store sends for a busy key: its grant statements in turn (each may
        # grant: the key can be freed meanwhile), then the holder's busy record
        *grants, holder = self.pg["busy"]
        for sql, params in grants:
            rows = cur.execute(sql, fill(params, values)).fetchall()
            if rows:
                break
        else:
            sql, params = holder
            cur.execute(sql, fill(params, values)).fetchall()
            return False
        values["token"] = rows[0][1]
        for sql, params in self.pg["release"]:
            cur.execute(sql, fill(params, values)).fetchall()
        return True

    def raw_sqlite(self, n: int) -> bool:
        values: dict[str, Any] = {"key": f"cycle:{n}", "owner": self.owner}
        db = self.sqlite

        def run(statements: list[tuple[str, dict[str, Param]]]) -> None:
            for sql, params in statements:
                db.execute(_qmark(sql), fill(params, values)).fetchall()

        db.execute("BEGIN")
        try:
            grant = self.lite["grant"]
            upsert_at = next(i for i, (sql, _) in enumerate(grant) if "ON CONFLICT" in sql)
            run(grant[:upsert_at])  # what the store sends before its upsert (the write lock)
            (upsert, params), *events = grant[upsert_at:]
            rows = db.execute(_qmark(upsert), fill(params, values)).fetchall()
            if rows:
                values["lease_id"], values["token"] = rows[0][0], rows[0][1]
                run(events)
            else:
                (select, params), *events = self.lite["busy"][upsert_at + 1 :]
                held = db.execute(_qmark(select), fill(params, values)).fetchall()
                if held:
                    values["lease_id"], values["token"], values["holder"] = held[0][:3]
                    run(events)
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        if not rows:
            return False
        db.execute("BEGIN")
        (update, params), *events = self.lite["release"]
        released = db.execute(_qmark(update), fill(params, values)).fetchall()
        if released:
            values["lease_id"] = released[0][0]
            run(events)
        db.execute("COMMIT")
        return True

    def redis_lock(self, n: int) -> bool:
        key, token = f"cycle:{n}", os.urandom(8).hex()
        if not self.redis.set(key, token, nx=True, px=int(TTL * 1000)):
            return False
        self.unlock(keys=[key], args=[token])
        return True

    def lean_pg(self, n: int) -> bool:
        values: dict[str, Any] = {"key": f"cycle:{n}", "owner": self.owner}
        cur = self.lean.cursor()
        rows = cur.execute(self.lean_grant[0], fill(self.lean_grant[1], values)).fetchall()
        if not rows:
            return False
        values["token"] = rows[0][1]
        cur.execute(self.lean_release[0], fill(self.lean_release[1], values)).fetchall()
        return True

    def advisory(self, n: int) -> bool:
        cur = self.pg_conn.cursor()
        if not cur.execute("SELECT pg_try_advisory_lock(%s)", [n]).fetchone()[0]:  # type: ignore[index]
            return False
        cur.execute("SELECT pg_advisory_unlock(%s)", [n]).fetchone()
        return True


def _qmark(sql: str) -> str:
    """Django's SQLite placeholder translation: ``%(x)s`` → ``:x``, ``%%`` → ``%``."""
    return re.sub(r"(?<!%)%\((\w+)\)s", r":\1", sql).replace("%%", "%")


def serve(
    ctx_env: dict[str, str], statements: dict[str, Statements], commands: Any, results: Any
) -> None:
    """A measuring process: run each command's cycles until its deadline, report counts."""
    cycles = Cycles(ctx_env, statements)
    rng = random.Random(os.getpid())
    results.put("ready")
    while True:
        command = commands.get()
        if command is None:
            return
        database, variant, keys, start_at, end_at = command
        function = cycles.function(database, variant)
        while time.monotonic() < start_at:
            time.sleep(0.001)
        began = time.monotonic()
        done = busy = 0
        while time.monotonic() < end_at:
            if function(rng.randrange(keys)):
                done += 1
            else:
                busy += 1
        window = max(time.monotonic() - began, 1e-6)
        results.put((done / window, busy / window))


# -- the run -------------------------------------------------------------------------------
def _prefill(keys: int) -> None:
    """Released lease rows for every key, on both databases: all variants update rows."""
    from django.db import connections

    from celery_fenced.models import Lease

    row = {"token": "1", "owner": "'prefill'", "task_id": "''", "task_name": "''"}
    now = "now()"
    sql, params = insert_select(
        "default",
        Lease,
        {"key": "'cycle:' || g", **row, **dict.fromkeys(TIMES, now)},
        f"FROM generate_series(0, {int(keys) - 1}) g ON CONFLICT (key) DO NOTHING",
    )
    with connections["default"].cursor() as cursor:
        cursor.execute(sql, params)
    now = "strftime('%%Y-%%m-%%d %%H:%%M:%%f', 'now')"
    sql, params = insert_select(
        "sqlite",
        Lease,
        {"key": "'cycle:' || n", **row, **dict.fromkeys(TIMES, now)},
        "FROM g WHERE true ON CONFLICT (key) DO NOTHING",
        prefix=(
            "WITH RECURSIVE g(n) AS "
            f"(SELECT 0 UNION ALL SELECT n + 1 FROM g WHERE n + 1 < {int(keys)})"
        ),
    )
    with connections["sqlite"].cursor() as cursor:
        cursor.execute(sql, params)


TIMES = ("acquired_at", "renewed_at", "expires_at", "released_at")


def _capture_all() -> dict[str, Statements]:
    """The store's statements on both databases, and the lean ones beside PostgreSQL's."""
    from django.db import connections

    from celery_fenced.store.dialects.statements import postgresql

    statements = {connections[a].vendor: capture(a) for a in ("default", "sqlite")}
    # lean: the grant's upsert alone (the grant statement's parameters)
    upsert = postgresql.GRANT_ROUTINE[False, "", False]
    grant_params = statements["postgresql"]["grant"][0][1]
    release = """UPDATE celery_fenced_lease SET released_at = statement_timestamp()
                 WHERE key = %(key)s AND token = %(token)s AND owner = %(owner)s
                   AND released_at IS NULL
                 RETURNING token"""
    statements["lean"] = {
        "grant": [(upsert, grant_params)],
        "release": [
            (release, {"key": ("key", None), "token": ("token", None), "owner": ("owner", None)})
        ],
    }
    return statements


def run(ctx: Context) -> list[Line]:
    from django.db import connections

    from benchmarks.common import worker_env

    profile = ctx.profile
    _prefill(max(profile.keys))
    statements = _capture_all()
    connections.close_all()
    env = {**worker_env(ctx), "BENCH_CONNINFO": ctx.conninfo()}
    mp = multiprocessing.get_context("spawn")
    results = mp.Queue()
    processes = []
    for _ in range(max(profile.processes)):
        commands = mp.Queue()
        proc = mp.Process(target=serve, args=(env, statements, commands, results), daemon=True)
        proc.start()
        processes.append((proc, commands))
    try:
        for _ in processes:
            if results.get(timeout=180) != "ready":
                raise RuntimeError("a measuring process failed to start")
        configs = [
            (database, procs, keys)
            for database in ("postgresql", "sqlite")
            for procs in profile.processes
            for keys in profile.keys
        ]
        measured: dict[tuple[str, int, int, str], list[float]] = {}
        busy: dict[tuple[str, int, int, str], list[float]] = {}
        for round_no in range(profile.cycle_rounds):
            for database, procs, keys in configs:
                variants = PG_VARIANTS if database == "postgresql" else SQLITE_VARIANTS
                for variant in rotated(variants, round_no):
                    start_at = time.monotonic() + 0.2
                    end_at = start_at + profile.cycle_seconds
                    for _, commands in processes[:procs]:
                        commands.put((database, variant, keys, start_at, end_at))
                    got = [results.get(timeout=120) for _ in range(procs)]
                    total = sum(cycles for cycles, _ in got)
                    measured.setdefault((database, procs, keys, variant), []).append(total)
                    busy.setdefault((database, procs, keys, variant), []).append(
                        sum(refused for _, refused in got)
                    )
    finally:
        for _, commands in processes:
            commands.put(None)
        for proc, _ in processes:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    stuck = sorted("/".join(map(str, k)) for k, v in measured.items() if not all(v))
    if stuck:  # a key left held (a variant that grants and does not release) stalls the rest
        raise RuntimeError(f"a round of these completed no lock cycle: {', '.join(stuck)}")
    ctx.data["cycles"] = {"/".join(map(str, k)): v for k, v in measured.items()}
    ctx.data["busy_attempts"] = {"/".join(map(str, k)): v for k, v in busy.items()}
    return _lines(profile, measured)


def _lines(profile: Any, measured: dict[tuple[str, int, int, str], list[float]]) -> list[Line]:
    lines = []

    def ratio(config: tuple[str, int, int], a: str, b: str) -> list[float]:
        return ratios(measured[(*config, a)], measured[(*config, b)])

    def value(config: tuple[str, int, int], variant: str) -> str:
        return rate(median(measured[(*config, variant)]))

    for database in ("postgresql", "sqlite"):
        for procs in profile.processes:
            for keys in profile.keys:
                config = (database, procs, keys)
                name = "PostgreSQL" if database == "postgresql" else "SQLite"
                where = f"{name}, {_plural(procs, 'proc')}, {_plural(keys, 'key')}"

                def compare(a: str, b: str, text: str, **target: Any) -> None:
                    r = ratio(config, a, b)  # noqa: B023 - called at once, in this loop
                    lines.append(
                        Line(
                            row="3 lock cycles",
                            case=f"{where}: {text}",  # noqa: B023
                            measured=value(config, a),  # noqa: B023
                            baseline=value(config, b),  # noqa: B023
                            ratio=median_or_none(r),
                            spread=spread(r),
                            **target,
                        )
                    )

                at_least_080 = {"target": "≥ 0.80x", "kind": "min", "limit": 0.80}
                compare("api", "raw", "API vs raw statements", **at_least_080)
                if database != "postgresql":
                    continue
                compare("api-using", "raw", "API with using= vs raw statements")
                at_least_090 = {"target": "≥ 0.90x", "kind": "min", "limit": 0.90}
                compare("api", "raw-prepared", "API vs raw statements prepared", **at_least_090)
                at_least_050 = {"target": "≥ 0.50x", "kind": "min", "limit": 0.50}
                # one process: the API's own cost; eight: the key's contention besides
                compare(
                    "api", "redis", "API vs Redis lock", **(at_least_050 if procs == 1 else {})
                )
                compare("api-all", "redis", "API, fenced_events='all' vs Redis lock")
                compare(
                    "api-prepared",
                    "redis",
                    "API, prepared statements (Django OPTIONS) vs Redis lock",
                )
                compare("lean", "redis", "lean statements (no events, prepared) vs Redis lock")
                compare("advisory", "redis", "advisory lock vs Redis lock")
    return lines


def _plural(count: int, noun: str) -> str:
    return f"{count:,} {noun}{'s' if count != 1 else ''}"
