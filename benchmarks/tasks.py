"""The no-op tasks of the end-to-end benchmark, one per way of running a job.

- ``noop_plain``: a plain ``Task`` (stored by django-celery-results' ``DatabaseBackend``);
- ``noop_plain_acks_late``: the same, acknowledged late as a ``FencedTask`` is;
- ``noop_fenced``: a ``FencedTask`` with one key per job (stored by
  ``FencedDatabaseBackend``);
- ``noop_unique``: ``noop_fenced`` queued once per job (``lease_unique="until_started"``);
- ``noop_redis_lock``: a plain task under a Redis lock per job, the way celery-singleton and
  python-redis-lock do it: ``SET key token NX PX ttl`` before the body, a compare-and-delete
  script after it;
- ``noop_floor``: the floor of ``noop_fenced``: a plain task acknowledged late that sends
  the two statements a fenced execution sends (its grant, and the release that writes its
  result row), captured from one by the runner, raw on a psycopg connection of its own
  that prepares them; no package code runs;
- ``noop_atomic``: ``noop_fenced`` with an atomic body (``lease_atomic``);
- ``write_atomic``: an atomic body doing one plain ``QuerySet.update()`` of its job's row;
- ``write_fenced``: the same write through ``fenced_update`` in a fenced (non-atomic) body.

The rows written are ``Report`` rows named ``bench-write-atomic:{job}`` and
``bench-write-fenced:{job}`` (the runner creates them): each raises if its row is missing.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import pickle
import uuid
from typing import Any

from celery import Task, shared_task

from celery_fenced import FencedTask, current_lease, fenced_update

LOCK_TTL_MS = 30_000

#: delete the lock only if it still holds our token (the lock's compare-and-delete)
UNLOCK_SCRIPT = """
if redis.call('get', KEYS[1]) == ARGV[1] then
    return redis.call('del', KEYS[1])
end
return 0
"""

_redis: Any = None
_unlock: Any = None


def redis_lock_client() -> tuple[Any, Any]:
    """This process's Redis client and registered unlock script (created on first use)."""
    global _redis, _unlock
    if _redis is None:
        import redis

        _redis = redis.Redis.from_url(os.environ["FENCED_REDIS_URL"])
        _unlock = _redis.register_script(UNLOCK_SCRIPT)
    return _redis, _unlock


class LockBusy(Exception):
    """Another execution holds the Redis lock of this job."""


class RedisLockTask(Task):  # type: ignore[type-arg]
    """A plain task that runs its body under a Redis ``SET NX PX`` lock on its job key."""

    abstract = True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        client, unlock = redis_lock_client()
        key = f"lock:{self.name}:{args[0] if args else ''}"
        token = uuid.uuid4().hex
        if not client.set(key, token, nx=True, px=LOCK_TTL_MS):
            raise LockBusy(key)
        try:
            return super().__call__(*args, **kwargs)
        finally:
            unlock(keys=[key], args=[token])


class FloorTask(Task):  # type: ignore[type-arg]
    """A plain task, acknowledged late, that sends a fenced execution's two statements
    (captured by the runner into ``BENCH_FLOOR_STATEMENTS``) raw, prepared, around its
    body: the grant of its job's key, then the release that writes its result row."""

    abstract = True
    acks_late = True
    ignore_result = True  # the release statement writes the result row

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        connection, (grant, grant_params), (release, release_params) = _floor()
        task_id = self.request.id
        key = f"bench-floor:{args[0] if args else ''}"
        owner = f"floor:{os.getpid()}"
        # the message's digest: the grant refuses a job already completed with it
        digest = hashlib.md5(f"{task_id}:{args}".encode()).hexdigest()
        named = {"key": key, "owner": owner, "task_id": task_id, "digest": digest}
        rows = connection.execute(grant, {**grant_params, **named}).fetchall()
        if not rows or rows[0][1] is None:
            raise RuntimeError(f"the captured grant did not grant {key!r}: {rows}")
        token = rows[0][1]
        retval = super().__call__(*args, **kwargs)
        now = dt.datetime.now(dt.timezone.utc)
        meta = {"fencing_token": token, "lease_key": key, "children": []}
        ending = {
            **release_params,
            **named,
            "token": token,
            "lock": f"celery_fenced.result:{task_id}",
            "detail": json.dumps({"state": "SUCCESS", "retries": 0, "digest": digest}),
            "result_task_id": task_id,
            "result_task_args": json.dumps(list(args)),
            "result_date_created": now,
            "result_date_done": now,
            "result_meta": json.dumps(meta),
        }
        if not connection.execute(release, ending).fetchall():
            raise RuntimeError(f"the captured release did not release {key!r}")
        return retval


