"""The lease store on SQLite and PostgreSQL: grants, tokens, renewal, release, guard."""

from __future__ import annotations

import datetime as dt
import math
import re
from typing import Any

import pytest
from django.db import connections
from django.db.models import F
from django.test.utils import CaptureQueriesContext

from celery_fenced import (
    LeaseBusy,
    LeaseLost,
    StaleToken,
    acquire,
    force_release,
    store,
)
from celery_fenced import signals as fenced_signals
from celery_fenced.models import Completion, Lease, LeaseEvent
from celery_fenced.store.dialects import Dialect, for_alias
from celery_fenced.store.dialects.sqlite import SQLite
from celery_fenced.store.dialects.statements import sqlite as statements
from celery_fenced.store.types import Completed, Delivery, Ending, Grant, GrantRequest
from testproject.demo.models import Report
from tests.conftest import WITH_MARIADB, wait_until_blocked

pytestmark = pytest.mark.django_db(transaction=True, databases=WITH_MARIADB)


@pytest.fixture
def alias(alias_with_mariadb: str) -> str:
    """SQLite, PostgreSQL and MariaDB."""
    return alias_with_mariadb


def expire(alias: str, key: str) -> None:
    """Make the current grant on ``key`` expired by the database's clock."""
    Lease.objects.using(alias).filter(key=key).update(expires_at=F("acquired_at"))


def data_statements(queries: CaptureQueriesContext) -> list[str]:
    """The statements sent, without transaction control (BEGIN, SAVEPOINT, …)."""
    control = ("BEGIN", "COMMIT", "ROLLBACK", "SAVEPOINT", "RELEASE SAVEPOINT")
    sqls = [q["sql"].strip() for q in queries.captured_queries]
    return [s for s in sqls if not s.upper().startswith(control)]


def aware_time(text: str) -> dt.datetime:
    from django.utils.dateparse import parse_datetime

    parsed = parse_datetime(text)
    assert parsed is not None
    return parsed


def kinds(alias: str, key: str) -> list[tuple[str, int | None]]:
    events = LeaseEvent.objects.using(alias).filter(lease__key=key).order_by("id")
    return [(e.kind, e.token) for e in events]


@pytest.fixture(params=["anomalies", "all"])
def events(request: pytest.FixtureRequest, settings: Any) -> str:
    """Each ``fenced_events`` mode in turn."""
    settings.CELERY_FENCED_EVENTS = request.param
    return str(request.param)


@pytest.mark.core
def test_acquire__grants_token_one_then_busy(alias: str) -> None:
    lease = acquire("report:1", ttl=30, owner="worker-a", using=alias)
    assert (lease.key, lease.token, lease.owner, lease.lost) == ("report:1", 1, "worker-a", False)
    with pytest.raises(LeaseBusy) as busy:
        acquire("report:1", ttl=30, owner="worker-b", using=alias)
    assert busy.value.holder == "worker-a"
    assert busy.value.token == 1
    assert 0 < busy.value.remaining <= 30
    assert busy.value.expires_at == lease.expires_at
    row = Lease.objects.using(alias).get(key="report:1")
    assert row.released_at is None
    assert row.expires_at == lease.expires_at
    assert kinds(alias, "report:1") == [("busy", 1)]  # a grant is not an anomaly
    assert row.release_state == ""


def test_for_alias__one_dialect_per_alias_and_connection(alias: str) -> None:
    """Made once, not for each statement of every task; a connection of its own gets its
    own (its statements run there), and the portable one is always new."""
    dialect = for_alias(alias)
    assert for_alias(alias) is dialect
    other = connections.create_connection(alias)
    try:
        mine = for_alias(alias, connection=other)
        assert mine is not dialect
        assert mine.connection is other
        assert for_alias(alias, connection=other) is mine
    finally:
        other.close()
    assert for_alias(alias).connection is connections[alias]
    assert for_alias(alias, portable=True) is not for_alias(alias, portable=True)


