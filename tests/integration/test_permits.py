"""Permits: up to N holders of a key, each with a fencing token of the key's one
sequence, on SQLite, PostgreSQL and MariaDB — PostgreSQL's one-statement grant and the portable
transaction both (``dialect``)."""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connections
from django.db.models import F
from django.test import Client

from celery_fenced import (
    FencedConfigurationError,
    LeaseBusy,
    LeaseLost,
    StaleToken,
    acquire,
    fenced_update,
    force_release,
    permits,
    store,
)
from celery_fenced.exceptions import AlreadyCompleted, InvalidLeaseKey
from celery_fenced.models import Lease, LeaseEvent
from celery_fenced.store import dialects
from celery_fenced.store.types import Delivery
from testproject.demo.models import Report
from tests.conftest import WITH_MARIADB, run_in_threads
from tests.integration.test_admin import CHANGELIST, OPERATOR

pytestmark = pytest.mark.django_db(transaction=True, databases=WITH_MARIADB)


@pytest.fixture
def alias(alias_with_mariadb: str) -> str:
    """SQLite, PostgreSQL and MariaDB."""
    return alias_with_mariadb


@pytest.fixture(params=["native", "portable"])
def dialect(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each database's own grant, or the ORM transaction every other database gets."""
    if request.param == "portable":
        monkeypatch.setattr(dialects, "for_alias", lambda alias, **kw: dialects.ORMDialect(alias))
    return str(request.param)


def expire(alias: str, lease_key: str) -> None:
    Lease.objects.using(alias).filter(key=lease_key).update(expires_at=F("acquired_at"))


def test_up_to_limit_holders__distinct_increasing_tokens__then_busy(
    alias: str, dialect: str
) -> None:
    held = [acquire("k", ttl=30, limit=3, task_id=f"t{i}", using=alias) for i in range(3)]
    assert sorted(lease.key for lease in held) == [permits.permit_key("k", i) for i in range(3)]
    tokens = [lease.token for lease in held]
    assert tokens == sorted(set(tokens))  # distinct, in grant order
    with pytest.raises(LeaseBusy) as busy:
        acquire("k", ttl=30, limit=3, task_id="t3", using=alias)
    assert busy.value.holder == held[0].owner
    assert held[1].release()
    again = acquire("k", ttl=30, limit=3, task_id="t4", using=alias)
    assert again.key == held[1].key  # the freed permit
    assert again.token > max(tokens)
    assert LeaseEvent.objects.using(alias).filter(kind="busy").count() == 1


def test_tokens_stay_above_the_keys_plain_history(alias: str, dialect: str) -> None:
    for _ in range(3):
        acquire("k", ttl=30, using=alias).release()
    first = acquire("k", ttl=30, limit=2, using=alias)
    assert first.token > 3
    with pytest.raises(FencedConfigurationError, match=r"lease_limit=2"):
        acquire("k", ttl=30, using=alias)  # one holder beside the permits' holders: refused


def test_a_plain_holder_keeps_the_key_busy_for_permits(alias: str, dialect: str) -> None:
    plain = acquire("k", ttl=30, using=alias)
    with pytest.raises(LeaseBusy):
        acquire("k", ttl=30, limit=2, using=alias)
    plain.release()
    assert acquire("k", ttl=30, limit=2, using=alias).token > plain.token


def test_expired_permit__taken_over__its_holder_fenced_out(alias: str, dialect: str) -> None:
    first = acquire("k", ttl=30, limit=1, task_id="a", using=alias)
    expire(alias, first.key)
    second = acquire("k", ttl=30, limit=1, task_id="b", using=alias)
    assert (second.key, second.reclaimed_from) == (first.key, first.owner)
    assert second.token > first.token
    with pytest.raises(LeaseLost):
        first.renew()
    with pytest.raises(StaleToken), first.guard():
        pass
    assert not first.release()
    (event,) = LeaseEvent.objects.using(alias).filter(kind="reclaimed")
    assert (event.token, event.detail["previous_token"]) == (second.token, first.token)


def test_one_job_holds_one_permit__a_redelivery_is_busy_then_takes_its_own_back(
    alias: str, dialect: str
) -> None:
    """Two deliveries of one job (a redelivery, an outbox re-send) never run at once on two
    permits: the second finds the key busy with the first; once the first's permit has
    expired, the job takes that same permit over (a takeover of its own grant)."""
    first = acquire("k", ttl=30, limit=3, task_id="job-1", using=alias)
    with pytest.raises(LeaseBusy) as busy:
        acquire("k", ttl=30, limit=3, task_id="job-1", using=alias)
    assert busy.value.holder == first.owner
    acquire("k", ttl=30, limit=3, task_id="job-2", using=alias)  # another job: a permit
    expire(alias, first.key)
    again = acquire("k", ttl=30, limit=3, task_id="job-1", using=alias)
    assert (again.key, again.reclaimed_from) == (first.key, first.owner)


def test_lowering_the_limit__grants_none_above_it(alias: str, dialect: str) -> None:
    held = [acquire("k", ttl=30, limit=3, task_id=f"t{i}", using=alias) for i in range(3)]
    held[0].release()
    with pytest.raises(LeaseBusy):  # permits 1 and 2 are held: 2 of a limit of 2
        acquire("k", ttl=30, limit=2, using=alias)
    held[2].release()  # above the new limit: never granted again under it
    lease = acquire("k", ttl=30, limit=2, using=alias)
    assert lease.key == permits.permit_key("k", 0)
    with pytest.raises(LeaseBusy):
        acquire("k", ttl=30, limit=2, using=alias)


def test_a_completed_job__is_a_duplicate_under_any_permit(alias: str, dialect: str) -> None:
    delivery = Delivery("job-1", "digest-1", 0)
    first = store.grant("k", ttl=30, limit=2, task_id="job-1", delivery=delivery, using=alias)
    blocker = acquire("k", ttl=30, limit=2, task_id="other", using=alias)
    assert first.release(state="SUCCESS")
    blocker.release()
    acquire("k", ttl=30, limit=2, task_id="other-2", using=alias)  # takes permit 0 again
    with pytest.raises(AlreadyCompleted):
        store.grant("k", ttl=30, limit=2, task_id="job-1", delivery=delivery, using=alias)


def test_fenced_update__a_row_stamped_by_a_newer_permit_refuses_an_older_one(
    alias: str, dialect: str
) -> None:
    report = Report.objects.using(alias).create(name="r")
    older = acquire("k", ttl=30, limit=2, using=alias)
    newer = acquire("k", ttl=30, limit=2, using=alias)
    rows = Report.objects.using(alias).filter(pk=report.pk)
    with newer.guard():
        assert fenced_update(rows, token=newer.token, body="newer") == 1
    with pytest.raises(StaleToken), older.guard():
        fenced_update(rows, token=older.token, body="older")
    assert rows.get().body == "newer"


def test_separator_in_a_key__refused_by_name() -> None:
    with pytest.raises(InvalidLeaseKey, match="unit separator"):
        acquire("a\x1fb", ttl=30)


@pytest.mark.parametrize("limit", [0, -1, True, 1.5, "2", 10_001])
def test_bad_limit__refused_by_name(limit: Any) -> None:
    with pytest.raises(FencedConfigurationError, match="limit must be an integer from 1"):
        acquire("k", ttl=30, limit=limit)


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "first grants"])
@pytest.mark.parametrize("race_alias", ["postgres", "mariadb"])
def test_concurrent_acquirers__no_error__exactly_limit_granted(
    race_alias: str, warm: bool
) -> None:
    """Twelve threads, four permits, on a key with rows already or on a new key: four
    grants, eight busy, distinct tokens, and no database error (MariaDB: first grants that
    insert the key's rows at once must not deadlock, error 1213)."""
    if warm:
        acquire("c", ttl=30, limit=4, task_id="warm", using=race_alias).release()
    barrier = threading.Barrier(12)
    granted: list[Any] = []
    busy: list[Any] = []
    errors: list[BaseException] = []

    def take(i: int) -> None:
        try:
            barrier.wait(30)
            granted.append(acquire("c", ttl=30, limit=4, task_id=f"t{i}", using=race_alias))
        except LeaseBusy as exc:
            busy.append(exc)
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    run_in_threads(take, 12)
    assert not errors
    assert (len(granted), len(busy)) == (4, 8)
    assert len({lease.key for lease in granted}) == 4
    assert len({lease.token for lease in granted}) == 4


