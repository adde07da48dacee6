"""The outbox with real `celery worker` processes on Redis and RabbitMQ.

Jobs are published through the fenced task's own ``apply_async`` in this process (the
publisher: a web request, say); the workers take them from the broker.
"""

from __future__ import annotations

import datetime as dt
import socket
import time
from typing import Any

import pytest
from celery import chain, chord
from django.db import transaction
from django.utils import timezone
from django_celery_results.models import ChordCounter, TaskResult

from celery_fenced import UncommittedJob
from celery_fenced.models import Lease, LeaseEvent, PendingJob
from celery_fenced.outbox import resend_pending
from devtools.workers import broker_app, broker_url, lose_queued, queued, wait_for
from testproject.demo.models import LedgerEntry
from tests.acceptance.test_task_workers import result_of
from tests.conftest import WITH_MARIADB
from tests.integration.test_outbox import rolled_back

pytestmark = [
    pytest.mark.django_db(transaction=True, databases=WITH_MARIADB),
    pytest.mark.workers,
    pytest.mark.timeout(240),
]


@pytest.fixture
def alias(alias_with_mariadb: str) -> str:
    """SQLite, PostgreSQL and MariaDB. A test marked ``parametrize("alias", ["postgres"])``
    runs on PostgreSQL alone: what it shows is the workers' and the broker's, while the
    SQL under it runs on all three in the integration layer."""
    return alias_with_mariadb


PROBE = "testproject.demo.tasks.probe"
EFFECT = "testproject.demo.tasks.apply_effect"


def publishing_app(broker_url: str) -> Any:
    """An app of the test project publishing to ``broker_url`` (close it after)."""
    import testproject.demo.tasks  # noqa: F401 - registers the demo's tasks

    return broker_app(broker_url)


@pytest.fixture
def publisher(lease_db: str, broker: str) -> Any:
    """The test project's app, publishing to the test's broker; leases on ``lease_db``."""
    app = publishing_app(broker_url(broker))
    yield app
    app.close()


def finished(alias: str, task_id: str) -> str:
    return str(result_of(alias, task_id, 90)[0])


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_published_in_a_rolled_back_transaction__never_runs(
    lease_db: str, start_worker: Any, publisher: Any
) -> None:
    start_worker("a")
    probe = publisher.tasks[PROBE]
    published: list[Any] = []
    rolled_back(
        lease_db,
        lambda: published.append(
            probe.apply_async(kwargs={"marker": "rolled back"}, queue=start_worker.queue)
        ),
    )
    (lost,) = published
    with transaction.atomic(using=lease_db):
        kept = probe.apply_async(kwargs={"marker": "kept"}, queue=start_worker.queue)
    # one worker, one process, one queue: a message sent first would have run first
    assert finished(lease_db, kept.id) == "SUCCESS"
    assert not TaskResult.objects.using(lease_db).filter(task_id=lost.id).exists()
    assert not Lease.objects.using(lease_db).filter(task_id=lost.id).exists()
    assert not PendingJob.objects.using(lease_db).exists()  # the kept one's ended at its grant


def test_waited_for_before_the_commit__raises_at_once_then_after_it_gets_the_result(
    lease_db: str, start_worker: Any, publisher: Any
) -> None:
    """Inside the publishing transaction the wait raises (the message is not sent yet);
    once it has committed, the same handle waits for the worker as Celery's does."""
    start_worker("a")
    probe = publisher.tasks[PROBE]
    with transaction.atomic(using=lease_db):
        result = probe.apply_async(kwargs={"marker": "waited"}, queue=start_worker.queue)
        started = time.monotonic()
        with pytest.raises(UncommittedJob) as raised:
            result.get(timeout=30)
        assert time.monotonic() - started < 10
        assert (raised.value.task_id, raised.value.alias) == (result.id, lease_db)
    assert result.get(timeout=90)["marker"] == "waited"


@pytest.mark.parametrize("alias", ["postgres"])
def test_published_while_the_broker_is_down__runs_once_when_it_is_back(
    lease_db: str, start_worker: Any, publisher: Any, broker: str
) -> None:
    """The caller gets its result handle, no error; the reclaimer sends the job once the
    broker answers again, and it runs once."""
    start_worker("a")
    nowhere = {"redis": "redis://127.0.0.1:{}/0", "rabbitmq": "amqp://guest:guest@127.0.0.1:{}//"}
    down = publishing_app(nowhere[broker].format(free_port()))  # nothing listens there
    try:
        with transaction.atomic(using=lease_db):
            result = down.tasks[PROBE].apply_async(
                kwargs={"marker": "down"}, queue=start_worker.queue
            )
        row = PendingJob.objects.using(lease_db).get(task_id=result.id)
        assert row.unsent
        assert [o.action for o in resend_pending(down)] == ["failed"]  # still down
    finally:
        down.close()
    assert [o.action for o in resend_pending(publisher)] == ["resent"]  # the broker is back
    assert finished(lease_db, result.id) == "SUCCESS"
    lease = Lease.objects.using(lease_db).get(task_id=result.id)
    assert lease.token == 1  # granted once
    assert not PendingJob.objects.using(lease_db).exists()


