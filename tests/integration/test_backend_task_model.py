"""A FencedDatabaseBackend subclass with a TaskModel of its own stores its results there."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connections, models
from django.test.utils import isolate_apps
from django_celery_results.managers import TaskResultManager
from django_celery_results.models import TaskResult

from celery_fenced import store
from celery_fenced.backends import FencedDatabaseBackend
from celery_fenced.store import Delivery
from testproject.celery import app
from tests import routers
from tests.conftest import WITH_MARIADB
from tests.integration.test_backends import request_for

pytestmark = pytest.mark.django_db(transaction=True, databases=WITH_MARIADB)


def _result_model_like_task_result() -> type[models.Model]:
    """TaskResult's fields on a table of its own."""
    attrs: dict[str, Any] = {
        "__module__": __name__,
        "Meta": type("Meta", (), {"app_label": "demo", "db_table": "tests_own_task_result"}),
        "objects": TaskResultManager(),
        "as_dict": TaskResult.as_dict,
    }
    for field in TaskResult._meta.concrete_fields:
        if not field.primary_key:
            name, _, args, kwargs = field.deconstruct()
            attrs[name] = type(field)(*args, **kwargs)
    return type("OwnTaskResult", (models.Model,), attrs)


@pytest.fixture
def own_model(alias: str, settings: Any) -> Iterator[type[models.Model]]:
    """The model, on ``alias``; in a registry of its own, so no migration ever sees it."""
    with isolate_apps("testproject.demo"):
        model = _result_model_like_task_result()
    routers.TARGET = alias
    settings.DATABASE_ROUTERS = ["tests.routers.AllToTarget"]
    with connections[alias].schema_editor() as editor:
        editor.create_model(model)
    yield model
    with connections[alias].schema_editor() as editor:
        editor.delete_model(model)
    routers.TARGET = "default"


def test_own_task_model__fenced_success_is_stored_in_it(
    alias: str, own_model: type[models.Model]
) -> None:
    """Not in django-celery-results' table: the one-statement success (PostgreSQL) writes
    that table only, so a backend with its own model settles the transaction way."""
    backend = type("OwnModelBackend", (FencedDatabaseBackend,), {"TaskModel": own_model})(app=app)
    lease = store.grant(
        "job", ttl=30, task_id="t1", using=alias, delivery=Delivery("t1", "d" * 32, 0)
    )
    backend.mark_as_done("t1", {"answer": 42}, request=request_for("t1", lease))
    assert not TaskResult.objects.using(alias).filter(task_id="t1").exists()
    assert backend.get_task_meta("t1")["status"] == "SUCCESS"
    assert lease.released


@pytest.fixture
def alias(alias_with_mariadb: str) -> str:
    """SQLite, PostgreSQL and MariaDB."""
    return alias_with_mariadb