@pytest.mark.parametrize("ttl", [30.0, 0.5, 3600.0])
def test_busy_wait__never_exceeds_the_ttl_on_sqlite(ttl: float) -> None:
    # the same statement's clock for both: a grant's expiry, read back at once, is the
    # ttl to the millisecond (julianday's double alone gave 30.00004 s of a 30 s grant)
    dialect = for_alias("default")
    assert isinstance(dialect, SQLite)
    # the holder's seconds left (``HOLDER``) of a grant's expiry (``GRANT``)
    granted = re.search(r"strftime\([^()]*\(%\(ttl\)s\)[^()]*\)", statements.GRANT)
    left = re.search(r"max\(round\(.*\), 0\.0\)", statements.HOLDER)
    assert granted is not None
    assert left is not None
    with connections["default"].cursor() as cursor:
        cursor.execute(
            "SELECT " + left.group(0).replace("expires_at", granted.group(0)),
            {"ttl": dialect.ttl_param(ttl)},
        )
        (remaining,) = cursor.fetchone()
    assert remaining == ttl


@pytest.mark.core
def test_release__next_grant_gets_next_token(alias: str, events: str) -> None:
    first = acquire("k", ttl=30, using=alias)
    assert first.release(state="SUCCESS") is True
    row = Lease.objects.using(alias).get(key="k")
    assert (row.release_state, row.released_at is not None) == ("SUCCESS", True)
    second = acquire("k", ttl=30, using=alias)
    assert second.token == first.token + 1
    routine = [("acquired", 1), ("released", 1), ("acquired", 2)]
    assert kinds(alias, "k") == (routine if events == "all" else [])
    row = Lease.objects.using(alias).get(key="k")
    assert (row.token, row.release_state, row.released_at) == (2, "", None)


@pytest.mark.core
def test_expiry__reclaims_with_next_token_and_records_previous_owner(
    alias: str, events: str
) -> None:
    from django.utils.dateparse import parse_datetime

    first = acquire("k", ttl=30, owner="paused", using=alias)
    started = Lease.objects.using(alias).get(key="k").acquired_at
    expire(alias, "k")
    second = acquire("k", ttl=30, owner="fresh", using=alias)
    assert second.token == 2
    assert second.reclaimed_from == "paused"
    event = LeaseEvent.objects.using(alias).get(kind="reclaimed")  # in both modes
    previous_start = event.detail.pop("previous_acquired_at")
    assert event.detail == {"previous_owner": "paused", "previous_token": 1}
    assert parse_datetime(previous_start) == started  # the grant taken over began then
    # the paused holder is fenced out of every operation
    with pytest.raises(LeaseLost):
        first.renew()
    assert first.lost
    assert first.release() is False
    row = Lease.objects.using(alias).get(key="k")
    assert (row.token, row.owner, row.released_at) == (2, "fresh", None)


def test_renew__extends_by_database_clock(alias: str) -> None:
    lease = acquire("k", ttl=30, using=alias)
    before = lease.expires_at
    after = lease.renew()
    assert after >= before
    assert Lease.objects.using(alias).get(key="k").expires_at == after


@pytest.mark.core
def test_renew__after_expiry_is_refused(alias: str) -> None:
    lease = acquire("k", ttl=30, using=alias)
    expire(alias, "k")
    with pytest.raises(LeaseLost):
        lease.renew()
    with pytest.raises(LeaseLost):
        lease.check()
    assert ("lost", 1) in kinds(alias, "k")


@pytest.mark.core
@pytest.mark.parametrize("operation", ["renew", "release", "guard"])
def test_stale_handle__fails_and_changes_nothing(alias: str, operation: str) -> None:
    stale = acquire("k", ttl=30, owner="a", using=alias)
    expire(alias, "k")
    current = acquire("k", ttl=30, owner="b", using=alias)
    before = Lease.objects.using(alias).values().get(key="k")
    Report.objects.using(alias).create(name="r", body="from b", fencing_token=current.token)
    if operation == "renew":
        with pytest.raises(LeaseLost):
            stale.renew()
    elif operation == "release":
        assert stale.release() is False
    else:
        with pytest.raises(StaleToken) as refused, stale.guard():
            Report.objects.using(alias).filter(name="r").update(body="from a")
        assert refused.value.current == current.token
    assert Lease.objects.using(alias).values().get(key="k") == before
    assert Report.objects.using(alias).get(name="r").body == "from b"
    current.renew()  # the current holder is untouched


def test_force_release__fences_the_holder(alias: str) -> None:
    holder = acquire("k", ttl=30, owner="a", using=alias)
    started = Lease.objects.using(alias).get(key="k").acquired_at
    assert force_release("k", by="admin:alice", using=alias) == 1
    with pytest.raises(LeaseLost):
        holder.renew()
    with pytest.raises(StaleToken), holder.guard():
        pass  # pragma: no cover - the guard refuses before the body
    assert force_release("k", using=alias) is None
    nxt = acquire("k", ttl=30, using=alias)
    assert nxt.token == 2
    event = LeaseEvent.objects.using(alias).get(kind="force_released")
    assert aware_time(event.detail.pop("acquired_at")) == started  # the grant it ended
    assert (event.token, event.owner, event.detail) == (1, "a", {"by": "admin:alice"})


