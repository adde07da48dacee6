"""Lease owners (celery_fenced.owners): one worker start's processes, and no other's."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from celery_fenced import lifecycle, owners


@pytest.fixture(autouse=True)
def kept_boot() -> Iterator[None]:
    """The tests make boot ids of their own: this process's is put back afterwards."""
    kept = owners._boot
    yield
    owners._boot = kept


def test_execution_owner__host_boot_pid_thread() -> None:
    owner = owners.execution_owner(SimpleNamespace(hostname="celery@worker"))
    assert owner == (
        f"celery@worker:{owners.boot()}:{os.getpid()}:{threading.get_ident() % 1000000}"
    )
    assert owner.startswith(owners.process_prefix("celery@worker", os.getpid()))
    assert len(owners.boot()) == 8
    assert owners.execution_owner(SimpleNamespace()).startswith(f"local:{owners.boot()}:")


def test_execution_owner__a_long_node_name_is_cut_the_owner_keeps_its_prefix() -> None:
    host = "w@" + "h" * 300
    owner = owners.execution_owner(SimpleNamespace(hostname=host))
    assert len(owner) <= owners.OWNER_LENGTH
    assert owner.startswith(owners.process_prefix(host, os.getpid()))
    assert owner.split(":")[1:3] == [owners.boot(), str(os.getpid())]


def test_new_boot__a_worker_start_makes_its_own_at_worker_init() -> None:
    """Celery's ``worker_init`` (sent in the main process before its pool starts) gives
    the worker a boot id of its own, even in a process that had one (it imported the
    package and forks workers)."""
    before = owners.boot()
    lifecycle.on_worker_init(sender=None)
    assert owners.boot() != before
    assert owners.process_prefix("w", 7) == f"w:{owners.boot()}:7:"


def test_boot__a_forked_process_shares_it() -> None:
    """A pool process forked by the worker's main process: its owners start with the
    prefix the main process reports its end by."""
    owners.new_boot()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its owner, then out at once
        os.write(write, owners.execution_owner(SimpleNamespace(hostname="w")).encode())
        os._exit(0)
    os.close(write)
    owner = os.read(read, 1000).decode()
    os.close(read)
    os.waitpid(pid, 0)
    assert owner.startswith(owners.process_prefix("w", pid))


def test_boot__a_process_started_by_this_one_has_its_own_not_in_the_environment() -> None:
    """A worker started by a process that imported the package (a test run) gets nothing
    of that process's boot id: it is in no environment variable."""
    assert all(owners.boot() not in value for value in os.environ.values())
    theirs = subprocess.run(
        [sys.executable, "-c", "from celery_fenced import owners; print(owners.boot())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert len(theirs) == 8
    assert theirs != owners.boot()
