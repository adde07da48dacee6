"""The chaos runner's checker on hand-made histories (SQLite: no server, no worker).

The runner itself, with real workers, is in tests/acceptance/test_chaos.py.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pytest
from django.db import connections
from django_celery_results.models import TaskResult

from celery_fenced.models import Lease, LeaseEvent
from testproject.demo import chaos_tasks
from testproject.demo.models import ChaosEntry, ChaosSlot
from tests import chaos, chaos_workload


# -- the checker on hand-made histories ---------------------------------------------------
def db(test: Any) -> Any:
    """A checker test: the databases of a transactional test, and an empty trace table."""
    return pytest.mark.usefixtures("trace_table")(pytest.mark.django_db(transaction=True)(test))


@pytest.fixture
def trace_table() -> None:
    """The trace table, empty (raw SQL, so a transactional test's flush does not clear it)."""
    chaos_tasks.create_trace_table()
    with connections["default"].cursor() as cursor:
        cursor.execute(f"DELETE FROM {chaos_tasks.TRACE}")


T0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)


def at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


def grant(key: str, token: int, owner: str, task_id: str, when: float) -> Lease:
    lease, _ = Lease.objects.update_or_create(
        key=key,
        defaults={
            "token": token,
            "owner": owner,
            "task_id": task_id,
            "acquired_at": at(when),
            "renewed_at": at(when),
            "expires_at": at(when + 2),
            "released_at": None,
        },
    )
    LeaseEvent.objects.create(
        lease=lease,
        kind="acquired" if token == 1 else "reclaimed",
        token=token,
        task_id=task_id,
        owner=owner,
        at=at(when),
    )
    return lease


def release(lease: Lease, token: int, when: float, state: str = "SUCCESS") -> None:
    Lease.objects.filter(pk=lease.pk).update(released_at=at(when))
    LeaseEvent.objects.create(
        lease=lease,
        kind="released",
        token=token,
        task_id=lease.task_id,
        owner=lease.owner,
        at=at(when),
        detail={"state": state},
    )


def write(job: str, key: str, token: int, owner: str, seen: int, ended: bool = False) -> None:
    ChaosEntry.objects.create(
        job=job,
        lease_key=key,
        token=token,
        owner=owner,
        via="guard",
        written_at=at(1),
        grant_seen=seen,
        end_seen=ended,
    )


def done(task_id: str, status: str = "SUCCESS", result: Any = None, key: str = "chaos:j1") -> None:
    """Task ``task_id``'s stored result, proven (as the fenced backend stores it) under
    ``key``."""
    TaskResult.objects.create(
        task_id=task_id,
        status=status,
        result=json.dumps(result or {"applied": True}),
        meta=json.dumps({"lease_key": key}),
    )


def one_job(job: str, task_id: str, task: str = "chaos.guarded") -> chaos.Job:
    ChaosSlot.objects.get_or_create(job=job)
    return chaos.Job(job, task, task_id, 0.1)


def run_check(
    jobs: list[chaos.Job], *, outbox: bool = False, **events: Any
) -> list[tuple[str, str]]:
    """The checker's violations, as (kind, cause); ``outbox``: the run published with it."""
    options = chaos.Options(ttl=2, outbox=outbox)
    report = chaos.check(jobs, chaos.Events(**events), options, stopped_at=at(100))
    return [(v.kind, v.cause) for v in report.violations]


@db
def test_checker__clean_history_has_no_violation() -> None:
    job = one_job("j1", "t1")
    grant("chaos:j1", 1, "a", "t1", 0)
    taken = grant("chaos:j1", 2, "b", "t1", 3)  # a took too long; b took over
    write("j1", "chaos:j1", 2, "b", seen=2)
    release(taken, 2, 4)
    done("t1")
    assert run_check([job]) == []