@pytest.mark.core
def test_guard__commits_when_current_and_rolls_back_when_stale(alias: str) -> None:
    Report.objects.using(alias).create(name="r")
    lease = acquire("k", ttl=30, using=alias)
    with lease.guard():
        Report.objects.using(alias).filter(name="r").update(body="v1")
    assert Report.objects.using(alias).get(name="r").body == "v1"
    force_release("k", using=alias)
    with pytest.raises(StaleToken), lease.guard():
        Report.objects.using(alias).filter(name="r").update(body="v2")  # pragma: no cover
    assert Report.objects.using(alias).get(name="r").body == "v1"
    assert ("stale_write_rejected", 1) in kinds(alias, "k")


def test_guard__rolls_back_writes_when_body_raises(alias: str) -> None:
    Report.objects.using(alias).create(name="r")
    lease = acquire("k", ttl=30, using=alias)

    def write_then_fail() -> None:
        with lease.guard():
            Report.objects.using(alias).filter(name="r").update(body="half")
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        write_then_fail()
    assert Report.objects.using(alias).get(name="r").body == ""


def test_tokens__never_lowered_by_pruning_history(alias: str) -> None:
    for _ in range(3):
        acquire("k", ttl=30, using=alias).release()
    LeaseEvent.objects.using(alias).all().delete()
    assert acquire("k", ttl=30, using=alias).token == 4


def test_signals__sent_for_acquire_release_loss_and_rejection(alias: str) -> None:
    seen: list[tuple[str, int]] = []

    def receiver(name: str) -> Any:
        def receive(sender: Any, **kwargs: Any) -> None:
            seen.append((name, kwargs["token"]))

        return receive

    receivers = {n: receiver(n) for n in ("acquired", "lost", "released", "stale")}
    fenced_signals.lease_acquired.connect(receivers["acquired"])
    fenced_signals.lease_lost.connect(receivers["lost"])
    fenced_signals.lease_released.connect(receivers["released"])
    fenced_signals.stale_write_rejected.connect(receivers["stale"])
    try:
        lease = acquire("k", ttl=30, using=alias)
        force_release("k", using=alias)
        with pytest.raises(LeaseLost):
            lease.renew()
        with pytest.raises(StaleToken), lease.guard():
            pass  # pragma: no cover
    finally:
        fenced_signals.lease_acquired.disconnect(receivers["acquired"])
        fenced_signals.lease_lost.disconnect(receivers["lost"])
        fenced_signals.lease_released.disconnect(receivers["released"])
        fenced_signals.stale_write_rejected.disconnect(receivers["stale"])
    assert seen == [("acquired", 1), ("released", 1), ("lost", 1), ("stale", 1)]


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"key": ""}, "key must be a non-empty string"),
        ({"key": None}, "key must be a non-empty string"),
        ({"key": 42}, "key must be a non-empty string"),
        ({"key": "x" * 256}, "key must be at most 255 characters"),
        ({"ttl": 0}, "ttl must be a number of seconds greater than 0"),
        ({"ttl": -1}, "ttl must be a number of seconds greater than 0"),
        ({"ttl": "30"}, "ttl must be a number of seconds greater than 0"),
        ({"ttl": math.nan}, "ttl must be a number of seconds greater than 0"),
        ({"ttl": math.inf}, "ttl must be a number of seconds greater than 0"),
        ({"ttl": True}, "ttl must be a number of seconds greater than 0"),
        ({"owner": ""}, "owner must be a non-empty string"),
        ({"owner": "o" * 256}, "owner must be at most 255 characters"),
    ],
)
def test_acquire__bad_input_names_the_argument_and_writes_nothing(
    alias: str, arguments: dict[str, Any], message: str
) -> None:
    call: dict[str, Any] = {"key": "k", "ttl": 30, "owner": None, **arguments}
    with pytest.raises(ValueError, match=message):
        acquire(call.pop("key"), using=alias, **call)
    assert not Lease.objects.using(alias).exists()
    assert not LeaseEvent.objects.using(alias).exists()