def test_grant_waiting_for_a_permit_row__starts_after_the_release_it_waited_for() -> None:
    """PostgreSQL: the one statement skips the permit row that the permit's release holds
    locked, so the grant's transaction waits for that row, then takes the permit. The grant starts
    (``acquired_at``, its event) once it has the row, not when its transaction began to
    wait (nor does its expiry count from there): a key's grants never overlap in its
    history (seen in the long chaos run as three grants current at once on a limit of
    two)."""
    from tests.conftest import side_connection, wait_until_blocked

    alias = "postgres"
    first = acquire("w", ttl=30, limit=1, task_id="first", using=alias)
    granted: list[Any] = []

    def take() -> None:
        try:
            granted.append(acquire("w", ttl=30, limit=1, task_id="second", using=alias))
        finally:
            connections.close_all()

    with side_connection(alias) as holder:  # the holder's release, its row locked
        holder.execute("BEGIN")
        holder.execute(
            "UPDATE celery_fenced_lease SET released_at = statement_timestamp() WHERE key = %s",
            [first.key],
        )
        thread = threading.Thread(target=take)
        thread.start()
        wait_until_blocked(alias, thread)
        (committing_at,) = holder.execute("SELECT clock_timestamp()").fetchone()
        holder.execute("COMMIT")
    thread.join(30)
    (second,) = granted
    row = Lease.objects.using(alias).get(key=first.key)
    assert row.token == second.token
    assert row.acquired_at >= committing_at  # not the clock read before the wait
    assert second.expires_at >= committing_at + dt.timedelta(seconds=30)