@db
@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("stale-write", ("stale-accepted", "")),
        ("write-after-release", ("stale-accepted", "")),
        ("never-granted", ("stale-accepted", "")),
        ("applied-twice", ("effect-count", "")),
        ("never-applied", ("effect-count", "")),
        ("no-result", ("not-final", "")),
        ("token-gap", ("tokens", "")),
    ],
)
def test_checker__each_violation_is_seen(case: str, expected: tuple[str, str]) -> None:
    job = one_job("j1", "t1")
    grant("chaos:j1", 1, "a", "t1", 0)
    second = grant("chaos:j1", 2 if case != "token-gap" else 3, "b", "t1", 3)
    if case == "stale-write":  # a wrote under token 1 after b's grant of token 2
        write("j1", "chaos:j1", 1, "a", seen=2)
    elif case == "write-after-release":
        write("j1", "chaos:j1", 2, "b", seen=2, ended=True)
    elif case == "never-granted":
        write("j1", "chaos:j1", 2, "a", seen=2)
    elif case == "applied-twice":
        write("j1", "chaos:j1", 1, "a", seen=1)
        write("j1", "chaos:j1", 2, "b", seen=2)
    elif case != "never-applied":
        write("j1", "chaos:j1", second.token, "b", seen=second.token)
    release(second, second.token, 4)
    if case != "no-result":
        done("t1")
    assert expected in run_check([job])


@db
def test_checker__held_past_expiry_and_dropped_retry_are_named() -> None:
    job = one_job("j1", "t1")
    lease = grant("chaos:j1", 1, "a", "t1", 0)
    release(lease, 1, 1, state="FAILURE")
    LeaseEvent.objects.create(lease=lease, kind="duplicate", task_id="t1", owner="b", at=at(2))
    done("t1", "FAILURE", {"exc_type": "OperationalError", "exc_message": ["restart"]})
    found = run_check([job], held_past_expiry=["'k' token 3 held by dead-owner"])
    assert ("effect-count", chaos.RETRY_DROPPED) in found
    assert ("failed", chaos.RETRY_DROPPED) in found
    assert ("held-past-expiry", "") in found


@db
def test_checker__database_error_before_the_grant_is_named() -> None:
    job = one_job("j1", "t1")
    done("t1", "FAILURE", {"exc_type": "OperationalError", "exc_message": ["refused"]})
    found = run_check([job])
    assert ("effect-count", chaos.DB_ERROR_BEFORE_GRANT) in found
    assert ("failed", chaos.DB_ERROR_BEFORE_GRANT) in found


@db
@pytest.mark.parametrize("killed", [True, False])
def test_checker__job_never_received_is_lost_in_the_broker_only_after_a_kill(
    killed: bool,
) -> None:
    job = one_job("j1", "t1")
    job.sent_at = dt.datetime(2026, 1, 1, 12, 0)
    kills = [dt.datetime(2026, 1, 1, 12, 0, 1)] if killed else []
    found = run_check([job], kill_times=kills)
    cause = chaos.LOST_IN_BROKER if killed else ""
    assert ("not-final", cause) in found


@db
def test_checker__with_the_outbox_a_job_lost_in_the_broker_is_not_excused() -> None:
    """The outbox sends again a job the broker lost: its loss is a plain violation."""
    job = one_job("j1", "t1")
    job.sent_at = dt.datetime(2026, 1, 1, 12, 0)
    found = run_check([job], outbox=True, kill_times=[dt.datetime(2026, 1, 1, 12, 0, 1)])
    assert ("not-final", "") in found


@db
def test_checker__job_received_only_during_the_restart_is_named() -> None:
    job = one_job("j1", "t1")
    began = dt.datetime(2026, 1, 1, 12, 0)
    found = run_check(
        [job],
        pg_restart_window=(began, began + dt.timedelta(seconds=1)),
        receipts={"t1": [began + dt.timedelta(seconds=1.5)]},
    )
    assert ("not-final", chaos.DB_ERROR_BEFORE_GRANT) in found


# -- the invariants at Celery's seams, on hand-made histories ------------------------------
def trace(
    kind: str, task_id: str, parent_id: str, token: int | None, value: Any = None, owner: str = ""
) -> None:
    row = chaos_tasks.Trace(
        0, kind, "chaos.step", "j", 0, task_id, parent_id, token, owner, "w9", 0, value, None
    )
    chaos_tasks.record(row)


def stored(task_id: str, token: int | None, status: str = "SUCCESS") -> dict[str, Any]:
    value = {"job": "j", "step": 0, "task_id": task_id, "token": token}
    TaskResult.objects.create(
        task_id=task_id,
        status=status,
        result=json.dumps(value),
        meta=json.dumps({"fencing_token": token}),
    )
    return value


