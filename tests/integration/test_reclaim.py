"""The reclaimer on SQLite and PostgreSQL (and the portable fallback): claims, re-sends,
attempts, abandonment; a fenced task's recorded job. The recorded job's encoding and the
settings, which need no database, are in tests/unit/test_reclaim_jobs.py."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from celery import Celery
from django.db import connections
from django.db.models import F
from django.db.models.functions import Now
from django.test.utils import CaptureQueriesContext

from celery_fenced import acquire, store
from celery_fenced.exceptions import FencedConfigurationError
from celery_fenced.keys import key_headers
from celery_fenced.models import Lease, LeaseEvent, PendingJob
from celery_fenced.outbox import resend_pending
from celery_fenced.reclaim import Job, decode_job, encode_job, reclaim_expired
from celery_fenced.store import dialects
from tests.conftest import WITH_MARIADB
from tests.integration.test_store import data_statements

# the claims run in the test's own connection: a rolled-back test transaction will do
db = pytest.mark.django_db(databases=WITH_MARIADB)
# a fenced task renews from its own thread, which must see the committed grant
committed = pytest.mark.django_db(transaction=True, databases=WITH_MARIADB)


@pytest.fixture
def alias(alias_with_mariadb: str) -> str:
    """SQLite, PostgreSQL and MariaDB."""
    return alias_with_mariadb


TASK = "app.tasks.rebuild"


def recording_app(fail: bool = False, **conf: Any) -> tuple[Celery, list[dict[str, Any]]]:
    """A Celery app whose ``send_task`` records the messages instead of sending them."""
    app = Celery("reclaim-unit", set_as_current=False)
    app.conf.update(conf)
    sent: list[dict[str, Any]] = []

    def send_task(name: str, **options: Any) -> None:
        if fail:
            raise ConnectionError("broker down")
        sent.append({"name": name, **options})

    app.send_task = send_task  # type: ignore[method-assign]
    return app, sent


@pytest.fixture(params=["native", "portable"])
def dialect(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The SQL of each database, or the ORM fallback every other database gets."""
    if request.param == "portable":
        monkeypatch.setattr(dialects, "for_alias", lambda alias, **kw: dialects.ORMDialect(alias))
    return str(request.param)


def grant(
    alias: str, key: str = "k", task_id: str = "t1", *, expired: bool = True, **job: Any
) -> Any:
    """Grant ``key`` to task ``task_id`` with a recorded job; expire it by default."""
    recorded = Job(TASK, job.get("args", [7]), job.get("kwargs", {"x": 1}), job.get("options", {}))
    lease = store.grant(
        key, ttl=30, task_id=task_id, task_name=TASK, job=encode_job(recorded), using=alias
    )
    if expired:
        expire(alias, key)
    return lease


def expire(alias: str, key: str) -> None:
    # seconds in the past: the fallback's clock on SQLite (CURRENT_TIMESTAMP) has 1s steps;
    # expires_at first: MySQL's UPDATE reads the columns it already set
    Lease.objects.using(alias).filter(key=key).update(
        expires_at=F("acquired_at") - dt.timedelta(seconds=5),
        acquired_at=F("acquired_at") - dt.timedelta(seconds=10),
    )


def row(alias: str, key: str = "k") -> Lease:
    return Lease.objects.using(alias).get(key=key)


def kinds(alias: str, key: str = "k") -> list[tuple[str, int | None]]:
    events = LeaseEvent.objects.using(alias).filter(lease__key=key).order_by("id")
    return [(e.kind, e.token) for e in events]


