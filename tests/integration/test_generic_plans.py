"""The store's prepared statements keep finding a key's row by its key.

A prepared statement runs on a generic plan after its first few runs, and keeps that
plan until the table's statistics change. Made while few leases are held, a plan could
read the partial indexes of unreleased rows (``celery_fenced_lease_unreleased``,
``celery_fenced_lease_reclaim``) instead of the key's own index: they look empty then,
and every grant and release adds entries to them (dead ones until a vacuum), so that
plan slows down with every grant until the next ANALYZE. The statements that find a
row by its key or id are written so that the planner cannot use those indexes for them,
nor read the whole table (a permit grant's check for a completed job did, on any plan).
"""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connections, transaction

from celery_fenced import LeaseBusy, acquire, force_release, store
from celery_fenced.models import Lease
from celery_fenced.store import Delivery, grant
from celery_fenced.store.dialects.statements.common import LEASE_COLUMNS
from tests.conftest import DATABASE_ALIASES, DELIVERED
from tests.integration.test_kept_connection import run_one
from tests.integration.test_seams import Broker

pytestmark = [
    pytest.mark.django_db(transaction=True, databases=DATABASE_ALIASES),
    pytest.mark.timeout(120),
]

PARTIAL_INDEXES = ("celery_fenced_lease_unreleased", "celery_fenced_lease_reclaim")
#: released leases of other keys: enough that reading the table whole is never the
#: planner's cheapest way to find one row
RELEASED_ROWS = 20_000


@pytest.fixture(params=["force_generic_plan", "force_custom_plan"])
def planned(request: pytest.FixtureRequest, prepared_pg: str) -> str:
    """PostgreSQL with many released leases, analyzed (the partial indexes look empty),
    the store's statements prepared, on a session planning them one way only."""
    fill(prepared_pg)
    with connections[prepared_pg].cursor() as cursor:
        cursor.execute(f"SET plan_cache_mode = {request.param}")
    return prepared_pg


def fill(alias: str) -> None:
    """:data:`RELEASED_ROWS` released leases of other keys, the table analyzed."""
    with connections[alias].cursor() as cursor:
        cursor.execute(
            f"INSERT INTO celery_fenced_lease {LEASE_COLUMNS}"
            " SELECT 'released:' || g, 1, 'o', 't' || g, 'n', now(), now(), now(), now(),"
            f" '', NULL, 0, '', NULL, '', 'SUCCESS', 0 FROM generate_series(1, {RELEASED_ROWS}) g"
        )
        cursor.execute("ANALYZE celery_fenced_lease")


def scans(alias: str) -> dict[str, int]:
    """The scans of the lease table (read whole) and of each of its indexes in the
    current transaction of ``alias``'s session."""
    with connections[alias].cursor() as cursor:
        cursor.execute(
            "SELECT c.relname, pg_stat_get_xact_numscans(c.oid) FROM pg_class c"
            " WHERE c.oid = 'celery_fenced_lease'::regclass OR c.oid IN"
            " (SELECT indexrelid FROM pg_index WHERE indrelid = 'celery_fenced_lease'::regclass)"
        )
        return {str(name): int(count) for name, count in cursor.fetchall()}


def test_key_addressed_statements_read_the_keys_index_only(planned: str) -> None:
    alias = planned
    with transaction.atomic(using=alias):
        for round_no in range(3):  # past the first runs, on the kept plans
            lease = acquire(f"key:{round_no}", ttl=30, task_id=f"job-{round_no}", using=alias)
            lease.renew()
            lease.check()
            assert lease.release()
            permit = acquire("permits", ttl=30, limit=4, task_id=f"p-{round_no}", using=alias)
            permit.renew()
            assert permit.release()
            # a worker's grant of a permit: unless its job completed
            job = f"w-{round_no}"
            delivery = Delivery(job, f"{round_no:032d}", 0)
            held = grant("permits", ttl=30, limit=4, task_id=job, delivery=delivery, using=alias)
            assert held.release(state="SUCCESS")
            forced = acquire(f"forced:{round_no}", ttl=30, using=alias)
            assert force_release(forced.key, by="test", using=alias) == forced.token
        counted = scans(alias)
    assert {name: counted[name] for name in PARTIAL_INDEXES} == dict.fromkeys(PARTIAL_INDEXES, 0)
    assert counted["celery_fenced_lease"] == 0  # never read whole
    assert counted["celery_fenced_lease_key_uniq"] > 0
    # the permit job's index is still read (its predicate spelled as the statements do)
    assert counted["celery_fenced_lease_one_permit_per_job"] > 0
    assert Lease._default_manager.using(alias).filter(released_at__isnull=True).count() == 0