def seam_job(kind: str, ids: dict[str, str]) -> chaos.Job:
    return chaos.Job("j", f"chaos.{kind}", next(iter(ids.values())), 0.0, kind=kind, ids=ids)


def chain_history(case: str) -> chaos.Job:
    v0 = stored("s0", 2)
    v1 = stored("s1", 1)
    stored("s2", 1)
    trace("sent", "s1", "s0", 2)
    trace("run", "s1", "s0", 1, v0)
    trace("sent", "s2", "s1", 1)
    trace("run", "s2", "s1", 1, v1)
    if case == "stale-send":  # s0's first execution (token 1) sent s1 too
        trace("sent", "s1", "s0", 1)
    elif case == "sent-twice":
        trace("sent", "s2", "s1", 1)
    elif case == "stale-value":  # s1 ran with what s0's stale execution returned
        trace("run", "s1", "s0", 1, {**v0, "token": 1})
    return seam_job("chain", {"s0": "s0", "s1": "s1", "s2": "s2"})


def chord_history(case: str) -> chaos.Job:
    values = [stored(f"h{n}", 1) for n in range(3)]
    stored("body", None)
    if case != "never-fired":
        trace("sent", "body", "h2", 1, values)
        trace("run", "body", "h2", None, values)
    if case == "fired-twice":  # a stale execution of h1 counted twice and sent it again
        trace("sent", "body", "h1", 0, values)
    elif case == "early":  # sent before every header had stored its result
        trace("run", "body", "h1", None, values[:2])
    return seam_job("chord", {"h0": "h0", "h1": "h1", "h2": "h2", "body": "body"})


def link_history(case: str) -> chaos.Job:
    failed = case in ("errback", "errback-twice", "callback-on-failure")
    value = stored("p", 2, "FAILURE" if failed else "SUCCESS")
    if failed:
        stored("eb", None)
        trace("sent", "eb", "p", 2, "p")
        trace("run", "eb", "p", None, "p")
    else:
        stored("cb", None)
        trace("sent", "cb", "p", 2, value)
        trace("run", "cb", "p", None, value)
    if case in ("errback-on-success", "errback-twice"):
        trace("sent", "eb", "p", 2, "p")
    elif case == "stale-errback":  # the stale execution (token 1) failed: its errback fired
        trace("sent", "eb", "p", 1, "p")
    elif case == "callback-on-failure":  # a stale execution succeeded and sent the callback
        trace("sent", "cb", "p", 1, {**value, "token": 1})
    job = seam_job("link", {"parent": "p", "link": "cb", "errback": "eb"})
    job.fail = failed
    return job


def limit_history(case: str) -> chaos.Job:
    # a hard time limit: the worker's main process stores FAILURE without a token and
    # sends the errback with no execution current (a soft limit: the execution, token 2)
    main = chaos_tasks.MAIN_PROCESS
    status = "SUCCESS" if case == "main-on-success" else "FAILURE"
    stored("t", 2 if case == "soft" else None, status)
    stored("eb", None)
    if case == "soft":
        trace("sent", "eb", "t", 2, "t")
    else:
        trace("sent", "eb", "t", None, "t", owner=main)
    trace("run", "eb", "t", None, "t")
    if case == "main-twice":  # the hard limit reported twice, each report sending it
        trace("sent", "eb", "t", None, "t", owner=main)
    return seam_job("limit", {"task": "t", "errback": "eb"})


@db
@pytest.mark.parametrize(
    ("history", "case", "expected"),
    [
        (chain_history, "clean", None),
        (chain_history, "stale-send", "successor"),
        (chain_history, "sent-twice", "successor"),
        (chain_history, "stale-value", "successor"),
        (chord_history, "clean", None),
        (chord_history, "never-fired", "chord-body"),
        (chord_history, "fired-twice", "chord-body"),
        (chord_history, "early", "chord-body"),
        (link_history, "clean", None),
        (link_history, "errback", None),
        (link_history, "errback-on-success", "errback"),
        (link_history, "errback-twice", "errback"),
        (link_history, "stale-errback", "errback"),
        (link_history, "callback-on-failure", "successor"),
        (limit_history, "hard", None),
        (limit_history, "soft", None),
        (limit_history, "main-twice", "errback"),
        (limit_history, "main-on-success", "errback"),
    ],
)
def test_checker__messages_sent_for_a_task_are_counted(
    history: Any, case: str, expected: str | None
) -> None:
    job = history(case)
    found = {kind for kind, _ in run_check([job])}
    if expected is None:
        assert found == set()
    else:
        assert expected in found
        assert found <= {expected, "successor"}  # a stale value may show on its edge too


