"""Models and migrations."""

from __future__ import annotations

from typing import Any

import pytest
from django.core.management import call_command
from django.db import IntegrityError, transaction

from celery_fenced.models import Lease
from tests.conftest import MARIADB, WITH_MARIADB


@pytest.fixture
def alias(alias_with_mariadb: str) -> str:
    """SQLite, PostgreSQL and MariaDB."""
    return alias_with_mariadb


@pytest.mark.django_db(databases=WITH_MARIADB)
def test_migrations__match_the_models() -> None:
    call_command("makemigrations", "--check", "--dry-run", verbosity=0)


@pytest.mark.django_db(databases=WITH_MARIADB)
@pytest.mark.parametrize("token", [-1, -5])
def test_lease__database_refuses_a_negative_token(alias: str, token: int) -> None:
    """Token 0 is a key's row before any grant (a ``lease_unique`` copy refused while the
    first still waits records its event there); grants start at 1."""
    from django.utils import timezone

    now = timezone.now()
    with pytest.raises(IntegrityError), transaction.atomic(using=alias):
        Lease.objects.using(alias).create(
            key="k", token=token, owner="o", acquired_at=now, renewed_at=now, expires_at=now
        )


@pytest.mark.django_db(databases=WITH_MARIADB)
def test_lease__database_refuses_a_second_row_for_a_key(alias: str) -> None:
    from django.utils import timezone

    now = timezone.now()
    fields = {"token": 1, "owner": "o", "acquired_at": now, "renewed_at": now, "expires_at": now}
    Lease.objects.using(alias).create(key="k", **fields)
    with pytest.raises(IntegrityError), transaction.atomic(using=alias):
        Lease.objects.using(alias).create(key="k", **fields)


@pytest.mark.django_db(transaction=True, databases=WITH_MARIADB)
@pytest.mark.parametrize(("one", "other"), [("Case-Key", "case-key"), ("pad", "pad "), ("é", "e")])
def test_lease__keys_compare_byte_for_byte(alias: str, one: str, other: str) -> None:
    """Two keys that differ in case, trailing spaces or accents are two leases, whatever
    the database's default collation (MariaDB's ``utf8mb4_general_ci`` makes them one)."""
    from celery_fenced import acquire

    first = acquire(one, ttl=30, using=alias)
    second = acquire(other, ttl=30, using=alias)
    assert (first.token, second.token) == (1, 1)
    assert sorted(Lease.objects.using(alias).values_list("key", flat=True)) == sorted(
        ["Case-Key", "case-key"] if one == "Case-Key" else [one, other]
    )
    assert Lease.objects.using(alias).filter(key=one).get().token == 1


@pytest.mark.django_db(databases=WITH_MARIADB)
def test_check_database_clock__names_a_mysql_session_not_in_utc(settings: Any) -> None:
    """E006: MariaDB's ``CURRENT_TIMESTAMP`` is in the session's time zone, Django's
    datetimes are UTC: the check names the setting that makes them agree."""
    from django.db import connections

    from celery_fenced.checks import check_database_clock

    settings.CELERY_FENCED_DATABASE = MARIADB
    connection = connections[MARIADB]
    with connection.cursor() as cursor:
        cursor.execute("SET time_zone = '+05:30'")
    try:
        errors = check_database_clock(databases=[MARIADB])
        assert [e.id for e in errors] == ["celery_fenced.E006"]
        assert "+330 minutes from UTC" in errors[0].msg
        assert "init_command" in (errors[0].hint or "")
        assert check_database_clock(databases=["default"]) == []  # not asked: no query
    finally:
        with connection.cursor() as cursor:
            cursor.execute("SET time_zone = '+00:00'")
    assert check_database_clock(databases=[MARIADB]) == []


@pytest.mark.django_db(transaction=True, databases=WITH_MARIADB)
@pytest.mark.parametrize(("one", "other"), [("Job-1", "job-1"), ("t", "t "), ("é", "e")])
def test_task_ids_compare_byte_for_byte(alias: str, one: str, other: str) -> None:
    """Two jobs whose task ids differ in case, trailing spaces or accents are two jobs in
    the outbox and on the leases, as on PostgreSQL: the second's publish does not replace
    the first's pending row (its job would be sent again under the other's task id), its
    grant does not end the first's row, and a report of one never ends the other's grant."""
    from celery_fenced import store
    from celery_fenced.models import PendingJob
    from celery_fenced.store.types import Pending

    def pending(task_id: str) -> Pending:
        return Pending(
            task_id, "t.n", f"key:{task_id}", f'{{"id": "{task_id}"}}', None, None, None, 60
        )

    store.record_pending(alias, pending(one))
    store.record_pending(alias, pending(other))
    rows = dict(PendingJob.objects.using(alias).values_list("task_id", "job"))
    assert rows == {one: f'{{"id": "{one}"}}', other: f'{{"id": "{other}"}}'}
    held = store.grant("k", ttl=30, task_id=one, owner="w@h:7:1", using=alias, ends_pending=True)
    assert set(PendingJob.objects.using(alias).values_list("task_id", flat=True)) == {other}
    # the main process reports that the process of ``other`` ended: not ``one``'s grant
    assert store.settle_elsewhere(other, process="w@h:7:", by="worker:failure", using=alias)
    held.renew()