# -- claims ------------------------------------------------------------------------------
@db
def test_reclaim__resends_an_expired_unfinished_job_once_with_its_task_id(
    alias: str, dialect: str
) -> None:
    grant(alias, options={"queue": "reports", "priority": 3})
    app, sent = recording_app()
    done = reclaim_expired(app, grace=0, using=alias)
    assert [(d.key, d.task_id, d.token, d.attempt, d.action) for d in done] == [
        ("k", "t1", 1, 1, "resent")
    ]
    assert sent == [
        {
            "name": TASK,
            "args": [7],
            "kwargs": {"x": 1},
            "task_id": "t1",
            "add_to_parent": False,
            "queue": "reports",
            "priority": 3,
        }
    ]
    assert reclaim_expired(app, grace=0, using=alias) == []  # one message per expiry
    assert len(sent) == 1
    lease = row(alias)
    assert (lease.reclaim_state, lease.reclaim_attempts) == ("resent", 1)
    assert lease.reclaim_claimed_at is not None
    assert kinds(alias) == [("resent", 1)]
    event = LeaseEvent.objects.using(alias).get(kind="resent")
    assert event.task_id == "t1"
    assert event.detail["attempt"] == 1
    assert event.detail["queue"] == "reports"


@db
def test_reclaim__leaves_alone_what_is_not_expired_and_unfinished(
    alias: str, dialect: str
) -> None:
    grant(alias, "held", expired=False)
    assert grant(alias, "released", expired=False).release(state="FAILURE")
    expire(alias, "released")
    grant(alias, "no_job")
    Lease.objects.using(alias).filter(key="no_job").update(job=None)
    acquire("plain", ttl=30, using=alias)  # the store API used directly: no job
    expire(alias, "plain")
    grant(alias, "expired")  # 5 s ago
    app, sent = recording_app()
    assert reclaim_expired(app, grace=60, using=alias) == []  # within the grace period
    assert sent == []
    assert [d.key for d in reclaim_expired(app, grace=0, using=alias)] == ["expired"]
    assert [m["task_id"] for m in sent] == ["t1"]


@db
def test_reclaim__a_completed_job_is_never_reclaimed(alias: str, dialect: str) -> None:
    lease = grant(alias, expired=False)
    assert lease.release(state="SUCCESS")
    expire(alias, "k")  # even with its times in the past
    assert row(alias).job is None  # the release dropped the job
    app, sent = recording_app()
    assert reclaim_expired(app, grace=0, using=alias) == []
    assert sent == []


@db
def test_reclaim__reexecution_takes_next_token_and_max_attempts_abandon_once(
    alias: str, dialect: str
) -> None:
    first = grant(alias)
    app, sent = recording_app(fenced_reclaim_max=2)
    previous = first.owner
    for attempt in (1, 2):
        assert [d.action for d in reclaim_expired(app, grace=0, using=alias)] == ["resent"]
        # the re-sent message runs: same task id, next token; then it dies again
        again = store.grant(
            "k", ttl=30, task_id="t1", task_name=TASK, job=row(alias).job, using=alias
        )
        assert (again.token, again.reclaimed_from) == (first.token + attempt, previous)
        previous = again.owner
        assert (row(alias).reclaim_attempts, row(alias).reclaim_state) == (attempt, "")
        expire(alias, "k")
    done = reclaim_expired(app, grace=0, using=alias)
    assert [(d.action, d.attempt, d.token) for d in done] == [("abandoned", 2, 3)]
    assert len(sent) == 2
    assert reclaim_expired(app, grace=0, using=alias) == []
    assert row(alias).reclaim_state == "abandoned"
    abandoned = LeaseEvent.objects.using(alias).get(kind="abandoned")
    assert (abandoned.token, abandoned.task_id) == (3, "t1")
    assert abandoned.detail["attempts"] == 2
    assert abandoned.detail["max"] == 2
    assert [k for k, _ in kinds(alias)] == [
        "resent",
        "reclaimed",
        "resent",
        "reclaimed",
        "abandoned",
    ]
    # the same task id granted again (a late redelivery) keeps its count: one more
    # expiry abandons it again; a release and another task id start afresh
    assert acquire("k", ttl=30, task_id="t1", task_name=TASK, using=alias).release()
    assert (row(alias).reclaim_state, row(alias).reclaim_attempts) == ("", 2)
    grant(alias, task_id="t2", expired=False)
    assert (row(alias).reclaim_state, row(alias).reclaim_attempts) == ("", 0)


