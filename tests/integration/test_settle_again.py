"""An outcome settled again: its attempt lost with the database (a restart, a failover,
a COMMIT whose answer never came) and tried again, through Celery's own tracer, on
SQLite and PostgreSQL. What the outcome drives happens once; a stale attempt's nothing.

The database "restart" is a real terminated session on PostgreSQL where the test says so,
an OperationalError raised at the statement otherwise; a COMMIT whose answer is lost is
a real commit followed by an OperationalError (Django then rolls back nothing and drops
the on-commit hooks, as when the connection dies after the server committed).
"""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
from celery import chain, chord
from django.db import OperationalError, connections
from django.utils import timezone

from celery_fenced.models import LeaseEvent, PendingJob
from tests.conftest import WITH_MARIADB, terminate_connection
from tests.integration.test_seams import (
    RUNS,
    Broker,
    Execution,
    deliver,
    expire,
    granted,
    status,
)

pytestmark = [
    pytest.mark.django_db(transaction=True, databases=WITH_MARIADB),
    pytest.mark.timeout(120),
]


def _pickle(app: Any) -> None:
    """A project on the pickle serializer: arguments JSON cannot carry are legal."""
    app.conf.task_serializer = "pickle"
    app.conf.accept_content = ["pickle", "json"]


def _restart(lease_db: str) -> None:
    if lease_db == "postgres":
        terminate_connection(lease_db)  # the next statement meets a closed session
    else:
        raise OperationalError("the database system is shutting down")


def _step_then_sink(broker: Broker, value: str, link: bool) -> tuple[dict[str, Any], Any]:
    """``seams.step(value)`` whose success sends ``seams.sink`` on — its chain's next step,
    or its ``link`` callback: the step's message."""
    app = broker.app
    step = app.signature("seams.step", (value,))
    if link:
        step.apply_async(link=app.signature("seams.sink"))
    else:
        chain(step, app.signature("seams.sink")).apply_async()
    return broker.one("seams.step")


def _fail_result_row_once(monkeypatch: pytest.MonkeyPatch, lease_db: str) -> list[str]:
    """The database restarts as the proven success writes its result row (after its
    successors were sent or recorded, in the same transaction)."""
    from celery_fenced.backends import FencedDatabaseBackend

    original = FencedDatabaseBackend._write_row
    restarted: list[str] = []

    def write_row(self: Any, task_id: str, *args: Any, **kwargs: Any) -> Any:
        if not restarted and threading.current_thread().name in ("MainThread", "A"):
            restarted.append(task_id)
            _restart(lease_db)
        return original(self, task_id, *args, **kwargs)

    monkeypatch.setattr(FencedDatabaseBackend, "_write_row", write_row)
    return restarted


def _started(broker: Broker, lease_db: str, name: str) -> None:
    """Workers start what was sent of ``name`` (plain jobs the outbox holds until then):
    nothing is left in the outbox."""
    for message in broker.sent(name):
        deliver(broker.app, message)
    assert not PendingJob.objects.using(lease_db).exists()