def test_key__sql_metacharacters_round_trip_as_data(alias: str) -> None:
    key = "'); DROP TABLE celery_fenced_lease; -- %s %(x)s \\"
    lease = acquire(key, ttl=30, using=alias)
    assert Lease.objects.using(alias).get(key=key).token == lease.token
    assert lease.release()


@pytest.mark.parametrize("routine", [False, True], ids=["anomalies", "all"])
@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
def test_dialect__lifecycle(alias: str, portable: bool, routine: bool) -> None:
    """The single-statement dialects and the ORM fallback agree on every decision."""
    dialect = for_alias(alias, portable=portable)
    assert isinstance(dialect, Dialect)
    granted = dialect.acquire(GrantRequest("k", 30, "a", "t1", "task", routine_events=routine))
    assert getattr(granted, "token", None) == 1
    busy = dialect.acquire(GrantRequest("k", 30, "b", "t2", "task", routine_events=routine))
    assert (getattr(busy, "owner", None), getattr(busy, "token", None)) == ("a", 1)
    expire(alias, "k")
    reclaimed = dialect.acquire(GrantRequest("k", 30, "b", "t2", "task", routine_events=routine))
    assert (getattr(reclaimed, "token", None), getattr(reclaimed, "reclaimed_from", None)) == (
        2,
        "a",
    )
    assert dialect.release(Ending("k", 1, "a", "t1")) is False
    with connections[alias].cursor():
        pass
    from django.db import transaction

    with transaction.atomic(using=alias):
        assert dialect.prove_current("k", 2) == (True, 2)
    with transaction.atomic(using=alias):
        assert dialect.prove_current("k", 1) == (False, 2)
    assert dialect.release(Ending("k", 2, "b", "t2", "FAILURE", routine_events=routine)) is True
    assert Lease.objects.using(alias).get(key="k").release_state == "FAILURE"
    assert dialect.force_release("k", "me") is None
    expected = ["acquired", "busy", "reclaimed", "released"] if routine else ["busy", "reclaimed"]
    assert [k for k, _ in kinds(alias, "k")] == expected


def test_statements__one_per_operation_on_postgres() -> None:
    connection = connections["postgres"]
    counts = {}
    with CaptureQueriesContext(connection) as queries:
        lease = acquire("k", ttl=30, using="postgres")
    counts["acquire"] = len(data_statements(queries))
    with CaptureQueriesContext(connection) as queries:
        lease.renew()
    counts["renew"] = len(data_statements(queries))
    with CaptureQueriesContext(connection) as queries:
        lease.release()
    counts["release"] = len(data_statements(queries))
    assert counts == {"acquire": 1, "renew": 1, "release": 1}


def test_statements__sqlite_write_lock_first_then_the_upsert(events: str) -> None:
    connection = connections["default"]
    with CaptureQueriesContext(connection) as queries:
        lease = acquire("k", ttl=30, using="default")
    statements = data_statements(queries)
    # a write that changes nothing takes the write lock (and reads the previous start)
    assert statements[0].startswith("UPDATE celery_fenced_lease SET token = token")
    assert statements[1].startswith("INSERT INTO celery_fenced_lease")
    assert "ON CONFLICT" in statements[1]
    # then, with routine events, the grant's event (one transaction)
    assert len(statements) == (3 if events == "all" else 2)
    with CaptureQueriesContext(connection) as queries:
        lease.renew()
    assert len(data_statements(queries)) == 1


def delivery(task_id: str = "t1", retries: int = 0, digest: str = "m1") -> Delivery:
    return Delivery(task_id, digest, retries)


@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
def test_release_current__proves_and_releases_in_the_callers_transaction(
    alias: str, portable: bool
) -> None:
    from django.db import transaction

    dialect = for_alias(alias, portable=portable)
    granted = dialect.acquire(GrantRequest("k", 30, "a", "t1", "task"))
    assert getattr(granted, "token", None) == 1

    # a failure after it (the result write) rolls the release and its event back
    def failing_write() -> None:
        with transaction.atomic(using=alias):
            assert dialect.release_current(Ending("k", 1, "a", "t1", "SUCCESS", delivery())) == (
                True,
                1,
            )
            raise RuntimeError("the result write failed")

    with pytest.raises(RuntimeError):
        failing_write()
    row = Lease.objects.using(alias).get(key="k")
    assert (row.released_at, row.completed_digest, row.release_state) == (None, "", "")
    assert kinds(alias, "k") == []
    with transaction.atomic(using=alias):
        assert dialect.release_current(
            Ending("k", 1, "a", "t1", "SUCCESS", delivery(retries=2), routine_events=True)
        ) == (
            True,
            1,
        )
    row = Lease.objects.using(alias).get(key="k")
    assert (row.released_at is not None, row.job) == (True, None)
    assert (row.completed_digest, row.completed_retries, row.release_state) == ("m1", 2, "SUCCESS")
    assert row.completed_at is not None
    event = LeaseEvent.objects.using(alias).get(lease__key="k", kind="released")
    assert (event.token, event.task_id, event.owner) == (1, "t1", "a")
    assert event.detail == {"state": "SUCCESS", "retries": 2, "digest": "m1"}


