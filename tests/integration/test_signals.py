"""The package's signals: a receiver that raises is logged and breaks nothing."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import states
from django.dispatch import Signal
from django_celery_results.models import TaskResult

from celery_fenced import FencedTask, LeaseBusy, acquire, force_release, signals
from celery_fenced.models import Lease
from celery_fenced.renewal import Renewer
from tests.conftest import DATABASE_ALIASES
from tests.tracing import fenced_app, trace

db = pytest.mark.django_db(transaction=True, databases=DATABASE_ALIASES)


def wait_for(condition: Callable[[], bool], seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def listeners_copy() -> dict[int, dict[object, Any]]:
    """The package's listeners, copied to be patched in (each signal's own too)."""
    return {signal: dict(listeners) for signal, listeners in signals._listeners.items()}


def broken_receiver(**kwargs: Any) -> None:
    raise RuntimeError("a receiver's bug")


@pytest.fixture
def raising() -> Iterator[Callable[[Signal], None]]:
    """Connect ``broken_receiver`` to a signal; disconnected afterwards."""
    connected: list[Signal] = []

    def connect(signal: Signal) -> None:
        signal.connect(broken_receiver)
        connected.append(signal)

    yield connect
    for signal in connected:
        signal.disconnect(broken_receiver)


@db
def test_lease_lost__raising_receiver_does_not_stop_the_renewer(
    alias: str, raising: Any, caplog: pytest.LogCaptureFixture
) -> None:
    raising(signals.lease_lost)
    renewer = Renewer()
    lost = acquire("signals:lost", ttl=30, using=alias, renew_interval=0.1)
    other = acquire("signals:other", ttl=30, using=alias, renew_interval=0.1)
    renewer.register(lost)
    renewer.register(other)
    try:
        force_release(lost.key, using=alias)  # its next renewal is refused: lease_lost
        wait_for(lambda: lost.lost)
        after = time.monotonic()
        wait_for(lambda: other.confirmed_at > after)  # the other lease is still renewed
        assert renewer._thread is not None
        assert renewer._thread.is_alive()
        assert not other.lost
    finally:
        renewer.unregister(lost)
        renewer.unregister(other)
        other.release()
    assert "tests.integration.test_signals.broken_receiver" in caplog.text
    assert "lease_lost" in caplog.text


@db
def test_lease_released__raising_receiver_leaves_the_stored_success(
    lease_db: str, raising: Any
) -> None:
    raising(signals.lease_released)
    app = fenced_app("signals")

    @app.task(name="signals.build", base=FencedTask, shared=False, lease_key="build:{n}")
    def build(n: int) -> int:
        return n * 2

    retval, info, *_ = trace(build, "task-1", 21)
    assert (retval, info) == (42, None)
    stored = TaskResult.objects.using(lease_db).get(task_id="task-1")
    assert stored.status == states.SUCCESS
    assert Lease.objects.using(lease_db).get(key="build:21").released_at is not None


def test_send__logs_the_receiver_and_returns(
    raising: Any, caplog: pytest.LogCaptureFixture
) -> None:
    raising(signals.stale_write_rejected)
    with caplog.at_level(logging.WARNING, logger="celery_fenced.signals"):
        signals.send(signals.stale_write_rejected, Lease, key="k", token=3, owner="o", current=4)
    assert (
        "receiver tests.integration.test_signals.broken_receiver of celery_fenced signal"
        in caplog.text
    )
    assert "stale_write_rejected" in caplog.text


def test_send__a_listener_of_the_package_is_called_as_a_receiver_and_may_raise(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The package's own listeners (the metrics) are called without Django's dispatch,
    with what a receiver gets; one that raises is logged and the others still run."""
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(signals, "_listeners", listeners_copy())
    signals.listen(signals.stale_write_rejected, broken_receiver)
    signals.listen(signals.stale_write_rejected, lambda **kwargs: calls.append(kwargs))
    signals.listen(signals.stale_write_rejected, broken_receiver)  # once however often
    with caplog.at_level(logging.WARNING, logger="celery_fenced.signals"):
        signals.send(signals.stale_write_rejected, Lease, key="k", token=3, owner="o", current=4)
    assert caplog.text.count("broken_receiver of celery_fenced signal stale_write_rejected") == 1
    assert calls == [
        {
            "signal": signals.stale_write_rejected,
            "sender": Lease,
            "key": "k",
            "token": 3,
            "owner": "o",
            "current": 4,
        }
    ]


