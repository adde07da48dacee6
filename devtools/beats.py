"""Real `celery beat` processes for the acceptance tests: start, pause, kill."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from devtools.workers import ROOT, broker_url, wait_for

#: the fenced schedulers, by name: Celery's ``beat_schedule``, django-celery-beat's models
SCHEDULERS = {
    "default": "celery_fenced.beat:FencedScheduler",
    "database": "celery_fenced.beat:FencedDatabaseScheduler",
}


class Beat:
    """One `celery -A testproject beat -S celery_fenced.beat:FencedScheduler` (``scheduler``
    ``"database"``: ``FencedDatabaseScheduler``), in its own process group; ``schedule`` is
    its ``beat_schedule`` (JSON: seconds for intervals); ``env`` overrides the environment."""

    def __init__(
        self,
        name: str,
        *,
        database: str,
        schedule: dict[str, Any],
        ttl: float,
        log_dir: Path,
        broker: str | None = None,
        scheduler: str = "default",
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = f"{name}-{uuid.uuid4().hex[:6]}"
        self.log_path = log_dir / f"{self.name}.log"
        env = env or {}
        env = {
            **os.environ,
            "FENCED_USE_TEST_DATABASES": "1",
            "FENCED_DB": database if database in ("postgres", "mariadb") else "sqlite",
            "FENCED_BROKER_URL": env.get("FENCED_BROKER_URL") or broker_url(broker),
            "FENCED_BEAT_SCHEDULE": json.dumps(schedule),
            "FENCED_BEAT_TTL": str(ttl),
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
            "beat",
            "--loglevel",
            "INFO",
            "--scheduler",
            SCHEDULERS[scheduler],
            "--schedule",
            str(log_dir / f"{self.name}.schedule"),  # unused by the fenced scheduler
        ]
        self.log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_started(self, timeout: float = 60) -> None:
        def started() -> bool:
            if self.process.poll() is not None:
                raise AssertionError(f"beat {self.name} exited:\n{self.output()[-3000:]}")
            return "beat leading" in self.output() or "beat standing by" in self.output()

        wait_for(started, timeout, f"beat {self.name} to start")

    def pause(self) -> None:
        os.killpg(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.pid, signal.SIGCONT)

    def kill(self) -> None:
        os.killpg(self.pid, signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process.poll() is None:
            try:
                os.killpg(self.pid, signal.SIGCONT)
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait(timeout=30)
        self.log.close()
