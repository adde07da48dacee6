"""Real `celery worker` processes for the acceptance tests: start, pause, kill, wait."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
ROOT = Path(__file__).resolve().parent.parent


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
    ) -> None:
        self.name = f"{name}-{uuid.uuid4().hex[:6]}"
        self.log_path = log_dir / f"{self.name}.log"
        worker_env = {
            **os.environ,
            "FENCED_USE_TEST_DATABASES": "1",
            "FENCED_DB": "postgres" if database == "postgres" else "sqlite",
            "FENCED_BROKER_URL": os.environ["FENCED_REDIS_URL"],
            "FENCED_WORKER_NAME": name,
            "DJANGO_SETTINGS_MODULE": "testproject.settings",
            "PYTHONPATH": str(ROOT),
            **(env or {}),
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
            f"{self.name}@%h",
            "--queues",
            queue,
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
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


def send(name: str, *, queue: str, args: Any = (), kwargs: Any = None, **options: Any) -> str:
    """Send task ``name`` to Redis; return its task id."""
    from testproject.celery import app

    app.conf.broker_url = os.environ["FENCED_REDIS_URL"]
    result = app.send_task(name, args=args, kwargs=kwargs or {}, queue=queue, **options)
    return str(result.id)
