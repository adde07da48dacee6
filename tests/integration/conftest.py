"""The integration layer needs PostgreSQL and Redis: `bash tests/run.sh` starts them.

The fixtures its modules share are here (never imported from a test module).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery, signals
from django.apps import apps
from django.contrib.auth.management import create_permissions
from django.contrib.auth.models import Permission, User
from django.db import connections, router
from django.test import Client

from celery_fenced import hooks
from tests.conftest import require_servers
from tests.integration import test_job_identity, test_sending
from tests.integration.test_seams import FAILING, GATES, RUNS, Broker, make_app


def pytest_configure(config: pytest.Config) -> None:
    require_servers()


@pytest.fixture
def prepared_pg(lease_db: str, settings: Any) -> Iterator[str]:
    """The PostgreSQL alias, ``fenced_prepare`` on, on a new session (skipped elsewhere:
    the store's statements are prepared on PostgreSQL only)."""
    if lease_db != "postgres":
        pytest.skip("the store's statements are prepared on PostgreSQL only")
    settings.CELERY_FENCED_PREPARE = True
    connections[lease_db].close()
    yield lease_db
    connections[lease_db].close()


@pytest.fixture
def broker(lease_db: str) -> Iterator[Broker]:
    app = make_app()
    recorded = Broker(app)
    signals.before_task_publish.connect(recorded.record, weak=False)
    GATES.clear()
    FAILING.clear()
    RUNS.clear()
    yield recorded
    signals.before_task_publish.disconnect(recorded.record)
    for gate in GATES.values():
        gate.set()


@pytest.fixture
def web(lease_db: str) -> Iterator[tuple[Celery, Celery, Broker]]:
    """(the web process's app, the worker's app, what reached the broker). Both exist when
    Django loads celery_fenced, as a project's Celery app does."""
    publisher, worker = test_sending.configured("web"), test_sending.worker_app()
    hooks.fence_in_every_process()  # what celery_fenced's AppConfig.ready() does
    recorded = Broker(publisher)
    signals.before_task_publish.connect(recorded.record, weak=False)
    test_sending.RUNS.clear()
    yield publisher, worker, recorded
    signals.before_task_publish.disconnect(recorded.record)


@pytest.fixture
def login(client: Client) -> Callable[..., Client]:
    """Log ``client`` in as a staff user holding the given celery_fenced permissions."""

    def log_in(*codenames: str, username: str = "alice") -> Client:
        # a flush took them (they are not made again after each test: tests/conftest.py)
        create_permissions(
            apps.get_app_config("celery_fenced"),
            verbosity=0,
            using=router.db_for_write(Permission),
        )
        user = User.objects.create_user(username, password="pw", is_staff=True)
        perms = Permission.objects.filter(
            content_type__app_label="celery_fenced", codename__in=codenames
        )
        assert perms.count() == len(codenames), codenames
        user.user_permissions.add(*perms)
        client.force_login(user)
        return client

    return log_in


@pytest.fixture
def capture() -> Iterator[Any]:
    """``capture(app)``: a :class:`Broker` recording what ``app`` publishes."""
    brokers: list[Broker] = []

    def start(app: Celery) -> Broker:
        recorded = Broker(app)
        signals.before_task_publish.connect(recorded.record, weak=False)
        brokers.append(recorded)
        return recorded

    test_job_identity.RUNS.clear()
    yield start
    for recorded in brokers:
        signals.before_task_publish.disconnect(recorded.record)