def test_grant_whose_snapshot_sees_a_release__starts_after_that_release(settings: Any) -> None:
    """PostgreSQL: the one-statement grant's clock is read after its snapshot. A release
    that commits after the grant statement began, but before it took its snapshot (here:
    while it waits for a table lock its planning needs), is seen by the grant; the grant
    must not then start before that release, or the key's history has one grant more
    than its limit current at once (the short chaos run on RabbitMQ: three on a limit of
    two)."""
    from celery_fenced.store.dialects.tables import PENDING
    from tests.conftest import side_connection, wait_until_blocked

    settings.CELERY_FENCED_EVENTS = "all"  # the grant's event too
    alias = "postgres"
    first = acquire("s", ttl=30, limit=1, task_id="first", using=alias)
    granted: list[Any] = []
    errors: list[BaseException] = []

    def take() -> None:
        try:
            granted.append(acquire("s", ttl=30, limit=1, task_id="second", using=alias))
        except BaseException as error:  # reported by the assertion below
            errors.append(error)
        finally:
            connections.close_all()

    with side_connection(alias) as planner, side_connection(alias) as holder:
        planner.execute("BEGIN")  # the grant's statement stops before its snapshot
        planner.execute(f"LOCK TABLE {PENDING} IN SHARE MODE")
        thread = threading.Thread(target=take)
        thread.start()
        wait_until_blocked(alias, thread)
        (released_at,) = holder.execute(
            "UPDATE celery_fenced_lease SET released_at = clock_timestamp()"
            " WHERE key = %s RETURNING released_at",
            [first.key],
        ).fetchone()
        planner.execute("COMMIT")
    thread.join(30)
    assert not errors
    (second,) = granted
    row = Lease.objects.using(alias).get(key=first.key)
    assert row.token == second.token
    assert row.acquired_at >= released_at
    assert second.expires_at >= released_at + dt.timedelta(seconds=30)
    assert (
        LeaseEvent.objects.using(alias).get(token=second.token, kind="acquired").at >= released_at
    )


def test_plain_grant_waiting_for_the_keys_row__starts_after_the_release_it_waited_for(
    settings: Any,
) -> None:
    """PostgreSQL: a plain key's grant (the upsert) waits in its conflict clause for the row
    a release holds; it starts (``acquired_at``, its expiry, its event) after that release,
    not at the clock its statement read before the wait."""
    from tests.conftest import side_connection, wait_until_blocked

    settings.CELERY_FENCED_EVENTS = "all"
    alias = "postgres"
    acquire("p", ttl=30, task_id="first", using=alias)
    granted: list[Any] = []

    def take() -> None:
        try:
            granted.append(acquire("p", ttl=30, task_id="second", using=alias))
        finally:
            connections.close_all()

    with side_connection(alias) as holder:  # the holder's release, begun before the grant
        holder.execute("BEGIN")
        holder.execute("SELECT 1 FROM celery_fenced_lease WHERE key = 'p' FOR UPDATE")
        thread = threading.Thread(target=take)
        thread.start()
        wait_until_blocked(alias, thread)
        (released_at,) = holder.execute(
            "UPDATE celery_fenced_lease SET released_at = clock_timestamp()"
            " WHERE key = 'p' RETURNING released_at"
        ).fetchone()
        holder.execute("COMMIT")
    thread.join(30)
    (second,) = granted
    row = Lease.objects.using(alias).get(key="p")
    assert (row.token, row.task_id) == (second.token, "second")
    assert row.acquired_at >= released_at
    assert row.renewed_at >= released_at
    assert second.expires_at >= released_at + dt.timedelta(seconds=30)
    assert (
        LeaseEvent.objects.using(alias).get(token=second.token, kind="acquired").at >= released_at
    )


