"""FencedTask and config-enabled tasks with real `celery worker` processes on Redis."""

from __future__ import annotations

import json
import os
import signal
import uuid
from typing import Any

import pytest
from django_celery_results.models import TaskResult

from celery_fenced.models import Lease, LeaseEvent
from devtools.workers import broker_app, send, sender, wait_for
from tests.conftest import WITH_MARIADB

pytestmark = [
    pytest.mark.django_db(transaction=True, databases=WITH_MARIADB),
    pytest.mark.workers,
    pytest.mark.timeout(180),
]


@pytest.fixture
def alias(alias_with_mariadb: str) -> str:
    """SQLite, PostgreSQL and MariaDB. A test marked ``parametrize("alias", ["postgres"])``
    runs on PostgreSQL alone: what it shows is the workers' and the broker's, while the
    SQL under it runs on all three in the integration layer."""
    return alias_with_mariadb


PROBE = "testproject.demo.tasks.probe"
EFFECT = "testproject.demo.tasks.apply_effect"
DESCEND = "testproject.demo.tasks.descend"


def result_of(alias: str, task_id: str, timeout: float = 60) -> Any:
    row = wait_for(
        lambda: (
            TaskResult.objects.using(alias)
            .filter(task_id=task_id, status__in=["SUCCESS", "FAILURE"])
            .first()
        ),
        timeout,
        f"task {task_id} to finish",
    )
    return row.status, json.loads(row.result)


@pytest.mark.core
def test_fenced_task__runs_with_token_and_key_and_releases(alias: str, start_worker: Any) -> None:
    start_worker("a")
    task_id = send(PROBE, queue=start_worker.queue, kwargs={"marker": "m"})
    status, value = result_of(alias, task_id)
    assert status == "SUCCESS"
    assert value["token"] == 1
    assert value["current_token"] == 1
    assert value["key"].startswith(PROBE + ":")
    assert value["lost"] is False
    lease = Lease.objects.using(alias).get(key=value["key"])
    assert (lease.released_at is not None, lease.release_state) == (True, "SUCCESS")
    # a routine grant and release: on the lease row, no event (fenced_events="anomalies")
    assert not LeaseEvent.objects.using(alias).filter(lease=lease).exists()


def test_fenced_task__forged_token_header_is_ignored(alias: str, start_worker: Any) -> None:
    start_worker("a")
    task_id = send(
        PROBE,
        queue=start_worker.queue,
        kwargs={"marker": "forged"},
        headers={"fencing_token": 999, "lease_key": "forged"},
    )
    status, value = result_of(alias, task_id)
    assert status == "SUCCESS"
    assert value["token"] == 1
    assert value["key"] != "forged"
    assert not Lease.objects.using(alias).filter(key="forged").exists()


@pytest.mark.parametrize("mode", ["base_class", "config"])
@pytest.mark.parametrize("alias", ["postgres"])
def test_pause_past_ttl__holder_learns_lost_and_next_grant_is_token_plus_one(
    alias: str, start_worker: Any, mode: str
) -> None:
    ttl = 2
    env = {"FENCED_TASKS_JSON": json.dumps({EFFECT: {"ttl": ttl, "key": "job:{job}"}})}
    worker = start_worker("a", env=env)
    if mode == "base_class":
        task_id = send(PROBE, queue=start_worker.queue, kwargs={"seconds": 4})
        key_filter: dict[str, Any] = {"key__startswith": PROBE}
    else:
        task_id = send(EFFECT, queue=start_worker.queue, args=("j1", "e1", 4))
        key_filter = {"key": "job:j1"}
    wait_for(lambda: Lease.objects.using(alias).filter(**key_filter).exists(), 30, "the grant")
    worker.pause()
    lease = Lease.objects.using(alias).get(**key_filter)
    # the grant expires by the database's clock while the worker is stopped
    from celery_fenced import acquire

    if mode == "base_class":
        Lease.objects.using(alias).filter(pk=lease.pk).update(
            expires_at=lease.acquired_at
        )  # probe's ttl is 30s: expire it rather than wait
    taker = wait_for(
        lambda: _try_acquire(acquire, lease.key, alias), ttl + 30, "the grant to expire"
    )
    assert taker.token == lease.token + 1
    worker.resume()
    if mode == "base_class":
        status, value = result_of(alias, task_id)
        # the body saw the loss; its result write was refused and stored as StaleToken
        assert status == "FAILURE"
        assert value["exc_type"] == "StaleToken"
    else:
        wait_for(
            lambda: (
                LeaseEvent.objects.using(alias)
                .filter(lease__key="job:j1", kind="stale_write_rejected")
                .exists()
            ),
            30,
            "the stale write to be rejected",
        )
        from testproject.demo.models import LedgerEntry

        assert not LedgerEntry.objects.using(alias).filter(job="j1").exists()
    assert (
        LeaseEvent.objects.using(alias)
        .filter(lease__key=lease.key, kind="lost", token=lease.token)
        .exists()
    )
    assert taker.release()