@pytest.mark.parametrize("alias", ["postgres"])
def test_broker_emptied_mid_run__every_job_completes_exactly_once(
    lease_db: str, start_worker: Any, publisher: Any, settings: Any, broker: str
) -> None:
    """The broker loses the queued messages while jobs are queued and running (Redis
    restarted without persistence; RabbitMQ's queue purged). The reclaimer sends each job
    that no worker started, and each completes once (one grant, one result)."""
    settings.CELERY_FENCED_OUTBOX_RESEND_AFTER = 1.0
    start_worker("a")
    probe = publisher.tasks[PROBE]
    ids = [
        # a backlog of seconds when the broker loses it (not drained by a short stall)
        probe.apply_async(kwargs={"seconds": 0.5, "marker": f"m{i}"}, queue=start_worker.queue).id
        for i in range(12)
    ]
    results = TaskResult.objects.using(lease_db).filter(task_id__in=ids, status="SUCCESS")
    wait_for(lambda: results.count() >= 2, 90, "two jobs to finish")
    lose_queued(broker, [start_worker.queue])
    lost = PendingJob.objects.using(lease_db).count()

    def all_done() -> bool:
        resend_pending(publisher)
        return results.count() == len(ids)

    wait_for(all_done, 150, "every job to finish", every=0.5)
    assert lost > 0  # the flush did lose queued jobs
    leases = Lease.objects.using(lease_db).filter(task_id__in=ids)
    assert sorted(leases.values_list("task_id", flat=True)) == sorted(ids)
    assert set(leases.values_list("token", flat=True)) == {1}  # each granted once
    assert not PendingJob.objects.using(lease_db).filter(task_id__in=ids).exists()


@pytest.mark.parametrize("alias", ["postgres"])
def test_plain_callback_lost_in_the_broker__sent_again_and_runs_once(
    lease_db: str, start_worker: Any, publisher: Any, tmp_path: Any, broker: str
) -> None:
    """A fenced job's plain ``link`` callback is sent on its success and lost by the broker
    (Redis restarted empty, RabbitMQ's queue purged) before any worker takes it: its outbox
    row still stands (it ends when a worker starts the job), so the reclaimer sends it
    again and it runs once."""
    from devtools.workers import Worker
    from testproject.demo.models import LedgerEntry

    start_worker("a")
    later = f"{start_worker.queue}-callbacks"  # no worker takes it yet: it sits queued
    callback = publisher.tasks["testproject.demo.tasks.apply_effect"].si("lost-cb", "applied")
    result = publisher.tasks[PROBE].apply_async(
        kwargs={"marker": "parent"}, queue=start_worker.queue, link=callback.set(queue=later)
    )
    assert finished(lease_db, result.id) == "SUCCESS"
    wait_for(lambda: queued(broker, later) == 1, 30, "the callback to be queued")
    (row,) = PendingJob.objects.using(lease_db).all()  # sent, not started: it stands
    assert row.task_name == "testproject.demo.tasks.apply_effect"
    lose_queued(broker, [later])  # the callback's message is gone
    assert [o.action for o in resend_pending(publisher)] == []  # not due yet
    PendingJob.objects.using(lease_db).update(resend_at=row.published_at)
    assert [o.action for o in resend_pending(publisher)] == ["resent"]
    worker = Worker("b", database=lease_db, queue=later, log_dir=tmp_path)
    try:
        worker.wait_ready()
        entries = LedgerEntry.objects.using(lease_db).filter(job="lost-cb")
        wait_for(lambda: entries.count() == 1, 90, "the callback to run")
        rows = PendingJob.objects.using(lease_db)
        wait_for(lambda: not rows.exists(), 30, "the callback's row to end")
        assert resend_pending(publisher) == []
        assert entries.count() == 1
    finally:
        worker.stop()