@db
def test_reclaim__a_grant_for_another_task_id_resets_the_attempts(
    alias: str, dialect: str
) -> None:
    grant(alias)
    app, _ = recording_app()
    reclaim_expired(app, grace=0, using=alias)
    assert row(alias).reclaim_attempts == 1
    grant(alias, task_id="t2")
    lease = row(alias)
    assert (lease.task_id, lease.reclaim_attempts, lease.reclaim_state) == ("t2", 0, "")
    assert lease.reclaim_claimed_at is None


@db
def test_takeover_by_another_task_id__hands_the_displaced_job_to_the_outbox(
    alias: str, dialect: str
) -> None:
    """Its lease row's recorded job is replaced by the new grant's: the displaced one
    goes to the outbox, due at once, with its reclaim count; sent, it is t1's job."""
    grant(alias, args=[3])
    app, sent = recording_app()
    reclaim_expired(app, grace=0, using=alias)  # sent once already: 1 attempt
    grant(alias, task_id="t2", expired=False)
    (row,) = PendingJob.objects.using(alias).all()
    assert (row.task_id, row.task_name, row.key, row.sends) == ("t1", TASK, "k", 1)
    assert decode_job(row.job) == decode_job(encode_job(Job(TASK, [3], {"x": 1}, {})))
    assert row.resend_at <= row.published_at
    assert (row.unique_key, row.started_token, row.plain, row.abandoned_at) == (
        None,
        None,
        False,
        None,
    )
    assert [(o.task_id, o.action) for o in resend_pending(app, using=alias)] == [("t1", "resent")]
    assert [(m["name"], m["task_id"], m["args"]) for m in sent] == [(TASK, "t1", [3])] * 2


@db
def test_takeover_by_another_task_id__nothing_handed_over_when_nothing_was_lost(
    alias: str, dialect: str
) -> None:
    """A released grant, a grant without a recorded job, the same task id again, an
    abandoned job: the outbox gets nothing."""
    grant(alias, "released", expired=False)
    Lease.objects.using(alias).filter(key="released").update(released_at=F("acquired_at"))
    grant(alias, "released", task_id="t2")
    acquire("no-job", ttl=30, task_id="t1", using=alias)
    expire(alias, "no-job")
    acquire("no-job", ttl=30, task_id="t2", using=alias)
    grant(alias, "same")
    grant(alias, "same", expired=False)
    grant(alias, "abandoned")
    Lease.objects.using(alias).filter(key="abandoned").update(reclaim_state="abandoned")
    grant(alias, "abandoned", task_id="t2")
    assert list(PendingJob.objects.using(alias).all()) == []


@db
def test_takeover_by_another_task_id__a_stamped_until_done_row_stands_again(
    alias: str, dialect: str
) -> None:
    """A ``lease_unique="until_done"`` job's row is kept while its grant runs (stamped
    with its token): taken over, the row is due at once, not started any more."""
    lease = grant(alias)
    started = row(alias).acquired_at
    PendingJob.objects.using(alias).create(
        task_id="t1",
        task_name=TASK,
        key="k",
        job=encode_job(Job(TASK, [7], {"x": 1}, {})),
        published_at=started,
        resend_at=started + dt.timedelta(hours=1),
        unique_key="k",
        unique_until="until_done",
        started_token=lease.token,
    )
    grant(alias, task_id="t2", expired=False)
    (standing,) = PendingJob.objects.using(alias).all()
    assert (standing.task_id, standing.unique_key, standing.started_token) == ("t1", "k", None)
    assert PendingJob.objects.using(alias).filter(resend_at__lte=Now()).count() == 1  # due