def test_pause_past_ttl__lost_event_says_what_is_known_not_a_database_outage(
    alias: str, start_worker: Any
) -> None:
    """A worker stopped (SIGSTOP) past its ttl while the database is up: its ``lost``
    event says no renewal reached the database before the grant expired, and blames no
    database: no renewal attempt failed."""
    from celery_fenced import store
    from celery_fenced.store.dialects import for_alias

    env = {"FENCED_TASKS_JSON": json.dumps({EFFECT: {"ttl": 2, "key": "job:{job}"}})}
    worker = start_worker("a", env=env)
    # still sleeping long after the resume: the renewer, not the body, finds the loss
    send(EFFECT, queue=start_worker.queue, args=("paused", "e1", 12))
    lease = wait_for(
        lambda: Lease.objects.using(alias).filter(key="job:paused").first(), 30, "the grant"
    )
    row = Lease.objects.using(alias).filter(pk=lease.pk)
    worker.pause()
    try:
        wait_for(
            lambda: for_alias(alias).now() > row.get().expires_at,
            30,
            "the grant to expire by the database's clock",
        )
    finally:
        worker.resume()
    lost = wait_for(
        lambda: (
            LeaseEvent.objects.using(alias)
            .filter(lease__key="job:paused", kind="lost", token=lease.token)
            .first()
        ),
        30,
        "the lost event",
    )
    reason = lost.detail["reason"]
    assert reason == store.unrenewed(None)
    assert "no renewal reached the database before the grant expired" in reason
    assert "paused, overloaded or cut off" in reason
    assert "unreachable" not in reason
    assert "failed with" not in reason
    assert f"lease 'job:paused' lost under token {lease.token}: {reason}" in worker.output()


@pytest.mark.parametrize("mode", ["base_class", "config"])
@pytest.mark.parametrize("alias", ["postgres"])
def test_fenced_out_run__one_warning_and_no_error_or_traceback(
    alias: str, start_worker: Any, mode: str
) -> None:
    """Stopped past its ttl, its key taken over, the run wakes and writes: the write is
    refused as designed. That is one WARNING naming key and tokens, and Celery's line
    at INFO ("raised expected"), with no ERROR and no traceback; its FAILURE is stored
    with StaleToken (another job holds the key)."""
    from celery_fenced import acquire
    from testproject.demo.models import Report

    env = {"FENCED_TASKS_JSON": json.dumps({EFFECT: {"ttl": 2, "key": "job:{job}"}})}
    worker = start_worker("a", env=env)
    if mode == "base_class":
        report = Report.objects.using(alias).create(name="fenced out")
        key = f"report:{report.pk}"
        task = "testproject.demo.tasks.rebuild_report_short"
        task_id = send(task, queue=start_worker.queue, args=(report.pk,), kwargs={"seconds": 4})
    else:
        key, task = "job:out", EFFECT
        task_id = send(EFFECT, queue=start_worker.queue, args=("out", "e1", 4))
    lease = wait_for(lambda: Lease.objects.using(alias).filter(key=key).first(), 30, "grant")
    worker.pause()
    try:
        taker = wait_for(lambda: _try_acquire(acquire, key, alias), 30, "the grant to expire")
    finally:
        worker.resume()
    status, value = result_of(alias, task_id)
    assert (status, value["exc_type"]) == ("FAILURE", "StaleToken")
    stale, current = lease.token, taker.token
    assert current == stale + 1
    wait_for(lambda: f"Task {task}[{task_id}] raised" in worker.output(), 30, "its end")
    assert f"Task {task}[{task_id}] raised expected: StaleToken(" in worker.output()
    lines = worker.output().splitlines()
    refusals = [
        line
        for line in lines
        if "WARNING" in line
        and repr(key) in line
        and f"token {stale}" in line
        and f"current token {current}" in line
    ]
    assert len(refusals) == 1, "\n".join(lines)
    # what was refused: the body's write (its FAILURE's refusal follows at INFO)
    refused = "stale update of demo.Report" if mode == "base_class" else "stale write"
    assert f"{refused} rejected for {key!r}" in refusals[0]
    assert not [line for line in lines if "ERROR" in line or "CRITICAL" in line]
    assert "Traceback" not in worker.output()
    assert taker.release()