# -- the successors a lost attempt recorded are recorded again
@pytest.mark.parametrize("link", [False, True], ids=["chain step", "link callback"])
def test_database_restart_while_successors_are_recorded__settled_again_sends_them_once(
    broker: Broker, lease_db: str, link: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The database restarts while the current execution's success is settled, after its
    proof and as its next chain step (or link callback) is recorded in the proof's
    transaction: that transaction is gone, and the outcome is settled again once the
    database is back. The successor must be recorded and sent by that second attempt —
    once (the long chaos run lost a chain's next step: the first attempt had used it up)."""
    from celery_fenced import store

    app = broker.app
    message = _step_then_sink(broker, "r", link)
    record = store.record_pending
    restarted: list[str] = []

    def restart_once(alias: str, pending: Any) -> Any:
        if pending.task_name == "seams.sink" and not restarted:
            restarted.append(pending.task_id)
            _restart(lease_db)  # the statement meets a closed session
        return record(alias, pending)

    monkeypatch.setattr(store, "record_pending", restart_once)
    deliver(app, message)
    assert restarted, "the successor was never recorded"
    assert status(lease_db, message[0]["id"]) == ("SUCCESS", '"r@1"')
    (sink,) = broker.sent("seams.sink")
    assert list(sink[1][0]) == ["r@1"]
    rows = PendingJob.objects.using(lease_db)
    assert list(rows.values_list("task_id", flat=True)) == [sink[0]["id"]]  # recorded once
    deliver(app, sink)
    assert not rows.exists()  # started: its outbox row ended


# -- a successor the outbox cannot record is sent once per attempt -------------
def test_unrecordable_successor__database_restart__chain_step_sent_once(
    broker: Broker, lease_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chain's next step carries an argument JSON cannot carry (the project uses
    pickle): the outbox cannot record it, so it is sent when the settling transaction
    commits. That transaction is lost with the database and the success is settled
    again: the step is sent once, by the attempt that committed."""
    app = broker.app
    _pickle(app)
    chain(
        app.signature("seams.step", ("r",)), app.signature("seams.sink", ({1, 2},))
    ).apply_async()
    message = broker.one("seams.step")
    restarted = _fail_result_row_once(monkeypatch, lease_db)
    deliver(app, message)
    assert restarted
    assert status(lease_db, message[0]["id"]) == ("SUCCESS", '"r@1"')
    assert [list(body[0]) for _, body in broker.sent("seams.sink")] == [["r@1", {1, 2}]]


def test_unrecordable_successor__taken_over_while_the_database_was_away__stale_sends_nothing(
    broker: Broker, lease_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above, but while the database is away A's grant expires and B (token 2) runs
    the job and settles it. A's retry is refused, and A's lost first attempt sent
    nothing: only B's step goes out (R4)."""
    from celery_fenced import outages

    app = broker.app
    _pickle(app)
    chain(app.signature("seams.step", ("t",)), app.signature("seams.sink", ({1},))).apply_async()
    message = broker.one("seams.step")
    task_id = message[0]["id"]
    restarted = _fail_result_row_once(monkeypatch, lease_db)
    sleep = outages.time.sleep
    took_over: list[bool] = []

    def pause(seconds: float) -> None:
        if threading.current_thread().name == "A" and not took_over:
            took_over.append(True)
            expire(lease_db, granted(lease_db, task_id, 1))
            b = Execution(app, message, "B")
            b.finish()
        sleep(seconds)

    monkeypatch.setattr(outages.time, "sleep", pause)
    a = Execution(app, message, "A")
    a.finish()
    assert restarted
    assert took_over
    assert status(lease_db, task_id) == ("SUCCESS", '"t@2"')
    assert [list(body[0]) for _, body in broker.sent("seams.sink")] == [["t@2", {1}]]


# -- the result row's children list the lost attempt's successors too ----------
@pytest.mark.parametrize("link", [False, True], ids=["chain step", "link callback"])
def test_database_restart__result_children_are_the_successors_sent(
    broker: Broker, lease_db: str, link: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each attempt's publish adds to the request's trail (``children``) at once; the row
    settled by the retry lists only what the retry sent — not the lost attempt's chain
    step twice, nor a link callback's task id that was never sent (a caller collecting
    the children would wait for it forever)."""
    app = broker.app
    message = _step_then_sink(broker, "r", link)
    restarted = _fail_result_row_once(monkeypatch, lease_db)  # after the successor
    deliver(app, message)
    assert restarted
    from django_celery_results.models import TaskResult

    meta = json.loads(TaskResult.objects.using(lease_db).get(task_id=message[0]["id"]).meta)
    children = [child[0][0] for child in meta["children"]]
    sent = [headers["id"] for headers, _ in broker.sent("seams.sink")]
    assert len(sent) == 1
    assert children == sent


# -- a commit whose answer was lost is recorded as a stale write ---------------
def _lose_commit_answer(
    monkeypatch: pytest.MonkeyPatch,
    lease_db: str,
    state: str,
    after: Any = None,
    *,
    committed: bool = True,
) -> list[str]:
    """The COMMIT of the first transaction settling ``state`` fails: Django sees an
    OperationalError there (its on-commit hooks are dropped). ``committed``: the server
    did commit and only the answer was lost (``after()`` runs between the two); else the
    database went away before the commit. Returns the task id it happened to, once it has."""
    from celery_fenced import store

    prove = store.prove_for_result
    armed: list[str] = []
    fired: list[str] = []

    def prove_and_arm(lease: Any, task_id: str, status_: str, **kwargs: Any) -> Any:
        proven = prove(lease, task_id, status_, **kwargs)
        if status_ == state and not fired:
            armed.append(task_id)
        return proven

    wrapper = type(connections[lease_db])
    commit = wrapper.commit

    def failing_commit(self: Any) -> None:
        if not (armed and not fired and self.alias == lease_db):
            commit(self)
            return
        fired.append(armed[0])
        if not committed:
            raise OperationalError("the database system is shutting down")
        commit(self)
        if after is not None:
            after()
        raise OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(store, "prove_for_result", prove_and_arm)
    monkeypatch.setattr(wrapper, "commit", failing_commit)
    return fired


def test_retry_commit_answer_lost__no_stale_write_is_recorded(
    broker: Broker, lease_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The RETRY outcome's transaction committed (the grant released as RETRY, the row
    written under the token); the answer was lost and it is settled again: the grant,
    released as RETRY under this token, shows it committed — no ``lost`` or
    ``stale_write_rejected`` event for a write that was never stale."""
    app = broker.app
    app.signature("seams.retrying", (8,)).apply_async(task_id="retrying-8")
    fired = _lose_commit_answer(monkeypatch, lease_db, "RETRY")
    deliver(app, broker.sent("seams.retrying")[0])
    assert fired
    assert status(lease_db, "retrying-8")[0] == "RETRY"
    kinds = list(LeaseEvent.objects.using(lease_db).values_list("kind", flat=True))
    assert "stale_write_rejected" not in kinds
    assert "lost" not in kinds


def test_success_commit_answer_lost_then_key_granted_again__not_a_stale_write(
    broker: Broker, lease_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The success committed (result, release, chain step recorded); its answer was lost
    and, before the retry, another job took the (free) key: token 2. The result row,
    written under this token, shows it committed: not a stale write, not a lost lease."""
    import celery_fenced

    app = broker.app
    chain(app.signature("seams.keyed", (5,)), app.signature("seams.sink")).apply_async()
    message = broker.one("seams.keyed")
    task_id = message[0]["id"]
    others: list[Any] = []

    def another_job_takes_the_key() -> None:
        def take() -> None:
            try:
                others.append(celery_fenced.acquire("report:5", ttl=30, owner="other"))
            finally:
                connections.close_all()

        thread = threading.Thread(target=take)
        thread.start()
        thread.join(30)

    fired = _lose_commit_answer(monkeypatch, lease_db, "SUCCESS", another_job_takes_the_key)
    deliver(app, message)
    assert fired
    assert others
    assert others[0].token == 2
    assert status(lease_db, task_id) == ("SUCCESS", '"5@1"')
    assert broker.sent("seams.sink") == []  # recorded; the reclaimer sends it
    kinds = list(LeaseEvent.objects.using(lease_db).values_list("kind", flat=True))
    assert "stale_write_rejected" not in kinds


def test_ignore_result_success_commit_answer_lost__not_failed_and_chain_not_failed(
    broker: Broker, lease_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ignore_result``: the success committed (release, chain step recorded, no result
    row) and its answer was lost. Settled again, the released grant shows it committed:
    no FAILURE(StaleToken), no errback, the chain's next step not marked failed — it was
    recorded, and the reclaimer sends it."""
    from django_celery_results.models import TaskResult

    from celery_fenced import outbox

    app = broker.app
    step = app.signature(
        "seams.step", ("n",), ignore_result=True, link_error=app.signature("seams.errback")
    )
    result = chain(step, app.signature("seams.sink")).apply_async()
    message = broker.one("seams.step")
    task_id = message[0]["id"]
    fired = _lose_commit_answer(monkeypatch, lease_db, "SUCCESS")
    deliver(app, message)
    assert fired
    rows = dict(TaskResult.objects.using(lease_db).values_list("task_id", "status"))
    PendingJob.objects.using(lease_db).update(resend_at=timezone.now())
    outbox.resend_pending(app, using=lease_db)
    sinks = [list(body[0]) for _, body in broker.sent("seams.sink")]
    # the job succeeded: no FAILURE(StaleToken), no errback; its chain's next step was
    # sent (by the reclaimer), so it is not FAILED
    got = (sinks, len(broker.sent("seams.errback")), rows.get(task_id), rows.get(result.id))
    assert got == ([["n@1"]], 0, None, None), f"got {got}"


def test_ignore_result_failure_commit_answer_lost__errback_sent_once(
    broker: Broker, lease_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above for a FAILURE (``ignore_result``: no row, store_errors_even_if_ignored
    off): the committed attempt recorded the errback (the reclaimer sends it); settled
    again, it is found committed and fires nothing more."""
    from celery_fenced import outbox
    from tests.integration.test_seams import FAILING

    app = broker.app
    app.signature("seams.step", ("m",)).apply_async(
        ignore_result=True, link_error=app.signature("seams.errback")
    )
    message = broker.one("seams.step")
    fired = _lose_commit_answer(monkeypatch, lease_db, "FAILURE")
    FAILING.add("MainThread")
    deliver(app, message)
    assert fired
    PendingJob.objects.using(lease_db).update(resend_at=timezone.now())
    outbox.resend_pending(app, using=lease_db)
    assert len(broker.sent("seams.errback")) == 1


# -- paths that held already ---------------------------------------------------------------
def test_success_commit_answer_lost__successor_sent_once_by_the_reclaimer(
    broker: Broker, lease_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from celery_fenced import outbox

    app = broker.app
    chain(app.signature("seams.step", ("l",)), app.signature("seams.sink")).apply_async()
    message = broker.one("seams.step")
    fired = _lose_commit_answer(monkeypatch, lease_db, "SUCCESS")
    deliver(app, message)
    assert fired
    assert status(lease_db, message[0]["id"]) == ("SUCCESS", '"l@1"')
    assert broker.sent("seams.sink") == []
    assert not LeaseEvent.objects.using(lease_db).filter(kind="stale_write_rejected").exists()
    PendingJob.objects.using(lease_db).update(resend_at=timezone.now())
    outbox.resend_pending(app, using=lease_db)
    outbox.resend_pending(app, using=lease_db)
    assert [list(body[0]) for _, body in broker.sent("seams.sink")] == [["l@1"]]
    _started(broker, lease_db, "seams.sink")


@pytest.mark.parametrize("where", ["counter", "commit"])
def test_chord_last_part_settled_again__body_once(
    broker: Broker, lease_db: str, where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from django_celery_results.backends import database as dcr
    from django_celery_results.models import ChordCounter

    app = broker.app
    header = [app.signature("seams.step", (v,)) for v in ("a", "b")]
    chord(header, app.signature("seams.sink")).apply_async()
    first, second = broker.sent("seams.step")
    deliver(app, first)
    fired: list[str] = []
    if where == "counter":
        original = dcr.trigger_callback

        def trigger(*args: Any, **kwargs: Any) -> Any:
            if not fired:
                fired.append("x")
                _restart(lease_db)
                ChordCounter.objects.using(lease_db).count()  # the statement meets it
            return original(*args, **kwargs)

        monkeypatch.setattr(dcr, "trigger_callback", trigger)
    else:
        fired = _lose_commit_answer(monkeypatch, lease_db, "SUCCESS", committed=False)
    deliver(app, second)
    assert fired
    assert [sorted(body[0][0]) for _, body in broker.sent("seams.sink")] == [["a@1", "b@1"]]
    assert not ChordCounter.objects.using(lease_db).exists()
    assert not any(r[0] == "seams.sink" for r in RUNS)


@pytest.mark.parametrize("link", [False, True], ids=["chain step", "link callback"])
def test_recorded_successor__taken_over_while_the_database_was_away__stale_sends_nothing(
    broker: Broker, lease_db: str, link: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from celery_fenced import outages

    app = broker.app
    message = _step_then_sink(broker, "t", link)
    task_id = message[0]["id"]
    restarted = _fail_result_row_once(monkeypatch, lease_db)
    sleep = outages.time.sleep
    took_over: list[bool] = []

    def pause(seconds: float) -> None:
        if threading.current_thread().name == "A" and not took_over:
            took_over.append(True)
            expire(lease_db, granted(lease_db, task_id, 1))
            Execution(app, message, "B").finish()
        sleep(seconds)

    monkeypatch.setattr(outages.time, "sleep", pause)
    Execution(app, message, "A").finish()
    assert restarted
    assert took_over
    assert status(lease_db, task_id) == ("SUCCESS", '"t@2"')
    assert [list(body[0]) for _, body in broker.sent("seams.sink")] == [["t@2"]]
    _started(broker, lease_db, "seams.sink")


@pytest.mark.parametrize("where", ["row", "commit"])
def test_failure_settled_again__chain_failed_and_errback_sent_once(
    broker: Broker, lease_db: str, where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from celery_fenced.backends import FencedDatabaseBackend
    from tests.integration.test_seams import FAILING

    app = broker.app
    step = app.signature("seams.step", ("f",), link_error=app.signature("seams.errback"))
    result = chain(step, app.signature("seams.sink")).apply_async()
    message = broker.one("seams.step")
    fired: list[str] = []
    if where == "row":
        original = FencedDatabaseBackend._write_row

        def write_row(self: Any, task_id: str, *args: Any, **kwargs: Any) -> Any:
            if task_id == message[0]["id"] and not fired:
                fired.append("x")
                _restart(lease_db)
            return original(self, task_id, *args, **kwargs)

        monkeypatch.setattr(FencedDatabaseBackend, "_write_row", write_row)
    else:
        fired = _lose_commit_answer(monkeypatch, lease_db, "FAILURE", committed=False)
    FAILING.add("MainThread")
    deliver(app, message)
    assert fired
    assert status(lease_db, message[0]["id"])[0] == "FAILURE"
    assert status(lease_db, result.id)[0] == "FAILURE"
    assert len(broker.sent("seams.errback")) == 1
    assert broker.sent("seams.sink") == []
    _started(broker, lease_db, "seams.errback")


@pytest.fixture
def alias(alias_with_mariadb: str) -> str:
    """SQLite, PostgreSQL and MariaDB."""
    return alias_with_mariadb
