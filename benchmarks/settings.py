"""Django settings of the benchmarks: the test project's, on the benchmark's own servers.

- alias ``default``: PostgreSQL database ``BENCH_PG_NAME`` on ``FENCED_PG_*``; the worker
  processes connect as ``FENCED_PG_USER`` (the runner gives them their own role, so
  PostgreSQL counts their statements apart from the runner's);
- alias ``sqlite``: the SQLite file ``BENCH_SQLITE_PATH``;
- alias ``mariadb``: MariaDB database ``BENCH_MARIADB_NAME`` on ``FENCED_MARIADB_*``, when
  the runner started one (the benchmarks that compare it: permits);
- one alias per name in ``BENCH_SCALE_DATABASES`` (comma-separated PostgreSQL databases);
- alias ``prepared``: database ``default`` again, with psycopg's server-side binding and
  prepared statements (``OPTIONS``: ``server_side_binding``, ``prepare_threshold``);
- the result backend from ``BENCH_RESULT_BACKEND`` (the runner starts one worker per
  backend), the broker from ``FENCED_REDIS_URL``;
- ``BENCH_DB_REUSE=1``: the worker keeps its database connections across tasks (Celery's
  ``CELERY_DB_REUSE_MAX`` with ``CONN_MAX_AGE=None``); by default Celery closes them
  before and after every task, so each task opens a new one.
"""

from __future__ import annotations

import os

# the test project's settings read the broker from the environment at import
os.environ.setdefault("FENCED_BROKER_URL", os.environ.get("FENCED_REDIS_URL", ""))

from testproject.settings import *  # noqa: F403
from testproject.settings import INSTALLED_APPS, _mariadb, _postgres, _sqlite

REUSE = os.environ.get("BENCH_DB_REUSE") == "1"


def _pg(name: str) -> dict[str, object]:
    database = _postgres(name)
    if REUSE:
        database["CONN_MAX_AGE"] = None
    return database


DATABASES = {
    "default": _pg(os.environ.get("BENCH_PG_NAME", "celery_fenced_bench")),
    "sqlite": _sqlite(os.environ.get("BENCH_SQLITE_PATH", "/tmp/celery-fenced-bench.sqlite3")),
}
if os.environ.get("BENCH_MARIADB_NAME"):
    DATABASES["mariadb"] = _mariadb(os.environ["BENCH_MARIADB_NAME"])
for _name in filter(None, os.environ.get("BENCH_SCALE_DATABASES", "").split(",")):
    DATABASES[_name] = _pg(_name)
# the same database through server-side binding with prepared statements (Django's opt-in
# psycopg 3 options; off by default): row 3 measures what they give the store
DATABASES["prepared"] = {
    **DATABASES["default"],
    "OPTIONS": {"server_side_binding": True, "prepare_threshold": 2},
}

# the benchmark tasks are found by the worker's autodiscovery (benchmarks/tasks.py)
INSTALLED_APPS = [*INSTALLED_APPS, "benchmarks"]

CELERY_RESULT_BACKEND = os.environ.get("BENCH_RESULT_BACKEND", "django-db")
if REUSE:
    CELERY_DB_REUSE_MAX = 1_000_000_000

# production-like: with DEBUG on, Django would keep every query in memory (and time it)
DEBUG = False

# the package's events at WARNING: a refused lease_unique copy (row 6) is an INFO record
# each time, thousands of them on the console of a run
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"celery_fenced": {"handlers": ["console"], "level": "WARNING"}},
}