@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
@pytest.mark.parametrize("case", ["released", "expired", "superseded", "unknown key"])
def test_release_current__refuses_a_grant_that_is_not_the_keys_unreleased_one(
    alias: str, portable: bool, case: str
) -> None:
    """prove_current also refuses an expired grant; release_current accepts one that
    nobody took over (its token is still the key's: no newer work exists)."""
    from django.db import transaction

    dialect = for_alias(alias, portable=portable)
    dialect.acquire(GrantRequest("k", 30, "a", "t1", "task"))
    token, current = 1, 1
    if case == "released":
        dialect.release(Ending("k", 1, "a", "t1"))
    elif case == "expired":
        expire(alias, "k")
    elif case == "superseded":
        expire(alias, "k")
        dialect.acquire(GrantRequest("k", 30, "b", "t2", "task"))
        current = 2
    key = "nosuch" if case == "unknown key" else "k"
    before = list(Lease.objects.using(alias).values().order_by("id"))
    events = kinds(alias, "k")
    with transaction.atomic(using=alias):
        assert dialect.prove_current(key, token) == (False, None if key == "nosuch" else current)
        outcome = dialect.release_current(Ending(key, token, "a", "t1", "SUCCESS", delivery()))
    if case == "expired":
        assert outcome == (True, 1)
        row = Lease.objects.using(alias).get(key="k")
        assert (row.released_at is not None, row.release_state) == (True, "SUCCESS")
        assert kinds(alias, "k") == events
        return
    assert outcome == (False, None if key == "nosuch" else current)
    assert list(Lease.objects.using(alias).values().order_by("id")) == before
    assert kinds(alias, "k") == events


@pytest.mark.core
def test_release_current__no_newer_grant_before_the_commit(alias: str) -> None:
    """R3: the proof's lock holds until the result transaction ends."""
    import threading

    from django.db import transaction

    dialect = for_alias(alias)
    dialect.acquire(GrantRequest("k", 30, "a", "t1", "task"))
    outcome: list[Any] = []

    def take_over() -> None:
        try:
            outcome.append(acquire("k", ttl=30, owner="b", using=alias).token)
        finally:
            connections[alias].close()

    with transaction.atomic(using=alias):
        assert dialect.release_current(Ending("k", 1, "a", "t1", "SUCCESS")) == (True, 1)
        other = threading.Thread(target=take_over)
        other.start()
        other.join(timeout=0.5)
        assert other.is_alive()  # waiting for the lease row
        assert not outcome
    other.join(timeout=30)
    assert outcome == [2]


def completion(alias: str, done: Delivery, state: str = "SUCCESS", key: str = "") -> None:
    """Grant ``done``'s task id a key (its own by default) and release it as ``state``."""
    from django.db import transaction

    dialect = for_alias(alias)
    key = key or f"done:{done.task_id}:{state}:{done.retries}"
    granted = dialect.acquire(GrantRequest(key, 30, "w", done.task_id, "task"))
    assert isinstance(granted, Grant)
    with transaction.atomic(using=alias):
        assert dialect.release_current(Ending(key, granted.token, "w", done.task_id, state, done))[
            0
        ]


