"""Real `celery worker` processes for the acceptance tests: start, pause, kill, wait."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
ROOT = Path(__file__).resolve().parent.parent
#: the test brokers, by name: the variable that holds each one's URL (devtools.services)
BROKER_URLS = {"redis": "FENCED_REDIS_URL", "rabbitmq": "FENCED_RABBITMQ_URL"}


def broker_url(broker: str | None = None) -> str:
    """The URL of test broker ``broker`` (``"redis"`` or ``"rabbitmq"``); by default the one
    the current test runs on (``FENCED_TEST_BROKER``, set by the ``broker`` fixture), else
    Redis."""
    name = broker or os.environ.get("FENCED_TEST_BROKER") or "redis"
    return os.environ[BROKER_URLS[name]]


def setup_django() -> None:
    """Django for a process the tests start themselves: the test databases."""
    os.environ["FENCED_USE_TEST_DATABASES"] = "1"
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")
    import django

    django.setup()


def wait_for(condition: Callable[[], T], timeout: float, what: str, every: float = 0.1) -> T:
    """Poll ``condition`` until it returns something truthy, or fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(every)


class Worker:
    """One `celery -A testproject worker` in its own process group."""

    def __init__(
        self,
        name: str,
        *,
        database: str,
        queue: str,
        pool: str = "prefork",
        concurrency: int = 1,
        env: dict[str, str] | None = None,
        log_dir: Path,
        extra_args: Sequence[str] = (),
        broker: str | None = None,
        hostname: str | None = None,
    ) -> None:
        self.name = f"{name}-{uuid.uuid4().hex[:6]}"
        self.log_path = log_dir / f"{self.name}.log"
        env = env or {}
        worker_env = {
            **os.environ,
            "FENCED_USE_TEST_DATABASES": "1",
            "FENCED_DB": database if database in ("postgres", "mariadb") else "sqlite",
            # the test's broker, unless the environment given names one
            "FENCED_BROKER_URL": env.get("FENCED_BROKER_URL") or broker_url(broker),
            "FENCED_WORKER_NAME": name,
            # libpq's application_name: PostgreSQL's sessions name their worker
            "PGAPPNAME": self.name,
            "DJANGO_SETTINGS_MODULE": "testproject.settings",
            "PYTHONPATH": str(ROOT),
            **env,
        }
        cmd = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "testproject",
            "worker",
            "--loglevel",
            "INFO",
            "--pool",
            pool,
            "--concurrency",
            str(concurrency),
            "--hostname",
            hostname or f"{self.name}@%h",  # the node name: by default one of its own
            "--queues",
            queue,
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            *extra_args,  # more `celery worker` arguments, e.g. ("--include", "module")
        ]
        self.log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=worker_env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 60) -> None:
        def ready() -> bool:
            if self.process.poll() is not None:
                raise AssertionError(f"worker {self.name} exited:\n{self.output()[-3000:]}")
            return " ready." in self.output()

        wait_for(ready, timeout, f"worker {self.name} to be ready")

    def signal_group(self, sig: int) -> None:
        os.killpg(self.process.pid, sig)

    def pause(self) -> None:
        self.signal_group(signal.SIGSTOP)

    def resume(self) -> None:
        self.signal_group(signal.SIGCONT)

    def kill(self) -> None:
        self.signal_group(signal.SIGKILL)
        self.process.wait(timeout=30)

    def warm_shutdown(self, timeout: float = 60) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout)

    def stop(self) -> None:
        if self.process.poll() is None:
            try:
                self.signal_group(signal.SIGCONT)
                self.signal_group(signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait(timeout=30)
        self.log.close()


def configure(app: Any, **settings: Any) -> None:
    """Set Celery settings on an app configured from Django's settings (namespace CELERY).

    Celery before 5.7 looks up the namespaced name (``CELERY_BROKER_URL``, from Django's
    settings) before the plain one, so ``app.conf.broker_url = url`` is silently ignored
    there: set both names.
    """
    prefix = f"{app.namespace}_" if getattr(app, "namespace", None) else ""
    for name, value in settings.items():
        app.conf.update({name: value, **({prefix + name.upper(): value} if prefix else {})})


def send(name: str, *, queue: str, args: Any = (), kwargs: Any = None, **options: Any) -> str:
    """Send task ``name`` to the current test's broker (:func:`broker_url`); return its id."""
    result = sender().send_task(name, args=args, kwargs=kwargs or {}, queue=queue, **options)
    return str(result.id)


def sender() -> Any:
    """The Celery app that sends to the current test's broker, and broadcasts there
    (``sender().control.revoke(...)``). One per broker URL, kept for the session: an app's
    connection pool keeps the broker it was first made for, whatever ``broker_url`` says
    afterwards."""
    url = broker_url()
    if url not in _senders:
        _senders[url] = broker_app(url)
    return _senders[url]


#: one sending app per broker URL, kept for the test session (as a project keeps its app)
_senders: dict[str, Any] = {}


def queued(broker: str, queue: str) -> int:
    """How many messages wait in ``queue`` of test broker ``broker`` (none taken yet)."""
    url = broker_url(broker)
    if broker == "redis":
        import redis

        return int(redis.Redis.from_url(url).llen(queue))
    from kombu import Connection

    with Connection(url) as connection:
        try:
            _, count, _ = connection.default_channel.queue_declare(queue, passive=True)
        except connection.channel_errors:  # no such queue (yet)
            return 0
        return int(count)


def lose_queued(broker: str, queues: Sequence[str]) -> None:
    """Lose the messages ``broker`` holds: Redis restarted empty (every queue, and the
    unacknowledged messages too), RabbitMQ's ``queues`` purged (what waits in them)."""
    url = broker_url(broker)
    if broker == "redis":
        import redis

        redis.Redis.from_url(url).flushall()
        return
    from kombu import Connection

    with Connection(url) as connection:
        for queue in queues:
            connection.default_channel.queue_purge(queue)


def filesystem_env(folder: Path) -> dict[str, str]:
    """Worker environment for kombu's filesystem broker in ``folder`` (no server needed)."""
    return {"FENCED_BROKER_URL": "filesystem://", "FENCED_BROKER_DIR": str(folder)}


def broker_app(broker_url: str, folder: Path | None = None) -> Any:
    """A Celery app of the test project on ``broker_url``, for sending and reclaiming.

    With ``folder`` it uses the filesystem broker in that folder, as the workers started
    with :func:`filesystem_env` do. Not the current app; close it with ``app.close()``.
    """
    from celery import Celery

    app = Celery("tests", set_as_current=False)
    app.config_from_object("django.conf:settings", namespace="CELERY")
    configure(app, broker_url=broker_url)
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
        configure(
            app,
            broker_transport_options={
                "data_folder_in": str(folder),
                "data_folder_out": str(folder),
                "processed_folder": f"{folder}-processed",
                "control_folder": f"{folder}-control",
                "store_processed": False,
            },
        )
    return app


def reclaim_race(
    alias: str,
    broker_url: str,
    keys: list[str],
    rounds: int,
    index: int,
    barrier: Any,
    results: Any,
) -> None:
    """Race the other processes to reclaim ``keys``, ``rounds`` times.

    Each round every process sweeps three times; then process 0 plays the re-sent
    executions: each job is granted again under its task id and left to expire.
    """
    setup_django()
    import datetime as dt

    from django.db import connections
    from django.db.models import F

    from celery_fenced.models import Lease
    from celery_fenced.reclaim import reclaim_expired
    from celery_fenced.store import grant

    app = broker_app(broker_url)
    outcomes = []
    for round_no in range(rounds):
        barrier.wait()
        for _ in range(3):
            for done in reclaim_expired(app, grace=0, using=alias):
                outcomes.append((round_no, done.key, done.task_id, done.action, done.attempt))
        barrier.wait()  # every sweep of this round is over
        if index == 0 and round_no < rounds - 1:
            leases = Lease.objects.using(alias).filter(key__in=keys)
            for row in leases:
                grant(
                    row.key,
                    ttl=60,
                    task_id=row.task_id,
                    task_name=row.task_name,
                    job=row.job,
                    using=alias,
                )
            leases.update(  # expires_at first: MySQL's UPDATE reads what it already set
                expires_at=F("acquired_at") - dt.timedelta(seconds=1),
                acquired_at=F("acquired_at") - dt.timedelta(seconds=2),
            )
    app.close()
    connections.close_all()
    results.put(outcomes)