@db
@pytest.mark.parametrize(
    ("stopped", "expected"),
    [
        (None, [("ended-by-other", "")]),
        ((-1, 0.5), []),  # stopped while it held the grant: it may have been past expiry
        ((0.5, None), []),  # killed
        ((-3, -1), [("ended-by-other", "")]),  # stopped before its grant: no excuse
    ],
)
def test_checker__grant_ended_while_its_holder_ran(
    stopped: tuple[float, float | None] | None, expected: list[tuple[str, str]]
) -> None:
    lease = grant("step:j:0", 1, "w1-abc@vm:10:1", "t1", 0)
    for kind, when in (("force_released", 1), ("stale_write_rejected", 1.5)):
        LeaseEvent.objects.create(
            lease=lease, kind=kind, token=1, task_id="t1", owner=lease.owner, at=at(when)
        )
    stops = []
    if stopped is not None:
        begin, end = stopped
        stops = [["w1-abc@", at(begin), None if end is None else at(end)]]
    assert run_check([], stops=stops) == expected


@db
@pytest.mark.parametrize("asked", [False, True])
def test_checker__completed_task_run_again(asked: bool) -> None:
    first = grant("step:j:0", 1, "a", "t1", 0)
    release(first, 1, 1)
    grant("step:j:0", 2, "b", "t1", 2)
    trace("run", "t1", "", 2)
    if asked:  # the completed execution itself sent the retry
        trace("sent", "t1", "t1", 1)
    found = run_check([])
    assert found == ([] if asked else [("completed-rerun", "")])


@db
def test_checker__chord_body_never_sent_is_not_lost_in_the_broker() -> None:
    job = chord_history("never-fired")
    TaskResult.objects.filter(task_id="body").delete()
    job.sent_at = dt.datetime(2026, 1, 1, 12, 0)
    found = run_check([job], kill_times=[dt.datetime(2026, 1, 1, 12, 0, 1)])
    assert sorted(found) == [("chord-body", ""), ("not-final", "")]


@db
@pytest.mark.parametrize(
    ("exc_type", "expected"), [("StaleToken", []), ("ValueError", [("failed", "")])]
)
def test_checker__competing_job_may_fail_only_with_stale_token(
    exc_type: str, expected: list[tuple[str, str]]
) -> None:
    job = seam_job("compete", {"a": "a", "b": "b"})
    stored("a", 2)
    TaskResult.objects.create(
        task_id="b", status="FAILURE", result=json.dumps({"exc_type": exc_type})
    )
    assert run_check([job]) == expected


@db
def test_checker__chain_whose_first_step_the_broker_lost_is_one_loss() -> None:
    job = seam_job("chain", {"s0": "s0", "s1": "s1", "s2": "s2"})
    job.sent_at = dt.datetime(2026, 1, 1, 12, 0)
    found = run_check([job], kill_times=[dt.datetime(2026, 1, 1, 12, 0, 1)])
    assert found == [("not-final", chaos.LOST_IN_BROKER)]


@db
@pytest.mark.parametrize("events", [3, 2])
def test_checker__a_refused_unique_call_without_its_event_is_seen(events: int) -> None:
    """(f) Four calls of a lease_unique job returned one id: three were refused, and each
    must have recorded a deduplicated event on the job's key."""
    job = chaos.Job("j1", "chaos.unique", "t1", 0.0, kind="unique", ids={"c0": "t1"})
    job.returned = ("t1", "t1", "t1", "t1")
    lease = grant("unique:j1:[1, 2]", 1, "a", "t1", 0)
    release(lease, 1, 1)
    for _ in range(events):
        LeaseEvent.objects.create(lease=lease, kind="deduplicated", task_id="t1", at=at(0))
    done("t1")
    found = run_check([job])
    assert (("unique", "") in found) == (events != 3), found