def _try_acquire(acquire: Any, key: str, alias: str) -> Any:
    from celery_fenced import LeaseBusy

    try:
        return acquire(key, ttl=300, owner="test-taker", using=alias)
    except LeaseBusy:
        return None


@pytest.mark.parametrize("policy", ["retry", "skip", "fail"])
@pytest.mark.parametrize("alias", ["postgres"])
def test_busy_policy__second_delivery_of_a_held_key(
    alias: str, start_worker: Any, policy: str
) -> None:
    env = {
        "FENCED_TASKS_JSON": json.dumps(
            {EFFECT: {"ttl": 5, "key": "job:{job}", "on_busy": policy}}
        )
    }
    start_worker("a", concurrency=2, pool="threads", env=env)
    first = send(EFFECT, queue=start_worker.queue, args=("j", "first", 4))  # held while
    # the second arrives: the worker's other thread takes it at once
    wait_for(lambda: Lease.objects.using(alias).filter(key="job:j").exists(), 30, "grant")
    second = send(EFFECT, queue=start_worker.queue, args=("j", "second", 0))
    assert result_of(alias, first)[0] == "SUCCESS"
    events = LeaseEvent.objects.using(alias).filter(lease__key="job:j")
    wait_for(lambda: events.filter(kind="busy").exists(), 30, "the busy event")
    if policy == "retry":
        status, _ = result_of(alias, second)
        assert status == "SUCCESS"
        assert Lease.objects.using(alias).get(key="job:j").token == 2
    elif policy == "fail":
        status, value = result_of(alias, second)
        assert (status, value["exc_type"]) == ("FAILURE", "LeaseBusy")
    else:
        assert (
            not TaskResult.objects.using(alias).filter(task_id=second, status="SUCCESS").exists()
        )
        assert Lease.objects.using(alias).get(key="job:j").token == 1


@pytest.mark.parametrize("alias", ["postgres"])
def test_body_calling_its_own_task__taken_over_its_success_is_refused(
    alias: str, start_worker: Any
) -> None:
    """A body calls its own task directly (on other arguments), then its own grant is
    taken over: the worker refuses its success, as any stale execution's, instead of
    proving it under the call's grant; the call's grant is released at its end."""
    start_worker("a")
    task_id = send(DESCEND, queue=start_worker.queue, args=(1,), kwargs={"take_over": True})
    status, value = result_of(alias, task_id)
    assert status == "FAILURE", value
    row = TaskResult.objects.using(alias).get(task_id=task_id)
    assert json.loads(row.meta)["stale_fencing_token"] == 1
    assert Lease.objects.using(alias).get(key="descend:1").token == 2  # the other holder's
    assert Lease.objects.using(alias).get(key="descend:0").released_at is not None


@pytest.mark.parametrize("alias", ["postgres"])
def test_warm_shutdown__finishes_and_releases(alias: str, start_worker: Any) -> None:
    worker = start_worker("a")
    task_id = send(PROBE, queue=start_worker.queue, kwargs={"seconds": 2})
    wait_for(lambda: Lease.objects.using(alias).exists(), 30, "the grant")
    assert worker.warm_shutdown() == 0
    status, _ = result_of(alias, task_id, timeout=5)
    assert status == "SUCCESS"
    assert Lease.objects.using(alias).get().released_at is not None


