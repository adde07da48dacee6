"""``python -m devtools.services start DIR``: a server that fails to start stops the rest.

The README's commands start throwaway servers through it; one that cannot start (a
missing package, a port taken) must not leave the others running behind a failed run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[2]

#: starts the servers with Redis's start made to fail, as a missing package would, once
#: PostgreSQL runs (RabbitMQ, the slowest to boot and stop, is left out)
FAILING_START = """
import sys
from devtools import services
services.spawn_rabbitmq = lambda base: {}
services.wait_rabbitmq = lambda env: None
services.start_redis = lambda base: sys.exit("Redis could not start (made to fail)")
services.main(["start", sys.argv[1]])
"""


def processes_under(folder: Path) -> list[str]:
    """The command lines of the running processes that name ``folder``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if str(folder) in command and entry.name != str(os.getpid()):
            found.append(command)
    return found


def test_a_server_that_fails_to_start_stops_the_others(tmp_path: Path) -> None:
    base = tmp_path / "servers"
    run = subprocess.run(
        [sys.executable, "-c", FAILING_START, str(base)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    assert run.returncode != 0
    assert "Redis could not start (made to fail)" in run.stderr
    assert "export " not in run.stdout  # no environment for servers that are not all up
    assert processes_under(base) == []  # PostgreSQL was stopped
    assert not base.exists()