@pytest.mark.parametrize("alias", ["postgres"])
def test_plain_chord_member_expired_in_a_backlog__the_chord_body_still_settles(
    lease_db: str, start_worker: Any, publisher: Any, tmp_path: Any
) -> None:
    """A fenced job's chain sends on a chord of plain tasks; one member expires in a
    backlog no worker takes yet: the reclaimer records its REVOKED, then a worker reaches
    the message and discards it — counted once, so the chord body is settled, not lost."""
    from devtools.workers import Worker

    start_worker("a")
    later = f"{start_worker.queue}-later"  # a backlog: no worker reaches it yet
    effect = publisher.tasks[EFFECT]
    result_expiry = [time.time() + 3.5]
    header = [
        effect.si("member-a", "A").set(queue=later, expires=3),
        effect.si("member-b", "B").set(queue=later),
        effect.si("member-c", "C").set(queue=start_worker.queue),
    ]
    body = effect.si("body", "BODY").set(queue=start_worker.queue)
    result = chain(
        publisher.tasks[PROBE].si(marker="parent").set(queue=start_worker.queue),
        chord(header, body),
    ).apply_async()
    results = TaskResult.objects.using(lease_db)
    wait_for(
        lambda: results.filter(task_name=EFFECT, status="SUCCESS").count() == 1, 90, "member c"
    )
    assert PendingJob.objects.using(lease_db).filter(plain=True).count() == 2  # a and b
    wait_for(
        lambda: time.time() > result_expiry[0], 30, "member a's expires to pass in the backlog"
    )
    # ... and fenced_outbox_resend_after too: the reclaimer records its REVOKED
    PendingJob.objects.using(lease_db).filter(expires_at__isnull=False).update(
        expires_at=timezone.now() - dt.timedelta(hours=1)
    )
    assert [o.action for o in resend_pending(publisher)] == ["revoked"]
    worker = Worker("b", database=lease_db, queue=later, log_dir=tmp_path)
    try:
        worker.wait_ready()
        wait_for(
            lambda: results.filter(task_name=EFFECT, status="SUCCESS").count() == 2,
            90,
            "member b",
        )
        deadline = time.monotonic() + 60  # the body's outcome follows member b's
        while time.monotonic() < deadline and not results.filter(task_id=result.id).exists():
            time.sleep(0.1)
        counters = list(ChordCounter.objects.using(lease_db).values_list("count", flat=True))
        body_state = results.filter(task_id=result.id).values_list("status", flat=True).first()
        # every member is final (a REVOKED, b and c SUCCESS): as without the sweep, the
        # body is failed with a ChordError (or run) — never left PENDING for ever
        assert body_state in ("SUCCESS", "FAILURE"), (
            f"chord body {result.id}: state {body_state}, chord counters {counters}\n"
            + "\n".join(
                line
                for line in worker.output().splitlines()
                if "Discarding" in line or "ChordCounter" in line or "succeeded" in line
            )
        )
    finally:
        worker.stop()


@pytest.mark.parametrize("alias", ["postgres"])
def test_until_done__copies_while_it_runs_queue_nothing_then_a_new_call_queues(
    lease_db: str, start_worker: Any, publisher: Any, tmp_path: Any
) -> None:
    """``lease_unique="until_done"`` across real workers: five calls while the job runs
    return its id and queue nothing; once it has finished, a call queues a new copy."""
    start_worker("a")
    start_worker("b")
    digest = publisher.tasks["testproject.demo.tasks.send_digest"]
    done = tmp_path / "done"
    first = digest.apply_async(("weekly",), {"until_file": str(done)}, queue=start_worker.queue)
    wait_for(
        lambda: (
            Lease.objects.using(lease_db)
            .filter(key="digest:weekly", task_id=first.id, released_at__isnull=True)
            .exists()
        ),
        60,
        "the first copy's grant",
    )
    copies = [
        digest.apply_async(("weekly",), {"until_file": str(done)}, queue=start_worker.queue).id
        for _ in range(5)
    ]
    assert copies == [first.id] * 5
    assert list(PendingJob.objects.using(lease_db).values_list("task_id", flat=True)) == [first.id]
    done.touch()
    assert finished(lease_db, first.id) == "SUCCESS"
    again = digest.apply_async(("weekly",), queue=start_worker.queue)
    assert again.id != first.id
    assert finished(lease_db, again.id) == "SUCCESS"
    results = TaskResult.objects.using(lease_db).filter(task_name__endswith="send_digest")
    assert results.count() == 2
    lease = Lease.objects.using(lease_db).get(key="digest:weekly")
    assert lease.events.filter(kind="deduplicated").count() == 5