def test_sigkill__lease_expires_and_next_grant_is_token_plus_one(
    alias: str, start_worker: Any
) -> None:
    env = {"FENCED_TASKS_JSON": json.dumps({EFFECT: {"ttl": 2, "key": "job:{job}"}})}
    worker = start_worker("a", env=env)
    send(EFFECT, queue=start_worker.queue, args=("k", "e", 30))
    wait_for(lambda: Lease.objects.using(alias).filter(key="job:k").exists(), 30, "grant")
    worker.signal_group(signal.SIGKILL)
    worker.process.wait(timeout=30)
    from celery_fenced import acquire

    taker = wait_for(lambda: _try_acquire(acquire, "job:k", alias), 20, "expiry")
    assert taker.token == 2
    assert Lease.objects.using(alias).get(key="job:k").reclaimed_from.startswith("a-")


@pytest.mark.parametrize("alias", ["postgres"])
def test_completed_duplicate__redelivered_message_does_not_run_again(
    alias: str, start_worker: Any, redelivery_after: Any
) -> None:
    """A's pool child completes the job while A's main process is stopped and cannot ack:
    the broker redelivers the message to B (Redis's visibility timeout, RabbitMQ's
    consumer_timeout), which must not run the body a second time."""
    redelivery = redelivery_after(3)
    worker_a = start_worker("a", env=redelivery)
    # long enough that the SIGSTOP below lands before the child ends it (and A acks)
    task_id = send(PROBE, queue=start_worker.queue, kwargs={"seconds": 4})
    wait_for(lambda: Lease.objects.using(alias).exists(), 30, "the grant")
    import os

    os.kill(worker_a.process.pid, signal.SIGSTOP)  # the main process only: no ack
    status, value = result_of(alias, task_id)
    assert status == "SUCCESS"
    start_worker("b", env=redelivery)
    events = LeaseEvent.objects.using(alias).filter(task_id=task_id)
    wait_for(lambda: events.filter(kind="duplicate").exists(), 60, "the duplicate event")
    os.kill(worker_a.process.pid, signal.SIGCONT)
    assert Lease.objects.using(alias).get(key=value["key"]).token == 1  # granted once
    assert TaskResult.objects.using(alias).get(task_id=task_id).status == "SUCCESS"


@pytest.mark.parametrize(
    ("tasks_json", "message"),
    [
        ({EFFECT: {"ttl": 0}}, "ttl must be a number of seconds greater than 0"),
        ({EFFECT: {"on_busy": "sometimes"}}, "on_busy must be one of"),
        ({EFFECT: {"ttl": 3, "renew_interval": 5}}, "must be shorter than the lease ttl"),
        ({EFFECT: {"colour": "red"}}, "unknown option(s) 'colour'"),
    ],
)
@pytest.mark.parametrize("alias", ["postgres"])
def test_worker_start__invalid_settings_stop_the_worker_naming_them(
    alias: str, tmp_path: Any, tasks_json: dict[str, Any], message: str
) -> None:
    from devtools.workers import Worker

    worker = Worker(
        "bad",
        database=alias,
        queue="q-bad",
        log_dir=tmp_path,
        env={"FENCED_TASKS_JSON": json.dumps(tasks_json)},
    )
    try:
        code = worker.process.wait(timeout=60)
        assert code != 0
        assert message in worker.output()
        assert "fenced_tasks" in worker.output()
    finally:
        worker.stop()


def test_threads_pool__each_execution_sees_its_own_lease(alias: str, start_worker: Any) -> None:
    start_worker("a", pool="threads", concurrency=2, env={"FENCED_EVENTS": "all"})
    ids = [
        send(PROBE, queue=start_worker.queue, kwargs={"seconds": 3, "marker": m})
        for m in ("x", "y")
    ]
    values = [result_of(alias, task_id)[1] for task_id in ids]
    assert {v["marker"] for v in values} == {"x", "y"}
    for value in values:
        assert value["current_token"] == value["token"] == 1
        assert value["lost"] is False
    assert values[0]["key"] != values[1]["key"]
    # both ran at once: each grant was acquired before the other was released
    grants = {e.lease_id: e.at for e in LeaseEvent.objects.using(alias).filter(kind="acquired")}
    releases = {e.lease_id: e.at for e in LeaseEvent.objects.using(alias).filter(kind="released")}
    assert max(grants.values()) < min(releases.values())