@db
def test_reclaim__a_resent_job_that_never_started_is_sent_again_after_resend_after(
    alias: str, dialect: str
) -> None:
    grant(alias)
    app, sent = recording_app(fenced_reclaim_resend_after=60)
    reclaim_expired(app, grace=0, using=alias)
    assert reclaim_expired(app, grace=0, using=alias) == []
    Lease.objects.using(alias).filter(key="k").update(
        reclaim_claimed_at=F("reclaim_claimed_at") - dt.timedelta(seconds=61)
    )
    done = reclaim_expired(app, grace=0, using=alias)
    assert [(d.action, d.attempt) for d in done] == [("resent", 2)]
    assert [m["task_id"] for m in sent] == ["t1", "t1"]


@db
def test_reclaim__a_failed_send_gives_the_claim_back(alias: str, dialect: str) -> None:
    grant(alias)
    broken, _ = recording_app(fail=True)
    done = reclaim_expired(broken, grace=0, using=alias)
    assert [(d.action, d.attempt) for d in done] == [("failed", 1)]
    assert "broker down" in done[0].reason
    assert (row(alias).reclaim_state, row(alias).reclaim_attempts) == ("", 0)
    app, sent = recording_app()
    assert [d.action for d in reclaim_expired(app, grace=0, using=alias)] == ["resent"]
    assert len(sent) == 1


PICKLE = "cos\nsystem\n(S'touch /tmp/pwned'\ntR."


@db
def test_reclaim__an_unreadable_job_is_abandoned_not_sent(alias: str, dialect: str) -> None:
    grant(alias)
    Lease.objects.using(alias).filter(key="k").update(job=PICKLE)
    app, sent = recording_app()
    done = reclaim_expired(app, grace=0, using=alias)
    assert [d.action for d in done] == ["abandoned"]
    assert done[0].reason.startswith("unreadable job")
    assert sent == []
    assert row(alias).reclaim_state == "abandoned"
    assert (
        LeaseEvent.objects.using(alias)
        .get(kind="abandoned")
        .detail["reason"]
        .startswith("unreadable job")
    )


@db
def test_reclaim__dry_run_claims_and_sends_nothing(alias: str, dialect: str) -> None:
    grant(alias)
    app, sent = recording_app()
    preview = reclaim_expired(app, grace=0, using=alias, dry_run=True)
    assert [(d.key, d.action, d.attempt, d.dry_run) for d in preview] == [("k", "resent", 1, True)]
    assert sent == []
    assert row(alias).reclaim_state == ""
    assert [d.action for d in reclaim_expired(app, grace=0, using=alias)] == ["resent"]


@db
def test_reclaim__batches_until_every_expired_job_is_claimed(alias: str, dialect: str) -> None:
    for n in range(5):
        grant(alias, key=f"k{n}", task_id=f"t{n}")
    app, sent = recording_app()
    done = reclaim_expired(app, grace=0, using=alias, limit=2)
    assert sorted(d.task_id for d in done) == [f"t{n}" for n in range(5)]
    assert sorted(m["task_id"] for m in sent) == [f"t{n}" for n in range(5)]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"grace": -1}, "grace must be a number of seconds"), ({"limit": 0}, "limit must be")],
)
def test_reclaim__bad_arguments_are_refused(kwargs: dict[str, Any], message: str) -> None:
    app, _ = recording_app()
    with pytest.raises((ValueError, FencedConfigurationError), match=message):
        reclaim_expired(app, using="default", **kwargs)


@db
def test_claim__is_one_statement_on_postgresql_and_acquire_stays_one() -> None:
    alias = "postgres"
    job = encode_job(Job(TASK, [1], {}, {}))
    with CaptureQueriesContext(connections[alias]) as queries:
        store.grant("k", ttl=30, task_id="t1", task_name=TASK, job=job, using=alias)
    assert len(data_statements(queries)) == 1
    expire(alias, "k")
    with CaptureQueriesContext(connections[alias]) as queries:
        claims = dialects.for_alias(alias).claim_expired(
            grace=0, resend_after=300, max_attempts=3, limit=10
        )
    assert [(c.key, c.state, c.attempts) for c in claims] == [("k", "resent", 1)]
    statements = data_statements(queries)
    assert len(statements) == 1
    assert f"UPDATE {Lease._meta.db_table} SET" in statements[0]