def custom_only(connection: Any) -> list[tuple[str, int]]:
    """The statements prepared on ``connection``'s session that ran ten times or more,
    each time planned anew (never on their generic plan), and how often."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT statement, custom_plans FROM pg_prepared_statements"
            " WHERE generic_plans = 0 AND custom_plans >= 10"
        )
        return [(str(sql)[:200], int(count)) for sql, count in cursor.fetchall()]


def on_generic_plans(connection: Any, *fragments: str) -> list[str]:
    """Which of ``fragments`` name a statement prepared on ``connection``'s session that
    ran on its generic plan (each must: the statements were prepared and kept)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement FROM pg_prepared_statements WHERE generic_plans > 0")
        kept = [str(sql) for (sql,) in cursor.fetchall()]
    return [f for f in fragments if any(f in sql for sql in kept)]


GRANT = "INSERT INTO celery_fenced_lease AS l"
RELEASE = "UPDATE celery_fenced_lease SET released_at"
PERMIT = "WITH clock AS MATERIALIZED"
OUTBOX = "INSERT INTO celery_fenced_pendingjob"


def test_statements_run_often__planned_once_each_not_at_every_run(
    broker: Broker, prepared_pg: str
) -> None:
    """PostgreSQL plans a prepared statement for its values until it finds the generic
    plan no dearer than those plans; one whose generic plan always looks dearer is
    planned again at every run (a permit's grant of limit 1 or 2 was: its planning took
    longer than the grant). Every statement the store runs often — a lease's grant,
    renewal, refusal and release, a permit's of limits 1, 2 and 4 (each on a session of
    its own: the plans of other limits would mask them), a task's publish, and its grant
    and success through Celery's tracer on the worker's kept connection, a unique job's
    publish and a refused copy's — runs on its generic plan after its first runs, on a
    table of many leases, analyzed."""
    fill(prepared_pg)
    connection = connections[prepared_pg]
    for _ in range(12):
        lease = acquire("plans", ttl=30, using=prepared_pg)
        lease.renew()
        with pytest.raises(LeaseBusy):
            acquire("plans", ttl=30, using=prepared_pg)
        assert lease.release()
    assert custom_only(connection) == []
    assert on_generic_plans(connection, GRANT, RELEASE) == [GRANT, RELEASE]
    for limit in (1, 2, 4):
        connection.close()  # a new session: its statements prepared afresh
        for _ in range(12):
            permit = acquire(f"plans-{limit}", ttl=30, using=prepared_pg, limit=limit)
            permit.renew()
            assert permit.release()
        assert custom_only(connection) == [], f"limit={limit}"
        assert on_generic_plans(connection, PERMIT) == [PERMIT], f"limit={limit}"
    connection.close()
    for n in range(12):
        run_one(broker, f"plans-{n}")
    assert custom_only(connection) == []
    keyed = broker.app.tasks["seams.keyed"]
    keyed.lease_unique = "until_started"
    try:
        for n in range(12):
            keyed.apply_async((n,))  # a new key: recorded
            keyed.apply_async((0,))  # a copy of job 0, queued: refused
    finally:
        keyed.lease_unique = None
    assert custom_only(connection) == []
    assert on_generic_plans(connection, OUTBOX) == [OUTBOX]
    kept = store.kept_connection(prepared_pg, DELIVERED)
    assert kept is not None
    assert custom_only(kept) == []
    assert on_generic_plans(kept, RELEASE[:25]) == [RELEASE[:25]]  # the success's release