@pytest.mark.django_db(transaction=True, databases=WITH_MARIADB)
def test_check_result_ids__names_a_beat_column_given_back_a_folding_collation(
    settings: Any,
) -> None:
    """E007 on the beat's entry names (made binary by 0014): an ``AlterField`` of the
    column writes it with the table's folding collation; the check names it and the
    statement that mends it, and says nothing before 0014 is applied."""
    from django.db import connections
    from django.db.migrations.recorder import MigrationRecorder

    from celery_fenced.collations import BEAT_MIGRATION, check_result_ids
    from tests import routers

    routers.TARGET = MARIADB
    settings.DATABASE_ROUTERS = ["tests.routers.AllToTarget"]
    connection = connections[MARIADB]
    assert check_result_ids(databases=[MARIADB]) == []
    with connection.cursor() as cursor:  # what Django's AlterField writes: no collation
        cursor.execute("ALTER TABLE celery_fenced_beatentry MODIFY name varchar(200) NOT NULL")
    recorder = MigrationRecorder(connection)
    try:
        errors = check_result_ids(databases=[MARIADB])
        assert [(e.id, e.obj) for e in errors] == [
            ("celery_fenced.E007", "celery_fenced_beatentry.name")
        ]
        assert "0014_mysql_beat_names" in (errors[0].hint or "")
        recorder.record_unapplied(*BEAT_MIGRATION)
        assert check_result_ids(databases=[MARIADB]) == []  # migrate must run to apply it
        recorder.record_applied(*BEAT_MIGRATION)
        with connection.cursor() as cursor:  # the hint's statement
            cursor.execute((errors[0].hint or "").split(": ", 1)[1].rstrip(";"))
        assert check_result_ids(databases=[MARIADB]) == []
    finally:
        if BEAT_MIGRATION not in recorder.applied_migrations():
            recorder.record_applied(*BEAT_MIGRATION)
        routers.TARGET = "default"
        with connection.cursor() as cursor:
            cursor.execute(
                "ALTER TABLE celery_fenced_beatentry MODIFY name varchar(200) "
                "CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin NOT NULL"
            )


@pytest.mark.django_db(transaction=True, databases=WITH_MARIADB)
def test_check_result_ids__names_a_result_column_given_back_a_folding_collation(
    settings: Any,
) -> None:
    """E007: a later django-celery-results migration that rewrites ``task_id`` gives it
    the table's case-insensitive collation again; the check names the column and the
    statement that mends it, and says nothing before migration 0010 is applied."""
    from django.db import connections
    from django.db.migrations.recorder import MigrationRecorder

    from celery_fenced.collations import MIGRATION, check_result_ids
    from tests import routers

    routers.TARGET = MARIADB
    settings.DATABASE_ROUTERS = ["tests.routers.AllToTarget"]
    connection = connections[MARIADB]
    assert check_result_ids(databases=[MARIADB]) == []
    with connection.cursor() as cursor:  # what Django's AlterField writes: no collation
        cursor.execute(
            "ALTER TABLE django_celery_results_taskresult MODIFY task_id varchar(255) NOT NULL"
        )
    recorder = MigrationRecorder(connection)
    try:
        errors = check_result_ids(databases=[MARIADB])
        assert [(e.id, e.obj) for e in errors] == [
            ("celery_fenced.E007", "django_celery_results_taskresult.task_id")
        ]
        assert check_result_ids(databases=["default"]) == []  # not asked: no query
        recorder.record_unapplied(*MIGRATION)
        assert check_result_ids(databases=[MARIADB]) == []  # migrate must run to apply it
        recorder.record_applied(*MIGRATION)
        with connection.cursor() as cursor:  # the hint's statement
            cursor.execute((errors[0].hint or "").split(": ", 1)[1].rstrip(";"))
        assert check_result_ids(databases=[MARIADB]) == []
    finally:
        if MIGRATION not in recorder.applied_migrations():
            recorder.record_applied(*MIGRATION)
        routers.TARGET = "default"
        with connection.cursor() as cursor:
            cursor.execute(
                "ALTER TABLE django_celery_results_taskresult MODIFY task_id varchar(255) "
                "CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin NOT NULL"
            )
