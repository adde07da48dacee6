"""A task that ends in each celery-fenced error, so the tests can read them back.

Loaded by the workers of ``tests/acceptance/test_exceptions.py`` with
``--include testproject.demo.error_tasks``; ``AsyncResult.get()`` must raise the same
class with the same data, whatever the result serializer.
"""

from __future__ import annotations

from typing import Any

from celery import shared_task

from celery_fenced import FencedTask, acquire, force_release


@shared_task(
    bind=True,
    base=FencedTask,
    name="errors.raise_fenced_error",
    lease_key="errors:{kind}",
    lease_ttl=30,
    lease_on_busy="fail",
)
def raise_fenced_error(self: Any, kind: str) -> str:
    """``"stale"``: a newer job takes the key before the result is written (StaleToken);
    ``"lost"``: a lease this body took itself is taken away (LeaseLost); a key someone
    else holds when the task starts: LeaseBusy (``lease_on_busy="fail"``)."""
    if kind == "stale":
        key = self.request.lease_key
        force_release(key, by="test")
        acquire(key, ttl=30, owner="successor")  # a newer grant, another job's
        return "never stored: the backend refuses it"
    if kind == "lost":
        inner = acquire(f"errors:inner:{self.request.id}", ttl=30)
        force_release(inner.key, by="test")
        inner.renew()  # raises LeaseLost: the grant was ended
    return "ran"