def test_postgresql__a_free_permit_is_granted_in_one_statement() -> None:
    from django.test.utils import CaptureQueriesContext

    from tests.integration.test_store import data_statements

    acquire("k", ttl=30, limit=3, using="postgres")  # the key's head and its first permit
    with CaptureQueriesContext(connections["postgres"]) as queries:
        lease = acquire("k", ttl=30, limit=3, task_id="t", using="postgres")
    assert lease.key == permits.permit_key("k", 1)
    assert len(data_statements(queries)) == 1


def test_postgresql__a_released_permit__granted_without_the_takeovers_tables() -> None:
    """The routine grant of a released permit opens neither the events table (no routine
    events) nor the outbox's: the cheaper statement to plan and run; a takeover's
    statement is the second one. It makes the names of the first ``limit`` permits
    itself (a list given would make its prepared plans for small limits look cheaper
    than its generic plan, which PostgreSQL would then never keep)."""
    from django.test.utils import CaptureQueriesContext

    from tests.integration.test_store import data_statements

    acquire("k", ttl=30, limit=3, using="postgres").release()
    with CaptureQueriesContext(connections["postgres"]) as queries:
        lease = acquire("k", ttl=30, limit=3, task_id="t", using="postgres")
    (statement,) = data_statements(queries)
    assert lease.key == permits.permit_key("k", 0)
    assert "celery_fenced_leaseevent" not in statement
    assert "celery_fenced_pendingjob" not in statement
    assert "generate_series(0, 3 - 1)" in statement
    assert "ARRAY['" not in statement


