"""Lease owners: who holds a grant, named so that one worker's report ends only its own.

An execution's owner is ``host:boot:pid:thread``: the worker's node name, a random id
made at each start of a worker in its main process (the *boot id*), the pool process and
the thread. The worker's main process reports the end of an execution it did not run (a
hard time limit, a lost pool process, a revoke) and ends the grants of that pool process
only, found by the prefix ``host:boot:pid:`` (:func:`process_prefix`).

The node name and the pid alone do not tell one process from another: two workers
started alike (``-n celery@worker`` on two machines, containers started from one image)
have the same name and often the same pool pids, and a restarted worker's processes may
be given the pids of its previous run's. The boot id tells them apart.

The pool processes share the boot id of the main process that forked them: it is made at
import (before any fork) and made again by :func:`new_boot` when a worker starts
(Celery's ``worker_init``, in the main process before it starts its pool), so a process
that imported the package and then forks workers gives each of them one of its own. It
lives in this process's memory only, never in the environment, which every process the
worker starts would inherit (a test run that starts workers as subprocesses, a worker
started by a task).
"""

from __future__ import annotations

import os
import secrets
import threading
from typing import Any

#: the owner column's length (``Lease.owner``, ``LeaseEvent.owner``)
OWNER_LENGTH = 255
#: the room the owner leaves the node name: ``:`` boot ``:`` pid (Linux's largest has 7
#: digits) ``:`` thread (6 digits), so that an owner is never cut and still starts with
#: its process's prefix
HOST_LENGTH = OWNER_LENGTH - (1 + 8 + 1 + 7 + 1 + 6)

_boot = secrets.token_hex(4)


def new_boot() -> str:
    """Make this process's boot id anew (a worker starting, before its pool forks)."""
    global _boot
    _boot = secrets.token_hex(4)
    return _boot


def boot() -> str:
    """This worker start's boot id: 8 hex digits, shared with the pool processes."""
    return _boot


def process_prefix(host: str | None, pid: int) -> str:
    """The prefix of the owners of process ``pid`` of this worker start: ``host:boot:pid:``."""
    return f"{(host or 'local')[:HOST_LENGTH]}:{_boot}:{pid}:"


def execution_owner(request: Any) -> str:
    """The lease owner of an execution of ``request`` in this thread:
    ``host:boot:pid:thread``."""
    host = getattr(request, "hostname", None)
    return f"{process_prefix(host, os.getpid())}{threading.get_ident() % 1000000}"