_floor_statements: Any = None


def _floor() -> Any:
    """This process's connection (prepares every statement) and the captured statements."""
    global _floor_statements
    if _floor_statements is None:
        import psycopg

        with open(os.environ["BENCH_FLOOR_STATEMENTS"], "rb") as captured:
            conninfo, grant, release = pickle.load(captured)
        connection = psycopg.connect(conninfo, autocommit=True, prepare_threshold=0)
        _floor_statements = (connection, grant, release)
    return _floor_statements


@shared_task(name="bench.noop_plain")
def noop_plain(job: int) -> None:
    """Do nothing."""


@shared_task(name="bench.noop_plain_acks_late", acks_late=True)
def noop_plain_acks_late(job: int) -> None:
    """Do nothing, acknowledged after running (as a ``FencedTask`` is by default)."""


@shared_task(
    name="bench.noop_fenced", base=FencedTask, lease_key="bench:{job}", lease_ttl=30, bind=True
)
def noop_fenced(self: Any, job: int) -> None:
    """Do nothing, under the lease on ``bench:{job}``."""


@shared_task(
    name="bench.noop_unique",
    base=FencedTask,
    lease_key="bench-unique:{job}",
    lease_ttl=30,
    # lease_unique rests on the outbox: a run with it off (FENCED_OUTBOX=0) has none
    lease_unique=None if os.environ.get("FENCED_OUTBOX") == "0" else "until_started",
    bind=True,
)
def noop_unique(self: Any, job: int) -> None:
    """Do nothing; one copy per job queued at a time (``lease_unique``)."""


@shared_task(name="bench.noop_floor", base=FloorTask)
def noop_floor(job: int) -> None:
    """Do nothing, between the statements a fenced execution sends, raw."""


@shared_task(name="bench.noop_redis_lock", base=RedisLockTask)
def noop_redis_lock(job: int) -> None:
    """Do nothing, under a Redis lock on the job."""


@shared_task(
    name="bench.noop_atomic",
    base=FencedTask,
    lease_key="bench-atomic:{job}",
    lease_ttl=30,
    lease_atomic=True,
    bind=True,
)
def noop_atomic(self: Any, job: int) -> None:
    """Do nothing, under the lease on ``bench-atomic:{job}``, in one transaction."""


@shared_task(
    name="bench.write_atomic",
    base=FencedTask,
    lease_key="bench-write-atomic:{job}",
    lease_ttl=30,
    lease_atomic=True,
    bind=True,
)
def write_atomic(self: Any, job: int) -> None:
    """Update the job's row with a plain ``update()``: fenced by the body's transaction."""
    from testproject.demo.models import Report

    name = f"bench-write-atomic:{job}"
    if Report.objects.filter(name=name).update(built_by=self.request.id) != 1:
        raise LookupError(f"no Report row {name!r}")


@shared_task(
    name="bench.write_fenced",
    base=FencedTask,
    lease_key="bench-write-fenced:{job}",
    lease_ttl=30,
    bind=True,
)
def write_fenced(self: Any, job: int) -> None:
    """Update the job's row with ``fenced_update`` under the lease's token."""
    from testproject.demo.models import Report

    lease = current_lease()
    assert lease is not None
    name = f"bench-write-fenced:{job}"
    rows = Report.objects.filter(name=name)
    if fenced_update(rows, token=lease.token, built_by=self.request.id) != 1:
        raise LookupError(f"no Report row {name!r}")