@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
@pytest.mark.parametrize("same_key", [False, True], ids=["other-key", "same-key"])
@pytest.mark.parametrize(
    ("state", "completed_at", "delivered", "digest", "duplicate"),
    [
        ("SUCCESS", 0, 0, "m1", True),  # a redelivered message
        ("SUCCESS", 2, 1, "m1", True),  # an older message of the same task id
        ("FAILURE", 1, 1, "m1", True),
        ("FAILURE", 0, 1, "m1", False),  # a retry the body asked for before it failed
        ("SUCCESS", 0, 0, "m2", False),  # the task id reused for a new job
        # released as RETRY once the retry (retries + 1) was sent: a copy of the attempt's
        # own message does not run, the retry it asked for does
        ("RETRY", 0, 0, "m1", True),
        ("RETRY", 0, 1, "m1", False),
        ("REVOKED", 0, 0, "m1", False),
    ],
)
def test_acquire__completed_job_is_not_granted_in_the_same_statement(
    alias: str,
    portable: bool,
    same_key: bool,
    state: str,
    completed_at: int,
    delivered: int,
    digest: str,
    duplicate: bool,
) -> None:
    """Read from the lease row's marker, or from the marker it moved to the Completion
    table when another job completed under the key since. Per key: the same job under
    another key is not recognised."""
    completion(alias, delivery("t1", completed_at), state, key="job" if same_key else "")
    completion(alias, delivery("other", 9, "m1"))  # another task id's completion: nothing
    if same_key:
        completion(alias, delivery("t9", 0, "m9"), key="job")  # another job used it since
    dialect = for_alias(alias, portable=portable)
    before = kinds(alias, "job")
    outcome = dialect.acquire(
        GrantRequest("job", 30, "a", "t1", "task", None, delivery("t1", delivered, digest), 3600)
    )
    if duplicate and same_key:
        assert outcome == Completed("t1", delivered)
        assert kinds(alias, "job") == before
    else:
        assert isinstance(outcome, Grant)
        assert kinds(alias, "job") == before  # a grant is not an anomaly
    # without a delivery (or without a task id) nothing is checked
    assert isinstance(dialect.acquire(GrantRequest("free1", 30, "a", "t1", "task")), Grant)
    assert isinstance(
        dialect.acquire(GrantRequest("free2", 30, "a", "", "task", None, delivery(""), 3600)),
        Grant,
    )


@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
@pytest.mark.parametrize("same_key", [False, True], ids=["moved", "on-the-row"])
def test_acquire__completion_older_than_the_duplicate_window_is_not_a_duplicate(
    alias: str, portable: bool, same_key: bool
) -> None:
    from celery_fenced.models import Completion

    completion(alias, delivery(), key="job")
    if not same_key:  # another job completed under the key since: the marker moved
        completion(alias, delivery("t9", 0, "m9"), key="job")
        assert Completion.objects.using(alias).count() == 1
    dialect = for_alias(alias, portable=portable)
    assert isinstance(
        dialect.acquire(GrantRequest("job", 30, "a", "t1", "task", None, delivery(), 3600)),
        Completed,
    )
    # ten minutes later, with a window of five
    past = dt.timedelta(minutes=10)
    Lease.objects.using(alias).update(completed_at=F("completed_at") - past)
    Completion.objects.using(alias).update(completed_at=F("completed_at") - past)
    assert isinstance(
        dialect.acquire(GrantRequest("job", 30, "a", "t1", "task", None, delivery(), 300)), Grant
    )


@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
def test_acquire__completed_duplicate_of_a_held_key_is_a_duplicate_not_busy(
    alias: str, portable: bool
) -> None:
    from celery_fenced.store.types import Holder

    completion(alias, delivery(), key="job")
    dialect = for_alias(alias, portable=portable)
    # (a digest hashes the task id with the message: each task id has its own)
    dialect.acquire(
        GrantRequest("job", 30, "holder", "t2", "task", None, delivery("t2", 0, "m2"), 3600)
    )
    assert dialect.acquire(
        GrantRequest("job", 30, "a", "t1", "task", None, delivery(), 3600)
    ) == Completed("t1", 0)
    busy = dialect.acquire(
        GrantRequest("job", 30, "a", "t3", "task", None, delivery("t3", 0, "m3"), 3600)
    )
    assert isinstance(busy, Holder)
    assert busy.owner == "holder"
    assert kinds(alias, "job") == [("busy", 2)]


def redelivered_while_completing(alias: str, portable: bool, ending: Ending) -> Any:
    """t1's redelivery asks for the key while ``ending`` (a completion) is being committed:
    its grant statement starts before the commit and waits for the lease row. Returns
    what it was given."""
    import threading

    from django.db import transaction

    if portable and alias == "default":
        pytest.skip("the portable dialect relies on row locks, which SQLite does not have")
    outcome: list[Any] = []

    def redelivery() -> None:
        try:
            other = for_alias(alias, portable=portable)
            request = GrantRequest("job", 30, "c", "t1", "task", None, delivery(), 3600)
            outcome.append(other.acquire(request))
        finally:
            connections[alias].close()

    with transaction.atomic(using=alias):
        assert for_alias(alias, portable=portable).release_current(ending)[0]
        thread = threading.Thread(target=redelivery)
        thread.start()
        wait_until_blocked(alias, thread)
    thread.join(timeout=30)
    return outcome[0]