@pytest.fixture
def received() -> Iterator[Callable[[Signal], list[dict[str, Any]]]]:
    """Record what a signal is sent with; disconnected afterwards."""
    connected: list[tuple[Signal, Any]] = []

    def listen(signal: Signal) -> list[dict[str, Any]]:
        calls: list[dict[str, Any]] = []

        def receiver(sender: Any, **kwargs: Any) -> None:
            kwargs.pop("signal")
            calls.append({"sender": sender, **kwargs})

        signal.connect(receiver, weak=False)
        connected.append((signal, receiver))
        return calls

    yield listen
    for signal, receiver in connected:
        signal.disconnect(receiver)


@db
def test_lease_busy__sent_with_the_holder_and_the_refused(alias: str, received: Any) -> None:
    calls = received(signals.lease_busy)
    acquire("signals:busy", ttl=30, owner="holder", task_id="t-1", using=alias)
    with pytest.raises(LeaseBusy):
        acquire("signals:busy", ttl=30, owner="refused", task_id="t-2", using=alias)
    assert calls == [
        {
            "sender": Lease,
            "key": "signals:busy",
            "token": 1,
            "owner": "refused",
            "task_id": "t-2",
            "task_name": "",
            "holder": "holder",
        }
    ]


@db
def test_lease_duplicate__sent_when_a_completed_job_comes_back(
    lease_db: str, received: Any
) -> None:
    """Through Celery's tracer: the same message delivered again after its SUCCESS."""
    calls = received(signals.lease_duplicate)
    app = fenced_app("signals")

    @app.task(name="signals.once", base=FencedTask, shared=False, lease_key="once:{n}")
    def once(n: int) -> int:
        return n

    assert trace(once, "task-once", 5)[:2] == (5, None)
    assert calls == []
    trace(once, "task-once", 5)  # a redelivery of the same message
    assert len(calls) == 1
    assert {k: calls[0][k] for k in ("sender", "key", "token", "task_id", "retries")} == {
        "sender": Lease,
        "key": "once:5",
        "token": None,
        "task_id": "task-once",
        "retries": 0,
    }
    assert TaskResult.objects.using(lease_db).get(task_id="task-once").status == states.SUCCESS


@db
def test_busy__logged_with_the_key_the_holders_token_and_the_task_id(
    lease_db: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Through Celery's tracer: a delivery refused by a held key (``on_busy="skip"``)."""
    app = fenced_app("signals")

    @app.task(
        name="signals.skipped",
        base=FencedTask,
        shared=False,
        lease_key="held:{n}",
        lease_on_busy="skip",
    )
    def skipped(n: int) -> int:
        return n  # pragma: no cover - the key is held

    acquire("held:3", ttl=30, owner="holder", using=lease_db)
    with caplog.at_level(logging.INFO, logger="celery_fenced"):
        trace(skipped, "task-skipped", 3)
    (record,) = [r for r in caplog.records if "policy skip" in r.getMessage()]
    assert (record.lease_key, record.fencing_token, record.task_id) == (  # type: ignore[attr-defined]
        "held:3",
        1,
        "task-skipped",
    )


@db
def test_every_signal_is_a_structured_log_record(
    alias: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``celery_fenced.events``: one record per event, its key, token, task and kind in
    ``extra`` (routine grants and releases at DEBUG, the rest at INFO)."""
    import logging

    caplog.set_level(logging.DEBUG, logger="celery_fenced.events")
    held = acquire("logged", ttl=30, task_id="t-1", task_name="app.t", using=alias)
    with pytest.raises(LeaseBusy):
        acquire("logged", ttl=30, task_id="t-2", task_name="app.t", using=alias)
    held.release()
    records = [r for r in caplog.records if r.name == "celery_fenced.events"]
    assert [
        (r.lease_event, r.lease_key, r.fencing_token, r.task_id, r.task_name, r.levelname)  # type: ignore[attr-defined]
        for r in records
    ] == [
        ("acquired", "logged", held.token, "t-1", "app.t", "DEBUG"),
        ("busy", "logged", held.token, "t-2", "app.t", "INFO"),
        ("released", "logged", held.token, "t-1", "app.t", "DEBUG"),
    ]


def test_listen__one_listener_by_uid_as_djangos_dispatch_uid(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A listener added again under its ``uid`` (a module reloaded makes new functions)
    is called once, as Django's ``dispatch_uid`` keeps one receiver."""
    calls: list[str] = []
    monkeypatch.setattr(signals, "_listeners", listeners_copy())
    for made in ("first", "reloaded"):
        signals.listen(
            signals.lease_resent, lambda made=made, **kwargs: calls.append(made), uid="metrics"
        )
    signals.send(signals.lease_resent, Lease, key="k", token=None, owner="o")
    assert calls == ["first"]