def test_pause_past_ttl_without_successor__job_retried_and_completes(
    alias: str, start_worker: Any
) -> None:
    """Nobody took over while the holder was stopped: on waking, its write is refused
    and the job is retried under the same task id with the next token."""
    from testproject.demo.models import Report

    report = Report.objects.using(alias).create(name="solo")
    worker = start_worker("a")
    task_id = send(
        "testproject.demo.tasks.rebuild_report_short",
        queue=start_worker.queue,
        args=(report.pk,),
        kwargs={"seconds": 2},
    )
    key = f"report:{report.pk}"
    first = wait_for(lambda: Lease.objects.using(alias).filter(key=key).first(), 30, "grant")
    worker.pause()
    from celery_fenced.store.dialects import for_alias

    wait_for(
        lambda: for_alias(alias).now() > Lease.objects.using(alias).get(key=key).expires_at,
        30,
        "the grant to expire by the database's clock",
    )
    worker.resume()
    status, value = result_of(alias, task_id)
    assert status == "SUCCESS"
    assert value["token"] == first.token + 1
    assert Report.objects.using(alias).get(pk=report.pk).fencing_token == first.token + 1
    kinds = [
        (e.kind, e.token)
        for e in LeaseEvent.objects.using(alias).filter(lease__key=key).order_by("id")
    ]
    assert ("reclaimed", first.token + 1) in kinds
    lease = Lease.objects.using(alias).get(key=key)
    assert (lease.token, lease.release_state) == (first.token + 1, "SUCCESS")


@pytest.mark.parametrize(
    ("ending", "task"),
    [
        ("revoke_terminate", PROBE),
        ("hard_time_limit", PROBE),
        # a task of the base class with a worker request class of its own
        ("hard_time_limit", PROBE + "_own_request"),
    ],
)
@pytest.mark.parametrize("alias", ["postgres"])
def test_execution_ended_by_the_worker__grant_released_at_once(
    alias: str, start_worker: Any, ending: str, task: str
) -> None:
    """The main process ends the execution (revoke --terminate, a hard time limit): the
    grant is force-released then, not left to run out its 30 s ttl."""
    start_worker("a", env={"FENCED_EVENTS": "all"})  # the end is an event, whoever ended it
    options = {"time_limit": 1} if ending == "hard_time_limit" else {}
    task_id = send(task, queue=start_worker.queue, kwargs={"seconds": 20}, **options)
    lease = wait_for(lambda: Lease.objects.using(alias).first(), 30, "the grant")
    if ending == "revoke_terminate":
        sender().control.revoke(task_id, terminate=True)  # broadcast on the test's broker
    released = wait_for(
        lambda: Lease.objects.using(alias).filter(pk=lease.pk, released_at__isnull=False).first(),
        60,
        "the grant to be released",
    )
    assert released.released_at < lease.expires_at
    # ended by the executing process (SIGTERM unwinds it) or, if it could not, by the
    # main process's REVOKED / TimeLimitExceeded write
    ends = LeaseEvent.objects.using(alias).filter(
        kind__in=["released", "force_released"], token=lease.token
    )
    assert ends.count() == 1
    end = ends.get()
    if end.kind == "force_released":
        assert end.detail["by"].startswith("worker:")
    if ending == "hard_time_limit":  # and the job's outcome is recorded
        row = wait_for(
            lambda: TaskResult.objects.using(alias).filter(task_id=task_id).first(),
            60,
            "the job's result",
        )
        assert (row.status, "TimeLimitExceeded" in row.result) == ("FAILURE", True)


