"""The no-op tasks of the end-to-end benchmark, one per way of running a job.

- ``noop_plain``: a plain ``Task`` (stored by django-celery-results' ``DatabaseBackend``);
- ``noop_plain_acks_late``: the same, acknowledged late as a ``FencedTask`` is;
- ``noop_fenced``: a ``FencedTask`` with one key per job (stored by
  ``FencedDatabaseBackend``);
- ``noop_unique``: ``noop_fenced`` queued once per job (``lease_unique="until_started"``);
- ``noop_redis_lock``: a plain task under a Redis lock per job, the way celery-singleton and
  python-redis-lock do it: ``SET key token NX PX ttl`` before the body, a compare-and-delete
  script after it.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

from celery import Task, shared_task

from celery_fenced import FencedTask

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


@shared_task(name="bench.noop_redis_lock", base=RedisLockTask)
def noop_redis_lock(job: int) -> None:
    """Do nothing, under a Redis lock on the job."""