@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
def test_acquire__completion_committing_while_the_duplicate_waits_is_seen(
    alias: str, portable: bool
) -> None:
    """The duplicate's grant statement starts before the completing transaction commits
    and waits for the lease row: it must not be granted, since the completion it waited
    for makes it a duplicate."""
    dialect = for_alias(alias, portable=portable)
    dialect.acquire(GrantRequest("job", 30, "a", "t1", "task", None, delivery(), 3600))
    done = Ending("job", 1, "a", "t1", "SUCCESS", delivery())
    assert redelivered_while_completing(alias, portable, done) == Completed("t1", 0)
    assert Lease.objects.using(alias).get(key="job").token == 1


@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
def test_acquire__marker_moved_while_the_duplicate_waits_is_seen(
    alias: str, portable: bool
) -> None:
    """t1 completed under the key, then t9 took it. t9's completion moves t1's marker to
    the Completion table while t1's redelivery waits for the row: the grant statement's
    snapshot does not see the moved marker, so it must not be granted."""
    completion(alias, delivery(), key="job")
    dialect = for_alias(alias, portable=portable)
    t9 = delivery("t9", 0, "m9")
    granted = dialect.acquire(GrantRequest("job", 30, "b", "t9", "task", None, t9, 3600))
    assert isinstance(granted, Grant)
    done = Ending("job", 2, "b", "t9", "SUCCESS", t9)
    assert redelivered_while_completing(alias, portable, done) == Completed("t1", 0)
    assert Lease.objects.using(alias).get(key="job").token == 2


def test_acquire__store_raises_already_completed_and_marks_the_lease_row(alias: str) -> None:
    from celery_fenced.exceptions import AlreadyCompleted

    lease = store.grant("job", ttl=30, task_id="t1", delivery=delivery(retries=3), using=alias)
    assert lease.delivery == delivery(retries=3)
    assert lease.release(state="SUCCESS")
    row = Lease.objects.using(alias).get(key="job")
    assert (row.completed_digest, row.completed_retries, row.release_state) == ("m1", 3, "SUCCESS")
    with pytest.raises(AlreadyCompleted) as completed:
        store.grant("job", ttl=30, task_id="t1", delivery=delivery(retries=3), using=alias)
    assert (completed.value.key, completed.value.task_id, completed.value.retries) == (
        "job",
        "t1",
        3,
    )
    assert (
        store.grant("job", ttl=30, task_id="t1", delivery=delivery(retries=4), using=alias).token
        == 2
    )


def test_statements__routine_grant_and_release_leave_the_event_table_alone_on_postgres() -> None:
    """A new key, then a released one: one statement each, which checks for a completed
    duplicate but does not open the event table. The first release has no other job's
    marker to move (known from the grant); the second moves the first job's, and both
    jobs' redeliveries are still refused."""
    from celery_fenced.exceptions import AlreadyCompleted

    connection = connections["postgres"]
    for task_id in ("t1", "t2"):
        with CaptureQueriesContext(connection) as queries:
            lease = store.grant(
                "k",
                ttl=30,
                task_id=task_id,
                delivery=delivery(task_id, 0, task_id),
                using="postgres",
            )
        (grant,) = data_statements(queries)
        assert "NOT EXISTS" in grant  # the duplicate check
        assert LeaseEvent._meta.db_table not in grant
        with CaptureQueriesContext(connection) as queries:
            assert lease.release(state="SUCCESS")
        (release,) = data_statements(queries)
        assert LeaseEvent._meta.db_table not in release
        # t2's release moves t1's marker to the Completion table; t1's had none to move
        assert (Completion._meta.db_table in release) == (task_id == "t2")
    assert list(Completion.objects.using("postgres").values_list("digest", flat=True)) == ["t1"]
    for task_id in ("t1", "t2"):
        with pytest.raises(AlreadyCompleted):
            store.grant(
                "k",
                ttl=30,
                task_id=task_id,
                delivery=delivery(task_id, 0, task_id),
                using="postgres",
            )


