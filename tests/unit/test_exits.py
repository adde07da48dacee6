"""Which pool process a report waits for (celery_fenced.exits), on real processes."""

from __future__ import annotations

import os
import subprocess
import sys

from celery_fenced import exits


def test_live_child__a_running_child_is_waited_for_an_exited_one_is_not() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert exits.live_child(f"w1@host:{child.pid}:") == child.pid
        child.kill()
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped
        # a zombie, which runs nothing
        assert exits.live_child(f"w1@host:{child.pid}:") is None
    finally:
        child.kill()
        child.wait()
    assert exits.live_child(f"w1@host:{child.pid}:") is None


def test_live_child__not_a_child_of_this_process_or_no_pid__none() -> None:
    assert exits.live_child(f"w1@host:{os.getpid()}:") is None  # itself
    assert exits.live_child(f"w1@host:{os.getppid()}:") is None  # its parent
    assert exits.live_child(None) is None
    assert exits.live_child("") is None
    assert exits.live_child("w1@host:not-a-pid:") is None