@db
@pytest.mark.parametrize("step", [chaos_tasks.POLLS - 1, chaos_tasks.POLLS - 2])
def test_checker__a_replacing_job_that_ended_early_is_seen(step: int) -> None:
    """(h) A job whose task replaces itself must end in its last replacement: its value
    names the replacement count it ended in."""
    job = chaos.Job("j1", "chaos.replace", "t1", 0.0, kind="replace", ids={"task": "t1"})
    lease = grant("poll:j1", 1, "a", "t1", 0)
    release(lease, 1, 1)
    done("t1", result={"job": "j1", "step": step, "task_id": "t1", "token": 1})
    found = run_check([job])
    assert (("replace", "") in found) == (step != chaos_tasks.POLLS - 1), found


def _permit_history(*grants: tuple[int, int, float, float | None]) -> dict[str, list[Any]]:
    """(permit, token, granted at, released at) -> the events of each permit's row."""
    from types import SimpleNamespace

    from celery_fenced import permits

    history: dict[str, list[Any]] = {}
    for n, (permit, token, start, end) in enumerate(grants):
        events = history.setdefault(permits.permit_key("permits:j1", permit), [])
        events.append(SimpleNamespace(id=2 * n, kind="acquired", token=token, at=at(start)))
        if end is not None:
            events.append(SimpleNamespace(id=2 * n + 1, kind="released", token=token, at=at(end)))
    return history


@pytest.mark.parametrize(
    ("grants", "seen"),
    [
        (((0, 1, 0, 5), (1, 2, 1, 6)), False),  # two at once of two
        (((0, 1, 0, 5), (1, 2, 1, 6), (2, 3, 2, None)), True),  # three at once
        (((0, 1, 0, 5), (1, 2, 5, 6), (0, 3, 5, 7)), False),  # handed on at one instant
        (((0, 1, 0, None), (0, 2, 3, 4), (1, 3, 1, 2), (1, 4, 5, 6)), False),  # taken over
        (((0, 1, 0, 1), (1, 1, 2, 3)), True),  # a token issued twice
    ],
)
def test_checker__permits_more_than_the_limit_at_once_is_seen(grants: Any, seen: bool) -> None:
    """(g) Never more than the limit's current grants on a key, by the database's clock."""
    found = chaos_workload.check_permits(_permit_history(*grants), 2)
    assert bool(found) == seen, found


def test_plot__counts_and_leases_held_from_the_events() -> None:
    """The run's picture: takeovers and refused writes so far, leases held at a moment."""
    from types import SimpleNamespace

    from tests import chaos_plot

    def ev(n: int, kind: str, lease: int, token: int, when: float) -> Any:
        return SimpleNamespace(id=n, kind=kind, lease_id=lease, token=token, at=at(when))

    events = [
        ev(1, "acquired", 1, 1, 0),
        ev(2, "acquired", 2, 1, 1),
        ev(3, "reclaimed", 1, 2, 3),  # the key's next grant: one held, not two
        ev(4, "stale_write_rejected", 1, 1, 4),
        ev(5, "released", 1, 2, 5),
        ev(6, "released", 2, 1, 6),
    ]
    lines = chaos_plot.timelines(events)
    assert [v for _, v in lines["takeovers"]] == [1]
    assert [v for _, v in lines["stale writes rejected"]] == [1]
    assert [v for _, v in lines["leases held"]] == [1, 2, 2, 1, 0]
    picture = chaos_plot.svg(events, [(at(2), at(3))])
    assert picture.startswith("<svg")
    assert "PostgreSQL restart" in picture