def test_statements__takeover_is_granted_by_the_full_statement_with_its_event_on_postgres() -> (
    None
):
    first = acquire("k", ttl=30, task_id="t1", using="postgres")
    Lease.objects.using("postgres").filter(key="k").update(expires_at=F("acquired_at"))
    with CaptureQueriesContext(connections["postgres"]) as queries:
        second = acquire("k", ttl=30, task_id="t2", using="postgres")
    assert len(data_statements(queries)) == 2  # the routine grant refused a takeover
    assert second.reclaimed_from == first.owner
    event = LeaseEvent.objects.using("postgres").get(kind="reclaimed")
    assert (event.token, event.detail["previous_token"]) == (second.token, first.token)


@pytest.mark.parametrize("routine", [False, True], ids=["anomalies", "all"])
@pytest.mark.parametrize("displaces", [None, True, False], ids=["unknown", "moves", "none"])
@pytest.mark.parametrize("completing", [False, True], ids=["no marker", "marker"])
@pytest.mark.parametrize("operation", ["release", "release_current", "release_with_result"])
def test_release__every_shape_of_the_postgres_statement(
    operation: str, completing: bool, displaces: bool | None, routine: bool
) -> None:
    """Each optional part of the releasing statement (marker, its move, the event, the
    result lock and row) with the others: the parameters land where their SQL is."""
    from django.db import transaction
    from django_celery_results.models import TaskResult

    from celery_fenced.store import RESULT_COLUMNS

    first = store.grant(
        "k", ttl=30, task_id="x", delivery=Delivery("x", "X" * 32, 0), using="postgres"
    )
    assert first.release(state="SUCCESS")  # an earlier job's marker on the row
    lease = store.grant(
        "k", ttl=30, task_id="t", delivery=Delivery("t", "T" * 32, 0), using="postgres"
    )
    delivery = Delivery("t", "T" * 32, 0) if completing else None
    # "none" claims the row holds no other job's marker: then nothing is moved
    ending = Ending("k", lease.token, lease.owner, "t", "SUCCESS", delivery, routine, displaces)
    dialect = for_alias("postgres")
    if operation == "release":
        assert dialect.release(ending)
    elif operation == "release_current":
        with transaction.atomic(using="postgres"):
            assert dialect.release_current(ending) == (True, lease.token)
    else:
        row = TaskResult(task_id="t", status="SUCCESS", result='"v"', meta="{}")
        connection = connections["postgres"]
        values = [
            field.get_db_prep_save(field.pre_save(row, add=True), connection)
            for field in map(TaskResult._meta.get_field, RESULT_COLUMNS)
        ]
        assert dialect.release_with_result(ending, values) == (True, lease.token)
        assert TaskResult.objects.using("postgres").get(task_id="t").result == '"v"'
    held = Lease.objects.using("postgres").get(key="k")
    assert (held.released_at is not None, held.release_state) == (True, "SUCCESS")
    assert held.completed_digest == ("T" * 32 if completing else "X" * 32)
    moved = set(Completion.objects.using("postgres").values_list("digest", flat=True))
    assert moved == ({"X" * 32} if completing and displaces is not False else set())
    assert LeaseEvent.objects.using("postgres").filter(kind="released").exists() == routine


def test_event_outside_a_grant__waits_for_the_grants_row_without_deadlock(alias: str) -> None:
    """A ``duplicate`` event recorded while a grant's transaction holds the key's row, and
    then records an event of its own: both commit, no error (MariaDB's ``INSERT … SELECT``
    held the events table's AUTO-INC lock while it waited for the row, and the grant's
    event then waited for that lock: error 1213, seen in CI)."""
    import threading

    from django.db import transaction

    from celery_fenced import store

    if alias == "default":
        pytest.skip("SQLite has one writer: the event waits on its write lock, no row lock")
    lease = acquire("job", ttl=30, owner="a", using=alias)
    lease.release()
    errors: list[BaseException] = []

    def duplicate() -> None:
        try:
            store.record_duplicate("job", "t2", "b", {"retries": 0}, using=alias)
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections[alias].close()

    with transaction.atomic(using=alias):
        row = Lease.objects.using(alias).select_for_update().get(key="job")
        thread = threading.Thread(target=duplicate)
        thread.start()
        wait_until_blocked(alias, thread)
        LeaseEvent.objects.using(alias).create(
            lease_id=row.pk,
            kind="busy",
            token=row.token,
            task_id="t3",
            owner="c",
            at=dt.datetime.now(dt.UTC),
            detail={},
        )
    thread.join(30)
    assert not thread.is_alive()
    assert errors == []
    assert {"busy", "duplicate"} <= {k for k, _ in kinds(alias, "job")}
