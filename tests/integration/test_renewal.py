"""The per-process renewer: one thread, batched renewals."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
from django.db import connections, transaction
from django.db.models import F

from celery_fenced import LeaseBusy, LeaseLost, acquire, store
from celery_fenced.models import Lease, LeaseEvent
from celery_fenced.renewal import Renewer
from tests.conftest import WITH_MARIADB

pytestmark = pytest.mark.django_db(transaction=True, databases=WITH_MARIADB)


@pytest.fixture
def alias(alias_with_mariadb: str) -> str:
    """SQLite, PostgreSQL and MariaDB."""
    return alias_with_mariadb


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
    # the one write (MariaDB then reads back which rows it renewed: no UPDATE … RETURNING)
    renewals = [
        q for q in queries.captured_queries if " SET " in q["sql"] and "renewed_at" in q["sql"]
    ]
    assert len(renewals) == 1
    assert all(lease.expires_at >= b for lease, b in zip(leases, before, strict=True))
    assert not any(lease.lost for lease in leases)


def wait_for(condition: Callable[[], bool], seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


@contextmanager
def row_locked(alias: str, key: str) -> Iterator[None]:
    """Another connection holds the lease row: ``SELECT … FOR UPDATE``; on SQLite a write
    transaction (it locks the whole database)."""
    holding, done = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def hold() -> None:
        try:
            with transaction.atomic(using=alias):
                rows = Lease.objects.using(alias).select_for_update().filter(key=key)
                assert len(rows) == 1
                if connections[alias].vendor == "sqlite":
                    rows.update(owner=F("owner"))  # takes the write lock
                holding.set()
                done.wait(60)
        except BaseException as exc:
            errors.append(exc)
        finally:
            holding.set()
            connections.close_all()

    thread = threading.Thread(target=hold)
    thread.start()
    assert holding.wait(30)
    assert not errors
    try:
        yield
    finally:
        done.set()
        thread.join(60)
    assert not errors


def test_renewer__hung_renewal_loses_the_lease_at_its_local_deadline(alias: str) -> None:
    """The renewal waits on a lock: the lease is lost by the local deadline, not never."""
    renewer = Renewer()
    blocked = acquire("blocked", ttl=2, using=alias, renew_interval=0.3)
    free = acquire("free", ttl=30, using=alias, renew_interval=0.3)
    try:
        with row_locked(alias, "blocked"):
            started = time.monotonic()
            renewer.register(blocked)
            renewer.register(free)
            wait_for(lambda: blocked.lost)
            assert time.monotonic() >= blocked.local_deadline
            # and the renewer marks it (log, signal): at the deadline, or as refused once
            # the database's expiry lets the statement pass the locked row
            wait_for(lambda: blocked.marked_lost)
            with pytest.raises(LeaseLost):
                blocked.check()
            if alias != "default":  # row locks: the other lease is renewed meanwhile
                wait_for(lambda: free.confirmed_at > started + 0.5)

        def taken_over() -> bool:
            try:
                acquire("blocked", ttl=30, owner="another worker", using=alias)
            except LeaseBusy:
                return False
            return True

        wait_for(taken_over)  # the database's expiry came, and another worker took over
        assert blocked.lost
        with pytest.raises(LeaseLost):
            blocked.check()
        after = time.monotonic()
        wait_for(lambda: free.confirmed_at > after)  # the thread survived the timeouts
        assert renewer._thread is not None
        assert renewer._thread.is_alive()
        assert not free.lost
    finally:
        renewer.unregister(blocked)
        renewer.unregister(free)
    free.release()
    assert not free.lost


def test_lost__by_the_local_deadline_without_asking_the_database(alias: str) -> None:
    lease = acquire("k", ttl=30, using=alias)
    released = acquire("r", ttl=30, using=alias)
    released.release()
    for handle in (lease, released):
        handle._confirmed_at -= 31  # as if the last confirmed renewal were 31 s ago
    assert lease.lost
    assert lease.lost_reason is not None
    with pytest.raises(LeaseLost, match="no renewal reached the database before") as lost:
        lease.check()
    # no renewal attempt failed: nothing blames the database
    assert lost.value.reason == store.unrenewed(None)
    assert "paused, overloaded or cut off" in lost.value.reason
    assert "unreachable" not in lost.value.reason
    assert not released.lost  # a released lease is not lost


def test_lost__at_the_deadline_after_a_failed_renewal_names_its_error(alias: str) -> None:
    """The last renewal attempt failed on the database (a lock held past the renewer's
    time limit): the loss at the local deadline names that error, in the log, the
    ``lost`` event and ``LeaseLost``."""
    renewer = Renewer()
    lease = acquire("failing", ttl=2, using=alias, renew_interval=0.3)
    with row_locked(alias, "failing"):
        renewer.renew([lease], time_limit=True)  # times out on the lock: a database error
    assert not lease.marked_lost
    lease._confirmed_at -= 3  # the local deadline passed with no renewal confirmed
    renewer.renew([lease], time_limit=True)
    reason = lease.lost_reason
    assert reason is not None
    assert reason.startswith(store.UNRENEWED + ": the last renewal attempt failed with ")
    assert "OperationalError" in reason
    assert "paused" not in reason
    event = LeaseEvent.objects.using(alias).get(lease__key="failing", kind="lost")
    assert event.detail == {"reason": reason}
    with pytest.raises(LeaseLost) as lost:
        lease.check()
    assert lost.value.reason == reason


def test_lost__a_renewal_confirmed_after_a_failed_one_clears_its_error(alias: str) -> None:
    renewer = Renewer()
    lease = acquire("recovered", ttl=2, using=alias, renew_interval=0.3)
    with row_locked(alias, "recovered"):
        renewer.renew([lease], time_limit=True)
    renewer.renew([lease], time_limit=True)  # the lock is gone: renewed
    assert not lease.lost
    lease._confirmed_at -= 3  # then the process stalls past its deadline
    assert lease.lost_reason == store.unrenewed(None)


def _sleeping(renewer: Renewer) -> bool:
    """Whether the renewer's thread waits on its condition now (no notify since)."""
    with renewer._cond:
        return bool(renewer._cond._waiters)  # type: ignore[attr-defined]


def test_renewer__a_lease_due_later_does_not_wake_the_thread(alias: str) -> None:
    """Each wake-up costs the task's thread a switch to the renewer's: a lease due after
    the thread's wake-up, and the end of a lease it never renewed, let it sleep."""
    renewer = Renewer()
    first = acquire("sleep:first", ttl=30, using=alias)
    later = acquire("sleep:later", ttl=60, using=alias)
    try:
        renewer.register(first)
        due = first.confirmed_at + first.renew_interval
        wait_for(lambda: renewer._wake_at == due and _sleeping(renewer))
        renewer.register(later)  # due after the thread's wake-up
        assert _sleeping(renewer)
        renewer.unregister(later)
        renewer.unregister(first)  # nothing renewed: no connection to close
        assert _sleeping(renewer)
        assert renewer._wake_at == due
        sooner = acquire("sleep:sooner", ttl=3, using=alias)
        renewer.register(sooner)  # due before it: woken, and renewed on time
        wait_for(lambda: renewer._wake_at == sooner.confirmed_at + sooner.renew_interval)
        renewer.unregister(sooner)
        sooner.release()
    finally:
        first.release()
        later.release()