# -- atomic jobs (i) to (k), on hand-made histories -----------------------------------------
def atomic_history(case: str) -> chaos.Job:
    """An atomic job: a (token 1) was taken over by b (token 2), whose body committed its
    plain update, its ledger row, its result and its child; ``case`` spoils it."""
    ChaosSlot.objects.create(job="j1", applied=1)
    grant("atomic:j1-atomic", 1, "a", "t1", 0)
    taken = grant("atomic:j1-atomic", 2, "b", "t1", 3)
    entry = {"job": "j1-atomic", "lease_key": "atomic:j1-atomic", "via": "atomic"}
    ChaosEntry.objects.create(**entry, token=2, owner="b", written_at=at(4), grant_seen=2)
    failed = case in ("child-of-failure", "effect-of-failure")
    release(taken, 2, 4, "FAILURE" if failed else "SUCCESS")
    if case == "effect-of-failure":
        ChaosSlot.objects.filter(job="j1").update(applied=1)
    elif failed:
        ChaosEntry.objects.filter(job="j1-atomic").delete()
        ChaosSlot.objects.filter(job="j1").update(applied=0)
    if case != "lost":
        stored("t1", 2, "FAILURE" if failed else "SUCCESS")
    child = chaos_tasks.atomic_child_id("t1", 2)
    if case not in ("child-never-ran", "lost") and not failed:
        stored(child, None)
        atomic_child_ran(child, 2)
    if case == "applied-twice":  # a's body committed too, before b's grant
        ChaosEntry.objects.create(**entry, token=1, owner="a", written_at=at(2), grant_seen=1)
        ChaosSlot.objects.filter(job="j1").update(applied=2)
    elif case == "update-without-row":  # the plain update committed apart from the row
        ChaosSlot.objects.filter(job="j1").update(applied=2)
    elif case in ("stale-child", "child-of-failure"):  # a's child was sent, and ran
        atomic_child_ran(chaos_tasks.atomic_child_id("t1", 1), 1)
    elif case == "child-run-again":  # one message delivered twice: a plain task's lot
        atomic_child_ran(child, 2)
    return chaos.Job("j1-atomic", "chaos.atomic", "t1", 0.0, kind="atomic", ids={"task": "t1"})


def atomic_child_ran(task_id: str, token: int) -> None:
    value = {"parent": "t1", "token": token}
    row = chaos_tasks.Trace(
        0,
        "run",
        "chaos.atomic_child",
        "j1-atomic",
        1,
        task_id,
        "t1",
        None,
        "",
        "w9",
        0,
        value,
        None,
    )
    chaos_tasks.record(row)


@db
@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("clean", set()),
        ("child-run-again", set()),
        ("applied-twice", {"atomic-effect"}),
        ("update-without-row", {"atomic-effect"}),
        ("effect-of-failure", {"atomic-effect", "failed"}),
        ("stale-child", {"atomic-child"}),
        ("child-of-failure", {"atomic-child", "failed"}),
        ("child-never-ran", {"atomic-child", "atomic-lost", "not-final"}),
        ("lost", {"atomic-lost", "not-final"}),
    ],
)
def test_checker__atomic_job_applied_or_sent_other_than_once_is_seen(
    case: str, expected: set[str]
) -> None:
    """(i) a duplicate effect (or an update apart from its row), (j) a stale execution's
    child, (k) a job or its child without an end: each reported."""
    found = {kind for kind, _ in run_check([atomic_history(case)])}
    assert found == expected, found


def test_checker__atomic_children_are_named_by_the_stored_token() -> None:
    job = chaos.Job("j1-atomic", "chaos.atomic", "t1", 0.0, kind="atomic", ids={"task": "t1"})
    pending = chaos.Job("j2-atomic", "chaos.atomic", "t2", 0.0, kind="atomic", ids={"task": "t2"})
    stored = {
        "t1": chaos_workload.Stored("SUCCESS", 3, {"token": 3}),
        "t2": chaos_workload.Stored("STARTED", None, None),
    }
    chaos_workload.add_atomic_children([job, pending], stored)
    assert job.ids == {"task": "t1", "child": chaos_tasks.atomic_child_id("t1", 3)}
    assert pending.ids == {"task": "t2"}


def test_check_own_grant__a_success_proven_under_another_key_is_one_violation() -> None:
    """(m): a chaos.guarded job's SUCCESS must carry its own key, nested call or not."""

    class Result:
        def __init__(self, status: str, key: str) -> None:
            self.status, self.meta = status, json.dumps({"lease_key": key, "fencing_token": 1})

    jobs = [
        chaos_workload.Job(f"j{n}", "chaos.guarded", f"t{n}", 0.0, nested=n > 0) for n in range(4)
    ]
    results = {
        "t0": Result("SUCCESS", "chaos:j0"),
        "t1": Result("SUCCESS", "chaos:j1"),
        "t2": Result("SUCCESS", "chaos:j2.nested"),  # proven under its call's grant
        "t3": Result("FAILURE", "chaos:j3.nested"),  # not a success: (m) says nothing
    }
    found = chaos_workload.check_own_grant(jobs, results)
    assert found == [
        (
            "own-grant",
            "j2",
            "j2 (its body called its own task): SUCCESS proven under 'chaos:j2.nested'",
        )
    ]