def test_postgresql__a_grant_that_lost_the_race_for_a_free_permit__runs_again() -> None:
    """The key's one free permit is locked by another transaction (a grant of it not
    committed yet) when the routine statement runs: it grants none, and says it lost a
    race. The same statement runs again, from a new snapshot (the lock gone by then, here
    rolled back), and grants it: not the takeover's statement, nor the transaction."""
    from django.test.utils import CaptureQueriesContext

    from tests.integration.test_store import data_statements

    acquire("k", ttl=30, limit=1, using="postgres").release()
    other = connections.create_connection("postgres")
    try:
        other.set_autocommit(False)
        with other.cursor() as cursor:
            cursor.execute(
                "SELECT id FROM celery_fenced_lease WHERE key = %s FOR UPDATE",
                [permits.permit_key("k", 0)],
            )

        def then_unlock(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
            try:
                return execute(sql, params, many, context)
            finally:
                other.rollback()  # after the first statement: the later ones find it free

        with (
            connections["postgres"].execute_wrapper(then_unlock),
            CaptureQueriesContext(connections["postgres"]) as queries,
        ):
            lease = acquire("k", ttl=30, limit=1, using="postgres")
    finally:
        other.rollback()
        other.close()
    first, again = data_statements(queries)
    assert first == again
    assert "celery_fenced_leaseevent" not in again  # the routine grant's statement
    assert lease.key == permits.permit_key("k", 0)


def test_postgresql__all_permits_held__busy_without_running_the_grant_again() -> None:
    from django.test.utils import CaptureQueriesContext

    held = acquire("k", ttl=30, limit=1, using="postgres")
    with CaptureQueriesContext(connections["postgres"]) as queries, pytest.raises(LeaseBusy):
        acquire("k", ttl=30, limit=1, using="postgres")
    statements = [q["sql"] for q in queries.captured_queries]
    assert sum(s.startswith("WITH clock AS MATERIALIZED") for s in statements) == 2
    assert held.release()


def test_mariadb__a_free_permit_granted_in_one_statement__released_in_one() -> None:
    from django.test.utils import CaptureQueriesContext

    from tests.integration.test_store import data_statements

    acquire("k", ttl=30, limit=3, using="mariadb")  # the key's head and its first permits
    with CaptureQueriesContext(connections["mariadb"]) as queries:
        lease = acquire("k", ttl=30, limit=3, using="mariadb")
    assert lease.key == permits.permit_key("k", 1)
    assert len(data_statements(queries)) == 1
    with CaptureQueriesContext(connections["mariadb"]) as queries:
        assert lease.release()
    assert len(data_statements(queries)) == 1
    row = Lease.objects.using("mariadb").get(key=lease.key)
    assert (row.token, row.released_at is not None) == (lease.token, True)
    again = acquire("k", ttl=30, limit=3, using="mariadb")
    assert (again.key, again.token > lease.token) == (lease.key, True)


def test_mariadb__a_free_permit_granted_past_a_locked_head_and_a_locked_permit(
    settings: Any,
) -> None:
    """Another transaction holds the key's head row and one released permit's row locked
    (an acquirer on the transaction's path, a release not committed yet): the grant takes
    the next free permit without waiting for either (a wait would time out: an error)."""
    acquire("k", ttl=30, limit=3, using="mariadb").release()
    before = max(Lease.objects.using("mariadb").values_list("token", flat=True))
    other = connections.create_connection("mariadb")
    try:
        other.set_autocommit(False)
        with other.cursor() as cursor:
            cursor.execute(
                "SELECT id FROM celery_fenced_lease WHERE `key` IN (%s, %s) FOR UPDATE",
                ["k", permits.permit_key("k", 0)],
            )
        with connections["mariadb"].cursor() as cursor:
            cursor.execute("SET SESSION innodb_lock_wait_timeout = 1")
        lease = acquire("k", ttl=30, limit=3, using="mariadb")
        assert lease.key == permits.permit_key("k", 1)
        assert lease.token > before
        # a worker's grant too: a job's delivery, its outbox row ended in the same
        # transaction, the ``acquired`` event written with it
        settings.CELERY_FENCED_EVENTS = "all"
        job = store.grant(
            "k",
            ttl=30,
            limit=3,
            task_id="job-1",
            delivery=Delivery("job-1", "digest-1", 0),
            ends_pending=True,
            using="mariadb",
        )
        assert (job.key, job.token > lease.token) == (permits.permit_key("k", 2), True)
        event = LeaseEvent.objects.using("mariadb").get(kind="acquired", token=job.token)
        assert event.task_id == "job-1"
    finally:
        other.rollback()
        other.close()


def test_mariadb__permit_tokens_stay_above_every_earlier_one__both_paths() -> None:
    """Grants on the one-statement path and on the transaction's (a takeover of an expired
    permit) draw on one sequence above the key's floor: tokens only go up."""
    seen = []
    for _ in range(3):
        lease = acquire("k", ttl=30, limit=2, using="mariadb")
        seen.append(lease.token)
        lease.release()
        held = acquire("k", ttl=30, limit=2, using="mariadb")
        seen.append(held.token)
        expire("mariadb", held.key)
    taken = acquire("k", ttl=30, limit=2, using="mariadb")
    seen.append(taken.token)
    assert seen == sorted(set(seen))


def test_mariadb__sequence_made_again__permit_tokens_stay_above_earlier_ones() -> None:
    """Reversing the migration that makes the permits' sequence and applying it again
    starts the sequence above every token issued: no permit token comes again."""
    from django.core.management import call_command

    for _ in range(3):
        acquire("k", ttl=30, limit=2, using="mariadb").release()
    before = max(Lease.objects.using("mariadb").values_list("token", flat=True))
    call_command("migrate", "celery_fenced", "0014", database="mariadb", verbosity=0)
    call_command("migrate", "celery_fenced", database="mariadb", verbosity=0)
    assert acquire("k", ttl=30, limit=2, using="mariadb").token > before


# -- through Celery's tracer ---------------------------------------------------------------
def test_tracer__two_run_at_once__a_third_waits__a_stale_permit_holders_result_refused(
    broker: Any, lease_db: str
) -> None:
    """``lease_limit=2`` through Celery's tracer: A and B hold the two permits; C finds
    the key busy (retried); A's permit expires and C takes it over; A wakes: its result
    is refused (FAILURE(StaleToken): another job holds its permit), B's and C's stand."""
    from celery import states

    from tests.integration.test_seams import Execution, deliver, expire, status

    app = broker.app
    for tile in ("a", "b", "c"):
        app.signature("seams.permit", (7, tile)).apply_async(task_id=tile)
    a_msg, b_msg, c_msg = broker.sent("seams.permit")
    a = Execution(app, a_msg, "A")
    lease_a = _granted_permit(lease_db, "a")
    b = Execution(app, b_msg, "B")
    lease_b = _granted_permit(lease_db, "b")
    assert {lease_a.key, lease_b.key} == {permits.permit_key("tiles:7", i) for i in (0, 1)}
    deliver(app, c_msg)  # busy: both permits held — retried (fenced_on_busy)
    assert broker.sent("seams.permit")[-1][0]["id"] == "c"
    assert not Lease.objects.using(lease_db).filter(task_id="c").exists()
    expire(lease_db, lease_a)
    c = Execution(app, broker.sent("seams.permit")[-1], "C")
    lease_c = _granted_permit(lease_db, "c")
    assert lease_c.key == lease_a.key
    assert lease_c.token > lease_b.token > lease_a.token
    a.finish()
    b.finish()
    c.finish()
    row_status, result = status(lease_db, "a")
    assert (row_status, "StaleToken" in result) == (states.FAILURE, True)
    assert status(lease_db, "b") == (states.SUCCESS, f'"b@{lease_b.token}"')
    assert status(lease_db, "c") == (states.SUCCESS, f'"c@{lease_c.token}"')
    assert (
        not Lease.objects.using(lease_db)
        .filter(key__startswith="tiles:7" + permits.SEPARATOR, released_at__isnull=True)
        .exists()
    )


def _granted_permit(alias: str, task_id: str) -> Lease:
    from tests.integration.test_seams import wait_for

    return wait_for(  # type: ignore[no-any-return]
        lambda: (
            Lease.objects.using(alias).filter(task_id=task_id, released_at__isnull=True).first()
        ),
        f"a permit of task {task_id}",
    )


@pytest.mark.parametrize("alias", ["postgres", "mariadb"])
def test_concurrent_deliveries_of_one_job__one_permit_granted(alias: str) -> None:
    """Six threads deliver the same job at once, four permits free: one grant — the
    database's unique index on the job's permit decides, not a read (on MariaDB too, where
    the one-statement grant queues behind no other acquirer)."""
    acquire("one", ttl=30, limit=4, task_id="warm", using=alias).release()
    barrier = threading.Barrier(6)
    granted: list[Any] = []
    busy: list[Any] = []

    def take() -> None:
        try:
            barrier.wait(30)
            granted.append(acquire("one", ttl=30, limit=4, task_id="job-1", using=alias))
        except LeaseBusy as exc:
            busy.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=take) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert (len(granted), len(busy)) == (1, 5)


