"""The metrics, the package's own listeners of its signals: a user's Django receiver of
the same signals gets every event exactly once, and the metrics count each once, with the
app's ready() run twice and metrics.connect() called again."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from django.apps import apps
from django.db.models import F
from prometheus_client import REGISTRY

from celery_fenced import LeaseBusy, LeaseLost, acquire, metrics, signals
from celery_fenced.models import Lease
from tests.integration.test_signals import listeners_copy

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "postgres"])

TASK = "attack.listeners"
SIGNALS = [
    "lease_acquired",
    "lease_busy",
    "lease_lost",
    "lease_released",
    "stale_write_rejected",
    "lease_duplicate",
    "lease_resent",
    "lease_abandoned",
    "lease_deduplicated",
    "grant_ended",
]


def value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def scenario() -> None:
    first = acquire("lx", ttl=30, task_name=TASK, task_id="t1", using="postgres")
    with pytest.raises(LeaseBusy):
        acquire("lx", ttl=30, task_name=TASK, task_id="t2", using="postgres")
    Lease.objects.using("postgres").filter(key="lx").update(expires_at=F("acquired_at"))
    second = acquire("lx", ttl=30, task_name=TASK, task_id="t3", using="postgres")  # a takeover
    with pytest.raises(LeaseLost):
        first.renew()
    second.release()


@pytest.mark.parametrize("readies", [1, 2, 3])
def test_user_receiver__each_event_once__metrics_once(
    readies: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The app made ready ``readies`` times: a user's receiver gets each event once, and
    the metrics count it once."""
    monkeypatch.setattr(signals, "_listeners", listeners_copy())
    config = apps.get_app_config("celery_fenced")
    for _ in range(readies):
        config.ready()  # apps.ready twice (tests), metrics.connect() again
        metrics.connect()
    assert all(len(v) == len({id(f) for f in v.values()}) for v in signals._listeners.values())
    got: Counter[str] = Counter()
    receivers = {}
    for name in SIGNALS:

        def receiver(sender: Any, _name: str = name, **kwargs: Any) -> None:
            got[_name] += 1

        receivers[name] = receiver
        getattr(signals, name).connect(receiver, weak=False)
        getattr(signals, name).connect(receiver, weak=False)  # twice: Django dedupes
    before = {
        k: value("celery_fenced_grants_total", task=TASK, kind=k)
        for k in ("acquired", "reclaimed")
    }
    busy0 = value("celery_fenced_busy_total", task=TASK)
    try:
        scenario()
    finally:
        for name, receiver in receivers.items():
            getattr(signals, name).disconnect(receiver)
    assert got["lease_acquired"] == 2
    assert got["lease_busy"] == 1
    assert got["lease_lost"] == 1
    assert got["lease_released"] == 1
    assert got["grant_ended"] == 2
    moved = {
        k: value("celery_fenced_grants_total", task=TASK, kind=k) - v for k, v in before.items()
    }
    assert moved == {"acquired": 1, "reclaimed": 1}
    assert value("celery_fenced_busy_total", task=TASK) - busy0 == 1
