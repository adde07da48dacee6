"""fenced_update on SQLite and PostgreSQL: the row's token, and the lease's when one is held."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connections
from django.db.models import F
from django.test.utils import CaptureQueriesContext

from celery_fenced import FencedTask, StaleToken, acquire, context, fenced_update
from celery_fenced.models import Lease, LeaseEvent
from celery_fenced.renewal import renewer
from celery_fenced.store import HeldLease
from testproject.demo.models import Report
from tests.conftest import WITH_MARIADB, end_session, refuse_one_reconnect
from tests.tracing import fenced_app, trace

db = pytest.mark.django_db(transaction=True, databases=WITH_MARIADB)


@pytest.fixture
def alias(alias_with_mariadb: str) -> str:
    """SQLite, PostgreSQL and MariaDB."""
    return alias_with_mariadb


def reports(alias: str, *tokens: int) -> Any:
    """Rows with these tokens; returns the queryset of all of them."""
    for i, token in enumerate(tokens):
        report = Report.objects.using(alias).create(name=f"r{i}", body="old")
        Report.objects.using(alias).filter(pk=report.pk).update(fencing_token=token)
    return Report.objects.using(alias).all()


def rows(alias: str) -> list[tuple[str, str, int]]:
    return list(
        Report.objects.using(alias).order_by("name").values_list("name", "body", "fencing_token")
    )


def taken_over(alias: str, key: str = "report:1") -> HeldLease:
    """A holder (token 1) whose grant expired and was reclaimed by another owner (token 2)."""
    stale = acquire(key, ttl=30, owner="paused", using=alias)
    Lease.objects.using(alias).filter(key=key).update(expires_at=F("acquired_at"))
    assert acquire(key, ttl=30, owner="fresh", using=alias).token == 2
    return stale


@pytest.fixture
def running_under() -> Iterator[Any]:
    """Make a lease the current one, as inside a fenced task; reset afterwards."""
    markers = []

    def run(lease: HeldLease) -> None:
        markers.append(context.current_lease_var.set(lease))

    yield run
    for marker in reversed(markers):
        context.current_lease_var.reset(marker)


@db
@pytest.mark.parametrize("row_token", [0, 2, 3])
def test_fenced_update__older_or_equal_row_is_updated_and_stamped(
    alias: str, row_token: int
) -> None:
    assert fenced_update(reports(alias, row_token), token=3, body="new") == 1
    assert rows(alias) == [("r0", "new", 3)]


@db
def test_fenced_update__newer_row_refuses_and_nothing_changes(alias: str) -> None:
    queryset = reports(alias, 1, 5, 2)
    with pytest.raises(StaleToken) as stale:
        fenced_update(queryset, token=3, body="new")
    assert (stale.value.token, stale.value.current) == (3, 5)
    assert "current token is 5" in str(stale.value)
    assert rows(alias) == [("r0", "old", 1), ("r1", "old", 5), ("r2", "old", 2)]


@db
def test_fenced_update__newer_row_committed_after_the_callers_snapshot_still_refuses(
    alias: str,
) -> None:
    """REPEATABLE READ (MariaDB's own default, a Django ``isolation_level`` away): a caller's
    transaction read the rows before another writer stamped one with a newer token. The
    update skips that row (it reads the latest version), and the check for a newer
    token must see it too, not the caller's snapshot: StaleToken, nothing changed."""
    from django.db import transaction

    if alias == "default":
        pytest.skip("SQLite has one writer: the other cannot commit meanwhile")
    queryset = reports(alias, 1, 2)
    connection = connections[alias]
    if connection.vendor == "mysql":
        with connection.cursor() as cursor:
            cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")

    def newer_writer() -> None:
        try:
            fenced_update(Report.objects.using(alias).filter(name="r1"), token=5, body="newer")
        finally:
            connections[alias].close()

    with transaction.atomic(using=alias):
        assert len(list(queryset)) == 2  # the caller's read: its snapshot, if any
        writer = threading.Thread(target=newer_writer)
        writer.start()
        writer.join(30)
        with pytest.raises(StaleToken):
            fenced_update(queryset, token=3, body="stale")
    assert rows(alias) == [("r0", "old", 1), ("r1", "newer", 5)]


@db
def test_fenced_update__filtered_queryset_ignores_other_rows(alias: str) -> None:
    reports(alias, 1, 9)
    assert fenced_update(Report.objects.using(alias).filter(name="r0"), token=2, body="new") == 1
    assert rows(alias) == [("r0", "new", 2), ("r1", "old", 9)]


@pytest.mark.parametrize("token", [0, -1, True, "3", 3.0, None])
def test_fenced_update__bad_token(token: Any) -> None:
    # refused before any query: this test has no database access
    with pytest.raises(ValueError, match=r"token must be a fencing token \(an int >= 1\)"):
        fenced_update(Report.objects.all(), token=token, body="new")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"field": "nope"}, "field 'nope' is not a field of demo.Report"),
        ({"fencing_token": 9}, "'fencing_token' is stamped by fenced_update"),
    ],
)
def test_fenced_update__bad_field(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        fenced_update(Report.objects.all(), token=3, body="new", **kwargs)


@db
def test_fenced_update__inside_a_current_guard(alias: str) -> None:
    lease = acquire("report:1", ttl=30, using=alias)
    with lease.guard():
        assert fenced_update(reports(alias, 0), token=lease.token, body="new") == 1
    assert rows(alias) == [("r0", "new", 1)]


@db
def test_fenced_update__stale_guard_refuses_before_the_write(alias: str) -> None:
    queryset = reports(alias, 0)
    stale = taken_over(alias)
    with pytest.raises(StaleToken) as refused, stale.guard():
        fenced_update(queryset, token=stale.token, body="stale")
    assert (refused.value.token, refused.value.current) == (1, 2)
    assert rows(alias) == [("r0", "old", 0)]


@db
def test_fenced_update__current_lease_holder_writes(alias: str, running_under: Any) -> None:
    lease = acquire("report:1", ttl=30, using=alias)
    running_under(lease)
    assert fenced_update(reports(alias, 0), token=lease.token, body="new") == 1
    assert rows(alias) == [("r0", "new", 1)]


@db
def test_fenced_update__taken_over_lease_is_refused_though_the_row_is_older(
    alias: str, running_under: Any
) -> None:
    queryset = reports(alias, 0)  # the row has not seen token 2 yet: it alone would accept 1
    stale = taken_over(alias)
    running_under(stale)
    with pytest.raises(StaleToken) as refused:
        fenced_update(queryset, token=stale.token, body="stale")
    assert (refused.value.key, refused.value.token, refused.value.current) == ("report:1", 1, 2)
    assert rows(alias) == [("r0", "old", 0)]
    assert stale.lost
    event = LeaseEvent.objects.using(alias).get(kind="stale_write_rejected")
    assert (event.lease.key, event.token, event.owner) == ("report:1", 1, "paused")
    assert event.detail["current_token"] == 2


@db
def test_fenced_update__current_lease_and_newer_row_records_the_refusal(
    alias: str, running_under: Any
) -> None:
    lease = acquire("report:1", ttl=30, using=alias)
    running_under(lease)
    with pytest.raises(StaleToken) as refused:
        fenced_update(reports(alias, 7), token=lease.token, body="new")
    assert (refused.value.key, refused.value.current) == ("report:1", 7)
    assert rows(alias) == [("r0", "old", 7)]
    event = LeaseEvent.objects.using(alias).get(kind="stale_write_rejected")
    assert (event.lease.key, event.token, event.detail["current_token"]) == ("report:1", 1, 7)


@db
def test_fenced_update__guard_of_another_key_does_not_prove_the_current_lease(
    alias: str, running_under: Any
) -> None:
    queryset = reports(alias, 0)
    stale = taken_over(alias, "report:1")
    other = acquire("other:1", ttl=30, using=alias)
    assert other.token == stale.token == 1
    running_under(stale)
    with pytest.raises(StaleToken), other.guard():
        fenced_update(queryset, token=stale.token, body="stale")
    assert rows(alias) == [("r0", "old", 0)]


@pytest.fixture
def primary_replica(alias: str, settings: Any) -> Iterator[str]:
    """Reads routed to ``alias``'s replica (the same database, another connection)."""
    from tests import routers

    routers.TARGET = alias
    settings.DATABASE_ROUTERS = ["tests.routers.PrimaryReplica"]
    yield alias
    routers.TARGET = "default"


replicated = pytest.mark.django_db(
    transaction=True, databases=[*WITH_MARIADB, *(f"{a}_replica" for a in WITH_MARIADB)]
)


@replicated
def test_fenced_update__routed_queryset_checks_and_writes_on_the_primary(
    primary_replica: str,
) -> None:
    alias = primary_replica
    reports(alias, 1, 5)
    queryset = Report.objects.all()  # not .using(): the router picks the databases
    assert queryset.db == f"{alias}_replica"
    with pytest.raises(StaleToken) as stale:
        fenced_update(queryset, token=3, body="new")
    assert stale.value.current == 5
    assert rows(alias) == [("r0", "old", 1), ("r1", "old", 5)]  # nothing partly written
    assert fenced_update(Report.objects.filter(name="r0"), token=3, body="new") == 1
    assert rows(alias) == [("r0", "new", 3), ("r1", "old", 5)]


@replicated
def test_fenced_update__explicit_using_is_kept(primary_replica: str) -> None:
    alias = primary_replica
    reports(alias, 1)
    with CaptureQueriesContext(connections[f"{alias}_replica"]) as on_replica:
        assert fenced_update(Report.objects.using(alias), token=2, body="new") == 1
    assert not on_replica.captured_queries
    assert rows(alias) == [("r0", "new", 2)]


@db
def test_save__instance_read_earlier_does_not_write_its_older_token_back(alias: str) -> None:
    reports(alias, 1)
    report = Report.objects.using(alias).get(name="r0")  # read under token 1
    fenced_update(Report.objects.using(alias).filter(pk=report.pk), token=5, body="by 5")
    report.built_by = "an unfenced save"
    report.save()
    assert rows(alias) == [("r0", "old", 5)]  # the save wrote its fields, not its token
    assert Report.objects.using(alias).get(pk=report.pk).built_by == "an unfenced save"
    assert report.fencing_token == 1  # the instance keeps what it read, not an expression
    with pytest.raises(StaleToken) as stale:
        fenced_update(Report.objects.using(alias).filter(pk=report.pk), token=3, body="by 3")
    assert stale.value.current == 5
    assert rows(alias) == [("r0", "old", 5)]


@db
@pytest.mark.parametrize("how", ["save", "create", "bulk_create"])
def test_save__insert_writes_no_token(alias: str, how: str) -> None:
    report = Report(name="r0", body="old", fencing_token=9)
    if how == "save":
        report.save(using=alias)
    elif how == "create":
        report = Report.objects.using(alias).create(name="r0", body="old", fencing_token=9)
    else:
        Report.objects.using(alias).bulk_create([report])
    assert rows(alias) == [("r0", "old", 0)]
    assert report.fencing_token == 0


@db
def test_save__inside_a_guard_holding_the_token_sets_it(alias: str) -> None:
    lease = acquire("report:1", ttl=30, using=alias)
    reports(alias, 0)
    report = Report.objects.using(alias).get(name="r0")
    with lease.guard():
        report.fencing_token = lease.token + 1  # not the guard's token: kept as stored
        report.save()
        assert rows(alias) == [("r0", "old", 0)]
        report.fencing_token = lease.token
        report.save()
        Report.objects.using(alias).create(name="r1", body="new", fencing_token=lease.token)
    assert rows(alias) == [("r0", "old", 1), ("r1", "new", 1)]
    report.fencing_token = 7
    report.save()  # outside the guard: kept as stored
    assert rows(alias) == [("r0", "old", 1), ("r1", "new", 1)]


@db
def test_fenced_update__helper_thread_of_a_taken_over_task_is_refused(lease_db: str) -> None:
    """The lease is found for the thread (no context) by its token, and proven."""
    alias = lease_db
    reports(alias, 0)  # the row has not seen the newer token: it alone would accept
    app = fenced_app("fencing-threads")
    outcome: dict[str, Any] = {}

    @app.task(bind=True, name="fencing.build", base=FencedTask, shared=False, lease_key="r:{n}")
    def build(self: Any, n: int) -> None:
        token = self.request.fencing_token
        Lease.objects.using(alias).filter(key="r:1").update(expires_at=F("acquired_at"))
        acquire("r:1", ttl=30, owner="fresh", using=alias)  # taken over: token 2

        def helper() -> None:
            try:
                outcome["updated"] = fenced_update(
                    Report.objects.using(alias), token=token, body="stale"
                )
            except StaleToken as exc:
                outcome["refused"] = exc
            finally:
                connections.close_all()

        thread = threading.Thread(target=helper)
        thread.start()
        thread.join(timeout=60)

    trace(build, "task-1", 1)
    assert "updated" not in outcome
    refused = outcome["refused"]
    assert (refused.key, refused.token, refused.current) == ("r:1", 1, 2)
    assert rows(alias) == [("r0", "old", 0)]


@db
def test_fenced_update__without_a_lease_in_context_proves_every_lease_held_under_the_token(
    alias: str,
) -> None:
    """Two leases of this process carry token 1 (different keys): the write proves both."""
    queryset = reports(alias, 0)
    current = acquire("k:current", ttl=30, using=alias)
    stale = taken_over(alias, "k:stale")
    assert current.token == stale.token == 1
    renewer().register(current)
    renewer().register(stale)
    try:
        with pytest.raises(StaleToken) as refused:
            fenced_update(queryset, token=1, body="stale")
        assert refused.value.key == "k:stale"
        renewer().unregister(stale)
        assert fenced_update(queryset, token=1, body="current") == 1
    finally:
        renewer().unregister(current)
        renewer().unregister(stale)
        current.release()
    assert rows(alias) == [("r0", "current", 1)]


@db
def test_fenced_update__without_context_a_lease_found_lost_is_still_proven(alias: str) -> None:
    """The renewer found the lease lost; until its execution ends, its token is refused."""
    queryset = reports(alias, 0)
    stale = acquire("k:stale", ttl=30, using=alias, renew_interval=0.05)
    Lease.objects.using(alias).filter(key="k:stale").update(expires_at=F("acquired_at"))
    acquire("k:stale", ttl=30, owner="fresh", using=alias)
    renewer().register(stale)
    try:
        deadline = time.monotonic() + 60
        while stale in renewer().held() or not stale.lost:  # the renewer's refusal
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with pytest.raises(StaleToken):
            fenced_update(queryset, token=stale.token, body="stale")
    finally:
        renewer().unregister(stale)
    assert rows(alias) == [("r0", "old", 0)]


@db
@pytest.mark.parametrize("raised", [ValueError, KeyboardInterrupt])
def test_guard__left_by_an_exception_after_its_session_ended__the_exception_stands(
    alias: str, monkeypatch: pytest.MonkeyPatch, raised: type[BaseException]
) -> None:
    """A guarded block raises (a retry, a time limit's exception) after the server ended
    its session while the database restarts: leaving the transaction, Django drops the
    dead connection and reconnects to restore autocommit, which the restarting server
    refuses. The block's own exception must reach the caller, not that connect error:
    nothing of the block committed (the server ended its transaction)."""
    connection = connections[alias]
    if connection.vendor == "sqlite":
        pytest.skip("SQLite has no session the server could end")
    lease = acquire("report:1", ttl=30, using=alias)
    refused: list[bool] = []

    def guarded_block() -> None:
        with lease.guard():
            end_session(alias)
            refuse_one_reconnect(monkeypatch, alias, refused)
            raise raised("the block's own")

    with pytest.raises(raised):
        guarded_block()
    assert refused
    monkeypatch.undo()
    lease.release()