@pytest.mark.parametrize("limit", [1, 3])
@pytest.mark.parametrize("race_alias", ["postgres", "mariadb"])
def test_racing_grants__releases_expiries_forced_releases__tokens_only_go_up(
    race_alias: str, limit: int
) -> None:
    """Six threads grant permits of one key (plain and a job's, ending its outbox row or
    not; at the limit, one above, one below), then release, expire or force-release them:
    every grant's token is above every permit token committed before it was asked for,
    whichever path (one statement, or the transaction) granted it."""
    acquire("u", ttl=30, limit=limit, task_id="warm", using=race_alias).release()
    rows = Lease.objects.using(race_alias).filter(key__startswith="u" + permits.SEPARATOR)
    wrong: list[str] = []
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            for n in range(20):
                before = max(rows.values_list("token", flat=True))
                wanted = max(limit + n % 3 - 1, 1) if n % 4 == 0 else limit
                job = f"t{i}-{n}"
                try:
                    lease = store.grant(
                        "u",
                        ttl=30,
                        limit=wanted,
                        task_id=job,
                        delivery=Delivery(job, f"d-{job}", 0) if n % 2 else None,
                        ends_pending=n % 4 == 1,
                        using=race_alias,
                    )
                except LeaseBusy:
                    continue
                if lease.token <= before:
                    wrong.append(f"{lease.key}: {lease.token} after {before}")
                if n % 3 == 0:
                    lease.release()
                elif n % 3 == 1:
                    expire(race_alias, lease.key)
                else:
                    store.force_release(lease.key, using=race_alias)
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            connections.close_all()

    run_in_threads(run, 6, timeout=120)
    assert errors == []
    assert wrong == []


