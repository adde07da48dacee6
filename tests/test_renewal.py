"""The per-process renewer: one thread, batched renewals."""

from __future__ import annotations

import time

import pytest

from celery_fenced import acquire
from celery_fenced.renewal import Renewer

from .conftest import DATABASE_ALIASES

pytestmark = pytest.mark.django_db(transaction=True, databases=DATABASE_ALIASES)


def test_renewer__one_thread_serves_short_leases_one_after_another(alias: str) -> None:
    """A lease held for less than a wake-up does not cost a new thread per execution."""
    renewer = Renewer()
    threads = []
    for n in range(3):
        lease = acquire(f"short:{n}", ttl=30, using=alias)
        renewer.register(lease)
        threads.append(renewer._thread)
        renewer.unregister(lease)
        lease.release()
        deadline = time.monotonic() + 0.5  # the thread wakes, finds nothing, and waits
        while time.monotonic() < deadline:
            assert renewer._thread is threads[0]
            assert threads[0] is not None
            assert threads[0].is_alive()
            time.sleep(0.01)
    assert threads == [threads[0]] * 3


def test_renewer__renews_every_held_lease_in_one_statement(alias: str) -> None:
    from django.db import connections
    from django.test.utils import CaptureQueriesContext

    leases = [acquire(f"held:{n}", ttl=30, using=alias) for n in range(5)]
    before = [lease.expires_at for lease in leases]
    with CaptureQueriesContext(connections[alias]) as queries:
        Renewer().renew(leases)
    renewals = [q for q in queries.captured_queries if "renewed_at" in q["sql"]]
    assert len(renewals) == 1
    assert all(lease.expires_at >= b for lease, b in zip(leases, before, strict=True))
    assert not any(lease.lost for lease in leases)