@pytest.mark.broker("redis")
# the workers' identities, not the database, are under test: PostgreSQL alone (32 s a run)
@pytest.mark.parametrize("alias", ["postgres"])
def test_two_workers_of_one_node_name__a_report_by_the_others_pid_ends_no_grant(
    alias: str, start_worker: Any
) -> None:
    """Two workers started alike, with one node name (``-n twin@%h``, as on two machines
    or in two containers started from one image). B's pool process holds a job's grant;
    A's main process reports the end of a pool process of that very pid (what two
    machines' workers may both have; here A's report names B's pid): B's grant is not
    A's process's. It stays, and B's execution completes the job under its token."""
    name = f"twin-{uuid.uuid4().hex[:6]}@%h"
    b = start_worker("b", hostname=name)
    # A on a broker of its own (another Redis database): its remote control reaches it
    # alone, where B's would share its node name's queue
    elsewhere = os.environ["FENCED_REDIS_URL"].rsplit("/", 1)[0] + "/1"
    start_worker(
        "a",
        hostname=name,
        env={"FENCED_BROKER_URL": elsewhere},
        extra_args=["--include", "testproject.demo.report_control"],
    )
    task_id = send(PROBE, queue=start_worker.queue, kwargs={"seconds": 6})
    lease = wait_for(
        lambda: Lease.objects.using(alias).filter(task_id=task_id).first(), 30, "B's grant"
    )
    pid = int(lease.owner.split(":")[-2])  # "<node name>:<boot id>:<pid>:<thread>"
    assert pid != b.process.pid  # a pool process's
    control = broker_app(elsewhere)
    try:
        replies = control.control.broadcast(
            "report_hard_time_limit",
            arguments={"task_id": task_id, "task_name": PROBE, "pid": pid},
            reply=True,
            timeout=30,
        )
    finally:
        control.close()
    status, value = result_of(alias, task_id)
    assert status == "SUCCESS"
    assert (value["token"], value["lost"]) == (1, False)
    row = Lease.objects.using(alias).get(pk=lease.pk)
    assert (row.token, row.release_state) == (1, "SUCCESS")
    assert not LeaseEvent.objects.using(alias).filter(kind="force_released").exists()
    # A's report named pool process ``pid`` of A's start: same node name, another boot id
    host, boot, _pid, _thread = lease.owner.rsplit(":", 3)
    ((reporter, reply),) = [item for r in replies for item in r.items()]
    assert reporter == host
    prefix = reply["ok"]
    assert prefix.startswith(f"{host}:")
    assert prefix.endswith(f":{pid}:")
    assert prefix != f"{host}:{boot}:{pid}:"


# Redis's visibility timeout redelivers the held countdown messages; RabbitMQ's
# consumer_timeout would close the channel instead, and Celery stops the worker on that
# (test_rabbitmq_workers.py has RabbitMQ's redeliveries)
@pytest.mark.broker("redis")
@pytest.mark.parametrize("alias", ["postgres"])
def test_jobs_queued_on_one_key__each_body_runs_once_through_busy_retries_and_redelivery(
    alias: str, start_worker: Any, redelivery_after: Any
) -> None:
    """Ten jobs on one key; each waits with busy retries counted down past Redis's
    visibility timeout, so Redis also redelivers the retry messages. The package's
    re-sends keep the retry count, so every copy of a completed job is a duplicate: each
    body runs exactly once."""
    from testproject.demo.models import LedgerEntry

    env = {
        "FENCED_TASKS_JSON": json.dumps({EFFECT: {"ttl": 5, "key": "one-key"}}),
        **redelivery_after(4),
    }
    start_worker("a", env=env, concurrency=2)
    start_worker("b", env=env, concurrency=2)
    task_ids = [
        send(EFFECT, queue=start_worker.queue, args=(f"q{n}", "e", 0.3)) for n in range(10)
    ]
    for task_id in task_ids:
        status, _ = result_of(alias, task_id, timeout=150)
        assert status == "SUCCESS"
    runs = {
        job: LedgerEntry.objects.using(alias).filter(job=job).count()
        for job in (f"q{n}" for n in range(10))
    }
    assert runs == {f"q{n}": 1 for n in range(10)}
    assert LeaseEvent.objects.using(alias).filter(lease__key="one-key", kind="busy").exists()
