"""Settings of the test/demo project.

Databases come from the environment:

- ``FENCED_DB=sqlite`` (default): SQLite file ``FENCED_SQLITE_PATH`` (default ``db.sqlite3``
  beside this file).
- ``FENCED_DB=postgres``: PostgreSQL from ``FENCED_PG_*`` (host, port, user, name).
- ``FENCED_DB=mariadb``: MariaDB (or MySQL) from ``FENCED_MARIADB_*``.

The tests use them at once: alias ``default`` is SQLite, alias ``postgres`` is
PostgreSQL when ``FENCED_PG_PORT`` is set, and alias ``mariadb`` is MariaDB (the MySQL
family) from ``FENCED_MARIADB_*`` when ``FENCED_MARIADB_PORT`` is set.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "celery-fenced-testproject-not-secret")
DEBUG = os.environ.get("DJANGO_DEBUG", "1") == "1"
ALLOWED_HOSTS = ["localhost", "127.0.0.1", "[::1]", "testserver"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_celery_results",
    "celery_fenced",
    "testproject.demo",
]
# django-celery-beat is optional (the fenced beat's database scheduler): the tests install
# it, the demo's `pip install -e '.[metrics]'` does not
if importlib.util.find_spec("django_celery_beat") is not None:
    INSTALLED_APPS.insert(INSTALLED_APPS.index("celery_fenced"), "django_celery_beat")

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]

ROOT_URLCONF = "testproject.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]


def _sqlite(path: str) -> dict[str, object]:
    return {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": path,
        "OPTIONS": {"timeout": 30},
        "TEST": {"NAME": path.replace(".sqlite3", "") + "-test.sqlite3"},
    }


def _postgres(name: str) -> dict[str, object]:
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": name,
        "USER": os.environ.get("FENCED_PG_USER", "postgres"),
        "PASSWORD": os.environ.get("FENCED_PG_PASSWORD", ""),
        "HOST": os.environ.get("FENCED_PG_HOST", "127.0.0.1"),
        "PORT": os.environ.get("FENCED_PG_PORT", "5432"),
        "TEST": {"NAME": os.environ.get("FENCED_PG_TEST_NAME", "test_celery_fenced")},
    }


def _mariadb(name: str) -> dict[str, object]:
    """MariaDB (or MySQL) with the server's own default collation: the package compares
    lease keys byte for byte whatever it is."""
    return {
        "ENGINE": "django.db.backends.mysql",
        "NAME": name,
        "USER": os.environ.get("FENCED_MARIADB_USER", "root"),
        "PASSWORD": os.environ.get("FENCED_MARIADB_PASSWORD", ""),
        "HOST": os.environ.get("FENCED_MARIADB_HOST", "127.0.0.1"),
        "PORT": os.environ.get("FENCED_MARIADB_PORT", "3306"),
        # Django stores UTC; the lease SQL's clock is the session's (check E006)
        "OPTIONS": {
            "charset": "utf8mb4",
            "init_command": "SET time_zone = '+00:00'",
            # Django's default, READ COMMITTED, unless the run asks for another level
            **(
                {"isolation_level": os.environ["FENCED_MARIADB_ISOLATION"]}
                if os.environ.get("FENCED_MARIADB_ISOLATION")
                else {}
            ),
        },
        "TEST": {
            "NAME": os.environ.get("FENCED_MARIADB_TEST_NAME", "test_celery_fenced"),
            "CHARSET": "utf8mb4",
        },
    }


SQLITE_PATH = os.environ.get("FENCED_SQLITE_PATH", str(BASE_DIR / "db.sqlite3"))
if os.environ.get("FENCED_DB", "sqlite") == "postgres":
    DATABASES = {"default": _postgres(os.environ.get("FENCED_PG_NAME", "celery_fenced"))}
elif os.environ.get("FENCED_DB") == "mariadb":
    DATABASES = {"default": _mariadb(os.environ.get("FENCED_MARIADB_NAME", "celery_fenced"))}
else:
    DATABASES = {"default": _sqlite(SQLITE_PATH)}
    if os.environ.get("FENCED_PG_PORT"):
        DATABASES["postgres"] = _postgres(os.environ.get("FENCED_PG_NAME", "celery_fenced"))
    if os.environ.get("FENCED_MARIADB_PORT"):
        DATABASES["mariadb"] = _mariadb(os.environ.get("FENCED_MARIADB_NAME", "celery_fenced"))

# A read replica of each database, for the tests of primary/replica routing: the same
# database through a connection of its own (a test mirror).
for _alias, _primary in list(DATABASES.items()):
    DATABASES[f"{_alias}_replica"] = {
        **_primary,
        "TEST": {**_primary["TEST"], "MIRROR": _alias},  # type: ignore[dict-item]
    }

if os.environ.get("FENCED_USE_TEST_DATABASES") == "1":
    # Processes started by the tests (workers, racers) open the test databases.
    for _db in DATABASES.values():
        _db["NAME"] = _db["TEST"]["NAME"]  # type: ignore[index]

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
TIME_ZONE = "UTC"
STATIC_URL = "static/"
LANGUAGE_CODE = "en-us"

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"celery_fenced": {"handlers": ["console"], "level": "INFO"}},
}

# Celery (namespace "CELERY"): a broker that needs no server by default.
CELERY_BROKER_URL = os.environ.get("FENCED_BROKER_URL", "filesystem://")
_BROKER_DIR = os.environ.get("FENCED_BROKER_DIR", str(BASE_DIR / ".broker"))
if CELERY_BROKER_URL.startswith("filesystem"):
    # kombu's filesystem transport does not create its folders
    os.makedirs(_BROKER_DIR, exist_ok=True)
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": _BROKER_DIR,
        "data_folder_out": _BROKER_DIR,
        "processed_folder": _BROKER_DIR + "-processed",
        "control_folder": _BROKER_DIR + "-control",
        "store_processed": False,
    }
elif CELERY_BROKER_URL.startswith(("amqp", "pyamqp")):
    # RabbitMQ redelivers an unacknowledged message when the channel that holds it closes:
    # the worker's connection lost (killed, its heartbeats missed) or the broker's
    # consumer_timeout expired (a node setting: devtools.services, the tests shorten it)
    CELERY_BROKER_TRANSPORT_OPTIONS = {}
else:
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        # Redis redelivers an unacked message after the visibility timeout; the tests
        # shorten it (and restore promptly) to show a real redelivery.
        "visibility_timeout": float(os.environ.get("FENCED_VISIBILITY_TIMEOUT", "3600")),
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 0,
    }
CELERY_RESULT_BACKEND = "celery_fenced.backends:FencedDatabaseBackend"
CELERY_RESULT_EXTENDED = True
CELERY_TASK_SERIALIZER = "json"
# the tests store results with pickle too (FENCED_RESULT_SERIALIZER=pickle)
CELERY_RESULT_SERIALIZER = os.environ.get("FENCED_RESULT_SERIALIZER", "json")
CELERY_RESULT_ACCEPT_CONTENT = sorted({"json", CELERY_RESULT_SERIALIZER})
# a worker that takes pickled jobs too (FENCED_ACCEPT_PICKLE=1), for the serializer tests
CELERY_ACCEPT_CONTENT = ["json", *(["pickle"] if os.environ.get("FENCED_ACCEPT_PICKLE") else [])]
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_FENCED_TASKS: dict[str, dict[str, object]] = json.loads(
    os.environ.get("FENCED_TASKS_JSON", "{}")
)
if os.environ.get("FENCED_EVENTS"):  # "anomalies" (the default) or "all"
    CELERY_FENCED_EVENTS = os.environ["FENCED_EVENTS"]
if os.environ.get("FENCED_OUTBOX"):  # "0": publish without the outbox (the chaos runner)
    CELERY_FENCED_OUTBOX = os.environ["FENCED_OUTBOX"] == "1"
if os.environ.get("FENCED_OUTBOX_RESEND_AFTER"):  # seconds (the chaos runner: short)
    CELERY_FENCED_OUTBOX_RESEND_AFTER = float(os.environ["FENCED_OUTBOX_RESEND_AFTER"])
if os.environ.get("FENCED_METRICS_PORT"):  # a worker's Prometheus exporter (the tests)
    CELERY_FENCED_METRICS_PORT = int(os.environ["FENCED_METRICS_PORT"])
if os.environ.get("FENCED_DEFAULT_TTL"):
    CELERY_FENCED_DEFAULT_TTL = float(os.environ["FENCED_DEFAULT_TTL"])

# the fenced beat's acceptance tests: a schedule (JSON, seconds for intervals, an object
# {"crontab": {...}} for a crontab) and a ttl
if os.environ.get("FENCED_BEAT_SCHEDULE"):
    from celery.schedules import crontab

    CELERY_BEAT_SCHEDULE = {
        name: {**entry, "schedule": crontab(**entry["schedule"]["crontab"])}
        if isinstance(entry["schedule"], dict)
        else entry
        for name, entry in json.loads(os.environ["FENCED_BEAT_SCHEDULE"]).items()
    }
if os.environ.get("FENCED_BEAT_TTL"):
    CELERY_FENCED_BEAT_TTL = float(os.environ["FENCED_BEAT_TTL"])
