"""Prometheus metrics: fed from the signals, served by the Django view with the
lease database's gauges, on SQLite and PostgreSQL."""

from __future__ import annotations

import re

import pytest
from django.db.models import F
from django.test import Client
from prometheus_client import REGISTRY

from celery_fenced import LeaseBusy, StaleToken, acquire, force_release, metrics, store
from celery_fenced.models import Lease, PendingJob
from tests.conftest import WITH_MARIADB

pytestmark = pytest.mark.django_db(transaction=True, databases=WITH_MARIADB)

TASK = "app.tasks.rebuild"


def value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def expire(alias: str, key: str) -> None:
    Lease.objects.using(alias).filter(key=key).update(expires_at=F("acquired_at"))


def counts() -> dict[str, float]:
    return {
        "acquired": value("celery_fenced_grants_total", task=TASK, kind="acquired"),
        "reclaimed": value("celery_fenced_grants_total", task=TASK, kind="reclaimed"),
        "busy": value("celery_fenced_busy_total", task=TASK),
        "lost": value("celery_fenced_lost_total", task=TASK, reason="refused"),
        "stale": value("celery_fenced_stale_writes_rejected_total", task=TASK, what="guard"),
        "released": value("celery_fenced_released_total", task=TASK, forced="false"),
        "forced": value("celery_fenced_released_total", task="", forced="true"),
        "held": value("celery_fenced_leases_held", task=TASK),
        "delays": value("celery_fenced_takeover_delay_seconds_count", task=TASK),
    }


def test_the_signals_move_the_counters(lease_db: str) -> None:
    before = counts()
    first = acquire("m", ttl=30, task_name=TASK, task_id="a", using=lease_db)
    assert value("celery_fenced_leases_held", task=TASK) == before["held"] + 1
    with pytest.raises(LeaseBusy):
        acquire("m", ttl=30, task_name=TASK, task_id="b", using=lease_db)
    expire(lease_db, "m")
    second = acquire("m", ttl=30, task_name=TASK, task_id="b", using=lease_db)
    with pytest.raises(StaleToken), first.guard():
        pass
    assert second.release()
    acquire("n", ttl=30, task_name=TASK, using=lease_db)
    force_release("n", using=lease_db)
    after = counts()
    moved = {name: after[name] - before[name] for name in before}
    # a, n acquired; b reclaimed; a lost (refused), b released, n still held here
    assert moved == {
        "acquired": 2,
        "reclaimed": 1,
        "busy": 1,
        "lost": 1,
        "stale": 1,
        "released": 1,
        "forced": 1,
        "held": 1,
        "delays": 1,
    }


def test_renewal__its_duration_and_batch_size_observed(lease_db: str) -> None:
    from celery_fenced.renewal import renewer

    before = value("celery_fenced_renewal_batch_size_count")
    lease = acquire("r", ttl=3, renew_interval=0.2, using=lease_db)
    renewer().register(lease)
    try:
        import time

        deadline = time.monotonic() + 60
        while value("celery_fenced_renewal_batch_size_count") == before:
            assert time.monotonic() < deadline, "no renewal observed"
            time.sleep(0.05)
    finally:
        renewer().unregister(lease)
        lease.release()
    assert value("celery_fenced_renewal_seconds_count") > 0


def scrape(client: Client) -> dict[str, float]:
    text = client.get("/metrics/").content.decode()
    return {
        match[1]: float(match[2])
        for match in re.finditer(r"^(celery_fenced_db_\w+) (\S+)$", text, re.MULTILINE)
    }


def test_view__the_lease_databases_gauges(lease_db: str, client: Client) -> None:
    response = client.get("/metrics/")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain")
    text = response.content.decode()
    for metric in (*metrics.METRICS, *metrics.DATABASE_METRICS):
        exposed = f"{metric.name}_total" if metric.type == "counter" else metric.name
        assert f"# TYPE {exposed} {metric.type}" in text
    assert scrape(client) == {
        "celery_fenced_db_leases_held": 0,
        "celery_fenced_db_leases_expired_unreleased": 0,
        "celery_fenced_db_pending_jobs": 0,
    }
    acquire("held", ttl=30, using=lease_db)
    acquire("dead", ttl=30, using=lease_db)
    expire(lease_db, "dead")
    acquire("done", ttl=30, using=lease_db).release()
    _pending(lease_db)
    assert scrape(client) == {
        "celery_fenced_db_leases_held": 1,
        "celery_fenced_db_leases_expired_unreleased": 1,
        "celery_fenced_db_pending_jobs": 1,
    }


def _pending(alias: str) -> PendingJob:
    from django.utils import timezone

    now = timezone.now()
    return PendingJob.objects.using(alias).create(
        task_id="p", task_name=TASK, job="{}", published_at=now, resend_at=now
    )


@pytest.mark.parametrize(
    ("reason", "label"),
    [
        ("the database was unreachable until the grant expired", "database"),
        (store.unrenewed("OperationalError: connection refused"), "database"),
        (store.unrenewed(None), "expired"),
        ("write refused: current token is 4", "refused"),
        ("SUCCESS result refused: current token is 9", "refused"),
        ("renewal failed past the deadline", "expired"),
        ("something else", "other"),
    ],
)
def test_lost_reason__a_few_words_whatever_the_message(reason: str, label: str) -> None:
    assert metrics.lost_reason(reason) == label


def test_metrics_port__validated_by_name() -> None:
    from celery import Celery

    from celery_fenced.conf import load
    from celery_fenced.exceptions import FencedConfigurationError

    app = Celery("metrics-conf", set_as_current=False)
    for bad in (0, 70000, "9100", True):
        app.conf.fenced_metrics_port = bad
        with pytest.raises(FencedConfigurationError, match="fenced_metrics_port must be a TCP"):
            load(app)


@pytest.fixture
def alias(alias_with_mariadb: str) -> str:
    """SQLite, PostgreSQL and MariaDB."""
    return alias_with_mariadb


def test_receivers__count_on_the_children_prometheus_keeps(alias: str) -> None:
    """The labelled child a receiver counts on is looked up once, and is the one the
    registry reads (the same numbers, grant after grant)."""
    before = counts()
    for _ in range(2):
        acquire("metrics:children", ttl=30, task_name=TASK, using=alias).release()
    after = counts()
    assert after["acquired"] == before["acquired"] + 2
    assert after["released"] == before["released"] + 2
    child = metrics._child("celery_fenced_grants", TASK, "acquired")
    assert child is metrics._metric("celery_fenced_grants").labels(TASK, "acquired")
    assert metrics._child("celery_fenced_grants", TASK, "acquired") is child