@pytest.mark.parametrize(
    ("tasks", "default", "fragment"),
    [
        ({"x.*": {"limit": 0}}, None, r"fenced_tasks\['x\.\*'\] limit must be an integer"),
        ({"x.*": {"limit": "3"}}, None, "limit must be an integer from 1 to 10000"),
        (
            {"x.*": {"limit": 2, "unique": "until_done"}},
            None,
            "unique='until_done' keeps one copy queued or running",
        ),
        ({}, True, "fenced_default_limit must be an integer"),
    ],
)
def test_invalid_limit__named_at_start(tasks: Any, default: Any, fragment: str) -> None:
    from celery import Celery

    from celery_fenced.conf import load

    app = Celery("permits-conf", set_as_current=False)
    app.conf.fenced_tasks = tasks
    app.conf.fenced_default_limit = default
    with pytest.raises(FencedConfigurationError, match=fragment):
        load(app)


def test_fenced_task__lease_limit_checked_at_definition() -> None:
    from celery_fenced import FencedTask

    with pytest.raises(FencedConfigurationError, match="option lease_limit must be an integer"):

        class Bad(FencedTask):  # type: ignore[misc]
            name = "bad"
            lease_limit = -2


# -- an adversarial review's scenarios ------------------------------------------------------
def expire_key(alias: str, lease_key: str) -> None:
    Lease.objects.using(alias).filter(key=lease_key).update(expires_at=F("acquired_at"))


# -- 1. lowering N: a job whose expired permit lies above the new limit never runs again --
def test_lowered_limit__job_with_expired_permit_above_it__is_granted_again(
    alias: str, dialect: str
) -> None:
    held = [acquire("k", ttl=30, limit=3, task_id=f"t{i}", using=alias) for i in range(3)]
    held[0].release()
    held[1].release()
    expire_key(alias, held[2].key)  # t2's worker died holding permit 2
    # the limit is lowered to 2; nothing is held; t2 is re-sent (reclaimer / redelivery)
    lease = acquire("k", ttl=30, limit=2, task_id="t2", using=alias)
    assert lease.key in {permits.permit_key("k", 0), permits.permit_key("k", 1)}
    with pytest.raises(LeaseLost):
        held[2].renew()


# -- 2. force release of a permit (admin, CLI, API) ---------------------------------------
def test_force_release__of_a_permit__ends_its_grant(alias: str) -> None:
    holder = acquire("k", ttl=30, limit=2, task_id="t", using=alias)
    assert force_release(holder.key, by="ops", using=alias) == holder.token
    with pytest.raises(LeaseLost):
        holder.renew()


def test_admin__force_release_action_on_a_permit(
    lease_db: str,
    login: Callable[..., Client],
) -> None:
    holder = acquire("tiles", ttl=30, limit=2, owner="worker-a", using=lease_db)
    pk = Lease.objects.using(lease_db).get(key=holder.key).pk
    client = login(*OPERATOR, username="olga")
    done = client.post(
        CHANGELIST,
        {"action": "force_release_selected", "_selected_action": [pk], "post": "yes"},
        follow=True,
    )
    assert "Force-released 1 lease" in done.content.decode()
    with pytest.raises(LeaseLost):
        holder.renew()


# -- 3. a stale permit holder's FAILURE(StaleToken) over its own redelivery's run ---------
def test_tracer__stale_holder_whose_job_runs_again_on_another_permit__writes_nothing(
    broker: Any, lease_db: str
) -> None:
    """lease_limit=2. Job a holds permit 0 and pauses past its ttl; y holds permit 1, so
    job x takes permit 0 over; y ends. a's message is delivered again and takes permit 1:
    the same job now runs on another permit. A (stale) wakes: the newer grant of *its
    job* is live, so (R2) nothing may be written: no FAILURE(StaleToken) for a while its
    second execution runs — one outcome for one task id."""
    from celery import states

    from tests.integration.test_permits import _granted_permit
    from tests.integration.test_seams import Execution, expire, status

    app = broker.app
    app.signature("seams.permit", (7, "a")).apply_async(task_id="a")
    a_msg = broker.sent("seams.permit")[0]
    a = Execution(app, a_msg, "A")
    lease_a = _granted_permit(lease_db, "a")
    expire(lease_db, lease_a)
    other = acquire("tiles:7", ttl=30, limit=2, task_id="y", using=lease_db)  # permit 1
    app.signature("seams.permit", (7, "x")).apply_async(task_id="x")
    x = Execution(app, broker.sent("seams.permit")[-1], "X")  # x takes permit 0 over
    assert _granted_permit(lease_db, "x").key == lease_a.key
    assert other.release()
    a2 = Execution(app, a_msg, "A2")  # a redelivered: permit 1
    lease_a2 = _granted_permit(lease_db, "a")
    assert lease_a2.key != lease_a.key
    a.finish()  # stale
    assert not (
        broker.app.backend.TaskModel.objects.using(lease_db)
        .filter(task_id="a", status=states.FAILURE)
        .exists()
    ), "a stale permit holder stored FAILURE while its job runs again on another permit"
    a2.finish()
    x.finish()
    assert status(lease_db, "a") == (states.SUCCESS, f'"a@{lease_a2.token}"')