@db
def test_claim__abandoning_writes_its_event_in_the_same_statement_on_postgresql() -> None:
    alias = "postgres"
    grant(alias)
    Lease.objects.using(alias).filter(key="k").update(reclaim_attempts=3)
    with CaptureQueriesContext(connections[alias]) as queries:
        claims = dialects.for_alias(alias).claim_expired(
            grace=0, resend_after=300, max_attempts=3, limit=10
        )
    assert [c.state for c in claims] == ["abandoned"]
    assert len(data_statements(queries)) == 1
    assert LeaseEvent.objects.using(alias).filter(kind="abandoned").count() == 1


@pytest.fixture
def fenced_database(settings: Any, alias: str) -> str:
    settings.CELERY_FENCED_DATABASE = alias
    return alias


@committed
def test_fenced_task__its_grant_records_the_job_and_the_release_drops_it(
    fenced_database: str,
) -> None:
    from testproject.demo.tasks import probe

    alias = fenced_database
    info = {"exchange": "", "routing_key": "q-probe", "priority": 0}
    request = {"delivery_info": info, "hostname": "w1", "is_eager": False}
    probe.push_request(id="task-1", called_directly=False, **request)  # as the tracer does
    try:
        value = probe(marker="m")
        held = Lease.objects.using(alias).get(key=value["key"])
        probe._fenced_release("SUCCESS")
    finally:
        probe.pop_request()
    assert (held.task_id, held.token, held.released_at) == ("task-1", 1, None)
    assert row(alias, value["key"]).job is None  # completed: never reclaimed
    assert decode_job(held.job or "") == Job(
        "testproject.demo.tasks.probe",
        [],
        {"marker": "m"},
        # a copy sent again runs under the key this grant took
        {
            "queue": "q-probe",
            "priority": 0,
            "headers": key_headers(value["key"], "testproject.demo.tasks.probe", "task-1"),
        },
    )


@committed
def test_periodic_task__is_registered_and_sweeps() -> None:
    from testproject.celery import app

    app.loader.import_default_modules()
    task = app.tasks["celery_fenced.reclaim"]
    assert task.apply().get() == 0


@db
def test_reclaim__signals_each_resent_and_abandoned_job(alias: str, dialect: str) -> None:
    from django.dispatch import Signal

    from celery_fenced import signals

    calls: list[tuple[str, dict[str, Any]]] = []

    def listen(name: str) -> Any:
        def receiver(sender: Any, signal: Signal, **kwargs: Any) -> None:
            calls.append((name, kwargs))

        return receiver

    resent, abandoned = listen("resent"), listen("abandoned")
    signals.lease_resent.connect(resent, weak=False)
    signals.lease_abandoned.connect(abandoned, weak=False)
    try:
        grant(alias)
        app, _ = recording_app(fenced_reclaim_max=1)
        reclaim_expired(app, grace=0, using=alias)
        job = row(alias).job  # the re-sent message runs, and expires unfinished again
        store.grant("k", ttl=30, task_id="t1", task_name=TASK, job=job, using=alias)
        expire(alias, "k")  # over the maximum now
        reclaim_expired(app, grace=0, using=alias)
    finally:
        signals.lease_resent.disconnect(resent)
        signals.lease_abandoned.disconnect(abandoned)
    owner = calls[0][1]["owner"]
    assert calls == [
        (
            "resent",
            {
                "key": "k",
                "token": 1,
                "owner": owner,
                "task_id": "t1",
                "task_name": TASK,
                "attempt": 1,
            },
        ),
        (
            "abandoned",
            {
                "key": "k",
                "token": 2,
                "owner": calls[1][1]["owner"],
                "task_id": "t1",
                "task_name": TASK,
                "reason": "too many re-sends",
            },
        ),
    ]
