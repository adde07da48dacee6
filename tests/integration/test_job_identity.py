"""One job, one identity, through Celery's own tracer: the lease key a job runs under is
decided once, where it is published, and every copy of its message carries it; a task
that replaces itself with the same signature is the next step of its job, not a copy.

Messages are published by Celery's canvas and the fenced ``apply_async`` into an
in-memory broker, captured with ``before_task_publish``, and delivered to
``celery.app.trace.build_tracer`` as a worker's pool process does (see ``test_seams``).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery, chain, chord
from django_celery_results.models import TaskResult

from celery_fenced import FencedTask
from celery_fenced.keys import KEY_HEADER
from celery_fenced.models import Lease, LeaseEvent, PendingJob
from celery_fenced.outbox import resend_pending
from tests.conftest import WITH_MARIADB
from tests.integration.test_seams import Broker, deliver

pytestmark = [
    pytest.mark.django_db(transaction=True, databases=WITH_MARIADB),
    pytest.mark.timeout(120),
]

#: (task name, value) of every body that ran
RUNS: list[tuple[str, Any]] = []


def make_app(serializer: str = "json") -> Celery:
    app = Celery("identity", set_as_current=False, broker="memory://")
    app.conf.update(
        result_backend="celery_fenced.backends:FencedDatabaseBackend",
        result_extended=True,
        task_default_queue="identity",
        task_serializer=serializer,
        accept_content=["json", "pickle"],
        fenced_duplicate_window=3600,
    )

    @app.task(
        name="identity.batch",
        bind=True,
        base=FencedTask,
        shared=False,
        lease_ttl=30,
        lease_key="batch:{ids}",
        lease_unique="until_done",
    )
    def batch(self: Any, ids: Any) -> str:
        RUNS.append(("identity.batch", ids))
        return str(self.request.lease_key)

    @app.task(name="identity.poll", bind=True, base=FencedTask, shared=False, lease_ttl=30)
    def poll(self: Any, label: str, until: int) -> Any:
        """The usual polling loop: replaced by itself, the same signature, until done."""
        RUNS.append(("identity.poll", label))
        if sum(1 for name, value in RUNS if (name, value) == ("identity.poll", label)) < until:
            return self.replace(app.signature("identity.poll", (label, until), immutable=True))
        return f"{label} polled {until} times"

    @app.task(name="identity.sink", shared=False)
    def sink(*values: Any) -> list[Any]:
        RUNS.append(("identity.sink", values))
        return list(values)

    return app


def runs(name: str) -> list[Any]:
    return [value for task, value in RUNS if task == name]


def status(alias: str, task_id: str) -> tuple[str, str]:
    row = TaskResult.objects.using(alias).get(task_id=task_id)
    return row.status, row.result


# -- the key is decided once, at publish ---------------------------------------------------
#: argument -> the key it gives as the message carries it, with JSON and with pickle
ARGUMENTS = {
    "tuple": ((1, 2), {"json": "batch:[1, 2]", "pickle": "batch:(1, 2)"}),
    "dict with int keys": (
        {1: "a", 2: "b"},
        {"json": "batch:{'1': 'a', '2': 'b'}", "pickle": "batch:{1: 'a', 2: 'b'}"},
    ),
    "datetime": (
        dt.datetime(2026, 12, 5, 9, 30, tzinfo=dt.timezone.utc),
        dict.fromkeys(["json", "pickle"], "batch:2026-12-05 09:30:00+00:00"),
    ),
}


@pytest.mark.parametrize("serializer", ["json", "pickle"])
@pytest.mark.parametrize("argument", ARGUMENTS.values(), ids=list(ARGUMENTS))
def test_unique_until_done__the_key_of_the_outbox_row_is_the_key_the_job_runs_under(
    capture: Any, lease_db: str, serializer: str, argument: tuple[Any, dict[str, str]]
) -> None:
    """A ``lease_unique="until_done"`` job whose arguments change shape in the message (a
    tuple arrives as a list, int dict keys as strings) runs under the key its outbox row
    and unique check used; once it has run, a new call queues a new job — it was
    refused forever when the worker worked the key out again from the decoded message."""
    value, key = argument[0], argument[1][serializer]
    app = make_app(serializer)
    broker = capture(app)
    first = app.tasks["identity.batch"].delay(ids=value)
    headers, _ = broker.one("identity.batch")
    assert headers[KEY_HEADER] == key  # decided once, from the arguments the message carries
    assert PendingJob.objects.using(lease_db).get(task_id=first.id).key == key
    deliver(app, broker.one("identity.batch"))
    assert status(lease_db, first.id) == ("SUCCESS", f'"{key}"')
    assert Lease.objects.using(lease_db).get(task_id=first.id).key == key
    second = app.tasks["identity.batch"].delay(ids=value)
    assert second.id != first.id  # a new job, queued: the key was not left blocked
    assert len(broker.sent("identity.batch")) == 2
    assert list(PendingJob.objects.using(lease_db).values_list("task_id", "key")) == [
        (second.id, key)  # the first job's row ended with its grant
    ]
    assert not LeaseEvent.objects.using(lease_db).filter(kind="deduplicated").exists()


def test_unique_until_done__a_copy_sent_again_as_json_runs_under_the_publish_key(
    capture: Any, lease_db: str
) -> None:
    """A pickled job (its tuple kept) lost by the broker is sent again by the outbox as
    JSON (its tuple now a list): the copy runs under the key the job was published with,
    not under a second one, and while it runs a new call is still a copy of it."""
    app = make_app("pickle")
    broker = capture(app)
    first = app.tasks["identity.batch"].delay(ids=(3, 4))
    PendingJob.objects.using(lease_db).filter(task_id=first.id).update(
        resend_at=dt.datetime(2000, 1, 1, tzinfo=dt.timezone.utc)
    )
    assert [o.action for o in resend_pending(app, using=lease_db)] == ["resent"]
    original, copy = broker.sent("identity.batch")
    assert copy[0][KEY_HEADER] == original[0][KEY_HEADER] == "batch:(3, 4)"
    deliver(app, copy)  # the copy first: the original message was "lost"
    assert status(lease_db, first.id) == ("SUCCESS", '"batch:(3, 4)"')
    assert runs("identity.batch") == [[3, 4]]  # the JSON copy's list, under the tuple's key
    deliver(app, original)  # the original turns up late: a duplicate of the completed job
    assert len(runs("identity.batch")) == 1


#: how a retry is asked for -> the value the first run is given, the keys both runs hold
RETRIES: dict[str, tuple[Callable[[Any], Any], Any, list[str]]] = {
    # the key decided at publish, from the arguments before JSON changed their shape
    "the same job": (lambda task: task.retry(countdown=0), (5, 6), ["r:[5, 6]"] * 2),
    "the same arguments given again": (
        lambda task: task.retry(args=task.request.args, kwargs=task.request.kwargs, countdown=0),
        (5, 6),
        ["r:[5, 6]"] * 2,
    ),
    # the retry works on what its arguments name: their key, not the first job's (under
    # which it would run unfenced beside a job of its own key)
    "other arguments": (
        lambda task: task.retry(kwargs={"value": 2}, countdown=0),
        1,
        ["r:1", "r:2"],
    ),
}


@pytest.mark.parametrize(("retry", "value", "keys"), RETRIES.values(), ids=list(RETRIES))
def test_retry__runs_under_the_key_of_its_arguments(
    capture: Any,
    lease_db: str,
    retry: Callable[[Any], Any],
    value: Any,
    keys: list[str],
) -> None:
    """A retry's message carries the key of what it works on: the running job's, unless
    it was asked for with other arguments."""
    app = make_app()
    broker = capture(app)

    @app.task(
        name="identity.retrying",
        bind=True,
        base=FencedTask,
        shared=False,
        lease_ttl=30,
        lease_key="r:{value}",
    )
    def retrying(self: Any, value: Any) -> str:
        RUNS.append(("identity.retrying", self.request.lease_key))
        if self.request.retries == 0:
            raise retry(self)
        return str(self.request.lease_key)

    result = retrying.delay(value=value)
    deliver(app, broker.sent("identity.retrying")[0])
    retried = broker.sent("identity.retrying")[1]
    assert retried[0][KEY_HEADER] == keys[1]
    deliver(app, retried)
    assert runs("identity.retrying") == keys
    assert status(lease_db, result.id) == ("SUCCESS", f'"{keys[1]}"')


def test_a_message_without_the_key_header__runs_under_the_key_of_its_arguments(
    capture: Any, lease_db: str
) -> None:
    """A publisher that does not decide the key (an older version, a plain ``send_task``
    of a process that does not know the task is fenced): the worker renders it."""
    app = make_app()
    broker = capture(app)
    app.tasks["identity.batch"].delay(ids=[7])
    headers, body = broker.one("identity.batch")
    del headers[KEY_HEADER]
    deliver(app, (headers, body))
    assert Lease.objects.using(lease_db).get(task_id=headers["id"]).key == "batch:[7]"


# -- a task replaced by itself is the next step of its job ----------------------------------
def deliver_all(app: Celery, broker: Broker, name: str) -> None:
    """Deliver each message of task ``name`` once, in order, including those published
    while delivering (a replacement)."""
    done = 0
    while done < len(broker.sent(name)):
        deliver(app, broker.sent(name)[done])
        done += 1


def test_replace_with_the_same_signature__each_replacement_runs_and_the_chain_goes_on(
    capture: Any, lease_db: str
) -> None:
    """``return self.replace(poll.si(...))`` with the replaced task's own signature: the
    replacement has the replaced task's id, name and arguments, and ran as a completed
    duplicate of it before (the job lost: no result, the chain's next step never sent)."""
    app = make_app()
    broker = capture(app)
    result = chain(
        app.signature("identity.poll", ("x", 3), immutable=True), app.signature("identity.sink")
    ).apply_async()
    deliver_all(app, broker, "identity.poll")
    assert runs("identity.poll") == ["x", "x", "x"]
    (poll_message, *_) = broker.sent("identity.poll")
    assert status(lease_db, poll_message[0]["id"]) == ("SUCCESS", '"x polled 3 times"')
    deliver(app, broker.one("identity.sink"))
    assert runs("identity.sink") == [("x polled 3 times",)]
    assert result.id == broker.one("identity.sink")[0]["id"]
    assert not LeaseEvent.objects.using(lease_db).filter(kind="duplicate").exists()


def test_replace__a_late_copy_of_a_replaced_message_is_still_a_duplicate(
    capture: Any, lease_db: str
) -> None:
    """What replacing marks ended is the message replaced: a redelivery of it (the worker
    died before acknowledging) does not run the body and replace it a second time."""
    app = make_app()
    broker = capture(app)
    app.signature("identity.poll", ("y", 2), immutable=True).apply_async()
    original = broker.sent("identity.poll")[0]
    deliver_all(app, broker, "identity.poll")
    assert runs("identity.poll") == ["y", "y"]
    deliver(app, original)  # redelivered after its replacement ran
    deliver(app, broker.sent("identity.poll")[1])  # and the replacement's own copy
    assert runs("identity.poll") == ["y", "y"]
    assert len(broker.sent("identity.poll")) == 2  # replaced once, not again
    assert LeaseEvent.objects.using(lease_db).filter(kind="duplicate").count() == 2


def test_replace_in_a_chord_header__the_body_gets_every_member_once(
    capture: Any, lease_db: str
) -> None:
    app = make_app()
    broker = capture(app)
    chord(
        [
            app.signature("identity.poll", ("a", 2), immutable=True),
            app.signature("identity.poll", ("b", 1), immutable=True),
        ],
        app.signature("identity.sink"),
    ).apply_async()
    deliver_all(app, broker, "identity.poll")
    assert sorted(runs("identity.poll")) == ["a", "a", "b"]
    (_, body) = broker.one("identity.sink")
    assert sorted(body[0][0]) == ["a polled 2 times", "b polled 1 times"]


def test_replaced_job_resent_by_the_reclaimer__keeps_its_place_in_the_job(
    capture: Any, lease_db: str
) -> None:
    """The replacement's grant records its job with its replacement count: a copy the
    reclaimer sends again is that step again, not the replaced message's duplicate."""
    app = make_app()
    broker = capture(app)
    app.signature("identity.poll", ("z", 2), immutable=True).apply_async()
    deliver(app, broker.sent("identity.poll")[0])
    replacement = broker.sent("identity.poll")[1]
    assert replacement[0]["replaced_task_nesting"] == 1
    recorded = PendingJob.objects.using(lease_db).get(task_id=replacement[0]["id"])
    assert '"replaced_task_nesting":1' in recorded.job.replace(" ", "")
    PendingJob.objects.using(lease_db).update(
        resend_at=dt.datetime(2000, 1, 1, tzinfo=dt.timezone.utc)
    )
    assert [o.action for o in resend_pending(app, using=lease_db)] == ["resent"]
    copy = broker.sent("identity.poll")[2]
    assert copy[0]["replaced_task_nesting"] == 1
    deliver(app, copy)  # the replacement's message "lost": its copy runs the step
    assert runs("identity.poll") == ["z", "z"]
    assert status(lease_db, copy[0]["id"]) == ("SUCCESS", '"z polled 2 times"')


def test_replace__a_late_copy_of_the_replaced_message_leaves_the_replacements_row(
    capture: Any, lease_db: str
) -> None:
    """The replacement's outbox row (the same task id) stands until the replacement is
    granted: a late copy of the message it replaced — a duplicate — does not end it, and
    the reclaimer sends the replacement again when the broker lost it."""
    app = make_app()
    broker = capture(app)
    app.signature("identity.poll", ("w", 3), immutable=True).apply_async()
    deliver(app, broker.sent("identity.poll")[0])  # replaced: replacement 1 recorded
    first_replacement = broker.sent("identity.poll")[1]
    deliver(app, first_replacement)  # replaced again: replacement 2 recorded
    task_id = first_replacement[0]["id"]
    assert PendingJob.objects.using(lease_db).get(task_id=task_id).nesting == 2
    deliver(app, first_replacement)  # a late copy of replacement 1: a duplicate
    assert PendingJob.objects.using(lease_db).filter(task_id=task_id).exists()
    # replacement 2's message lost by the broker: the reclaimer sends it again
    PendingJob.objects.using(lease_db).update(
        resend_at=dt.datetime(2000, 1, 1, tzinfo=dt.timezone.utc)
    )
    assert [o.action for o in resend_pending(app, using=lease_db)] == ["resent"]
    copy = broker.sent("identity.poll")[-1]
    assert copy[0]["replaced_task_nesting"] == 2
    deliver(app, copy)
    assert runs("identity.poll") == ["w", "w", "w"]
    assert status(lease_db, task_id) == ("SUCCESS", '"w polled 3 times"')
    assert not PendingJob.objects.using(lease_db).exists()