@pytest.mark.parametrize("serializer", ["json", "pickle"])
@pytest.mark.parametrize("alias", ["postgres"])
def test_until_done__a_job_with_a_tuple_argument_ends_and_the_next_call_queues(
    lease_db: str, start_worker: Any, publisher: Any, serializer: str
) -> None:
    """The key a ``lease_unique`` job runs under is the one its outbox row was recorded
    with, whatever shape its arguments take in the message: once it has run, the same
    call queues a new job (it was refused forever when the worker worked out the key
    again from the decoded arguments: ``batch:[1, 2]`` instead of ``batch:(1, 2)``)."""
    # (Celery refuses to take pickled messages as root unless told to)
    start_worker("a", env={"FENCED_ACCEPT_PICKLE": "1", "C_FORCE_ROOT": "1"})
    batch = publisher.tasks["testproject.demo.tasks.sum_batch"]
    publisher.conf.accept_content = ["json", "pickle"]
    calls = [((1, 2),), ({1: 1, 2: 2},), ((3, 4),)]
    for args in calls:
        first = batch.apply_async(args, serializer=serializer, queue=start_worker.queue)
        recorded = PendingJob.objects.using(lease_db).get(task_id=first.id).key
        status, value = result_of(lease_db, first.id, 90)
        assert (status, value["key"]) == ("SUCCESS", recorded)
        assert Lease.objects.using(lease_db).get(task_id=first.id).key == recorded
        again = batch.apply_async(args, serializer=serializer, queue=start_worker.queue)
        assert again.id != first.id  # the key was not left blocked
        assert result_of(lease_db, again.id, 90)[1]["key"] == recorded
    assert not LeaseEvent.objects.using(lease_db).filter(kind="deduplicated").exists()


@pytest.mark.parametrize("alias", ["postgres"])
def test_replace_with_the_same_signature__every_poll_runs_and_the_chain_goes_on(
    lease_db: str, start_worker: Any, publisher: Any
) -> None:
    """A fenced task that replaces itself with its own signature (the same task id, name
    and arguments): each replacement runs — it was skipped as a completed duplicate of
    the task it replaced, and the job never ended — and the chain's next step runs once."""
    start_worker("a")
    start_worker("b")
    poll = publisher.tasks["testproject.demo.tasks.poll"]
    effect = publisher.tasks[EFFECT]
    result = chain(
        poll.si("replaced", 3).set(queue=start_worker.queue),
        effect.si("replaced", "after the polls").set(queue=start_worker.queue),
    ).apply_async()
    assert finished(lease_db, result.id) == "SUCCESS"
    assert result_of(lease_db, result.parent.id)[1] == {"label": "replaced", "polls": 3}
    effects = LedgerEntry.objects.using(lease_db).filter(job="replaced")
    assert sorted(effects.values_list("effect", flat=True)) == [
        "after the polls",
        "poll 1",
        "poll 2",
        "poll 3",
    ]
    assert not LeaseEvent.objects.using(lease_db).filter(kind="duplicate").exists()


@pytest.mark.parametrize("alias", ["postgres"])
def test_group_and_chord_of_fenced_jobs__joined_and_restored_by_the_apps_result_classes(
    lease_db: str, start_worker: Any, publisher: Any
) -> None:
    """The app's result classes (refusing to wait for an unsent job) are Celery's for
    everything else: a group saved and restored through the fenced backend, a chord whose
    header the backend counts and whose body it sends, each waited for after the commit."""
    from celery import group
    from celery.result import AsyncResult, GroupResult

    start_worker("a", concurrency=2)
    probe, effect = publisher.tasks[PROBE], publisher.tasks[EFFECT]
    queue = start_worker.queue
    with transaction.atomic(using=lease_db):
        grouped = group(probe.si(marker=f"g{n}").set(queue=queue) for n in range(3)).apply_async()
        grouped.save()
        chorded = chord(
            [probe.si(marker=f"h{n}").set(queue=queue) for n in range(3)],
            effect.si("chord-body", "BODY").set(queue=queue),
        ).apply_async()
        for waited in (grouped, chorded, chorded.parent):
            with pytest.raises(UncommittedJob):
                waited.get(timeout=30)
    restored = publisher.GroupResult.restore(grouped.id)
    assert isinstance(restored, GroupResult)
    assert restored.id == grouped.id
    assert all(isinstance(member, AsyncResult) for member in restored.results)
    assert [value["marker"] for value in restored.join(timeout=90)] == ["g0", "g1", "g2"]
    assert [value["marker"] for value in grouped.get(timeout=90)] == ["g0", "g1", "g2"]
    assert chorded.get(timeout=90)["token"] == 0  # the plain body, run once
    assert [value["marker"] for value in chorded.parent.get(timeout=90)] == ["h0", "h1", "h2"]
    assert LedgerEntry.objects.using(lease_db).filter(job="chord-body").count() == 1
    assert not ChordCounter.objects.using(lease_db).exists()
