"""The README's first command: the demo plays the worked example and checks every step."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.workers
@pytest.mark.timeout(180)
def test_demo__plays_the_fenced_takeover_and_exits_0() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FENCED_")}
    run = subprocess.run(
        [sys.executable, "-m", "testproject.demo_run"],
        cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=170,
    )
    out = run.stdout
    assert run.returncode == 0, out[-6000:] + run.stderr[-3000:]
    for line in (
        "acquired report:42",
        "resent: the reclaimer sent the expired job again, same task id",
        "reclaimed report:42: takes over A's expired token 1",
        "stale_write_rejected: its update of demo.Report is refused (current token 2)",
        "stale_write_rejected: its FAILURE result is refused (current token 2)",
        "body='built by B under token 2' built_by='B' fencing_token=2",
    ):
        assert line in out
    assert "\nOK in " in out

    # `demo.sh admin` then has something on every page: a held lease to force-release
    admin = subprocess.run(
        [sys.executable, "-m", "testproject.demo_run", "admin", "--no-serve"],
        cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert admin.returncode == 0, admin.stdout + admin.stderr
    assert "running the demo first" not in admin.stdout  # the demo's report:42 is there
    with contextlib.closing(sqlite3.connect(ROOT / "testproject/.demo/demo.sqlite3")) as db:
        held = db.execute(
            "SELECT token FROM celery_fenced_lease WHERE key = 'export:nightly' "
            "AND released_at IS NULL"
        ).fetchall()
        kinds = {k for (k,) in db.execute("SELECT DISTINCT kind FROM celery_fenced_leaseevent")}
    assert len(held) == 1
    assert {"reclaimed", "stale_write_rejected", "resent"} <= kinds