def test_a_paused_holder_is_not_displaced_while_another_permit_is_free(
    alias: str, dialect: str
) -> None:
    paused = acquire("k", ttl=30, limit=2, task_id="a", using=alias)
    acquire("k", ttl=30, limit=2, task_id="b", using=alias).release()  # permit 1, released
    expire_key(alias, paused.key)
    taken = acquire("k", ttl=30, limit=2, task_id="c", using=alias)
    assert (taken.key, taken.reclaimed_from) == (permits.permit_key("k", 1), "")
    row = Lease.objects.using(alias).get(key=paused.key)
    assert (row.token, row.task_id) == (paused.token, "a")  # untouched


# -- 4. a job completed under the key's plain lease, redelivered once the key has permits --
def test_job_completed_under_the_plain_lease__is_a_duplicate_for_permits(
    alias: str, dialect: str
) -> None:
    delivery = Delivery("job-1", "digest-1", 0)
    plain = store.grant("k", ttl=30, task_id="job-1", delivery=delivery, using=alias)
    assert plain.release(state="SUCCESS")
    # the task is deployed with lease_limit=2; job-1's message comes again (acks_late)
    with pytest.raises(AlreadyCompleted):
        store.grant("k", ttl=30, limit=2, task_id="job-1", delivery=delivery, using=alias)


# -- 5. the reclaimer and an expired permit: the re-sent job takes the same permit --------
def test_tracer__reclaimed_permit__resent_job_takes_it_back_and_runs_once(
    broker: Any, lease_db: str
) -> None:
    from celery_fenced.reclaim import reclaim_expired
    from tests.integration.test_permits import _granted_permit
    from tests.integration.test_seams import Execution, deliver, expire, status, wait_for

    app = broker.app
    app.conf.fenced_reclaim = True  # an explicit key: reclaimed only when asked
    app.signature("seams.permit", (7, "a")).apply_async(task_id="a")
    a = Execution(app, broker.sent("seams.permit")[0], "A")
    lease_a = _granted_permit(lease_db, "a")
    expire(lease_db, lease_a)
    wait_for(lambda: reclaim_expired(app, grace=0, using=lease_db), "the re-send")
    deliver(app, broker.sent("seams.permit")[-1])
    row = Lease.objects.using(lease_db).get(key=lease_a.key)
    assert row.token > lease_a.token
    assert row.released_at is not None
    a.finish()
    assert status(lease_db, "a") == ("SUCCESS", f'"a@{row.token}"')
    assert reclaim_expired(app, grace=0, using=lease_db) == []


def test_postgresql__sequence_made_again__permit_tokens_stay_above_earlier_ones() -> None:
    """The permits' sequence made again at 1 (0007 reversed and applied again) is moved
    past every token issued when the migrations after it apply: no permit token comes
    again."""
    from django.core.management import call_command

    for _ in range(3):
        acquire("k", ttl=30, limit=2, using="postgres").release()
    before = max(Lease.objects.using("postgres").values_list("token", flat=True))
    with connections["postgres"].cursor() as cursor:  # what reversing 0007 leaves behind
        cursor.execute("ALTER SEQUENCE celery_fenced_permit_token RESTART WITH 1")
    call_command("migrate", "celery_fenced", "0015", database="postgres", verbosity=0)
    call_command("migrate", "celery_fenced", database="postgres", verbosity=0)
    assert acquire("k", ttl=30, limit=2, using="postgres").token > before
