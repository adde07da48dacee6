"""The MySQL family (MariaDB, MySQL): ids compared byte for byte, as on PostgreSQL and SQLite.

The family's default collations compare ``'Job-1'`` equal to ``'job-1'``, ``'t'`` to
``'t '`` and ``'é'`` to ``'e'``. A column holding a lease key, a task id or a group id gets
the binary NO PAD collation instead (MariaDB's ``utf8mb4_nopad_bin``, MySQL 8's
``utf8mb4_0900_bin``): the package's own columns from migrations 0008 and 0009,
django-celery-results' result and group ids from 0010, the beat's keys, entry names and
tick task ids from 0014. A later migration (django-celery-results', or an ``AlterField``
of ours) that alters one of those columns writes it without a collation, giving it back
the table's default; system check ``celery_fenced.E007`` names such a column and the
statement that mends it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from django.apps import apps
from django.core import checks
from django.db import DatabaseError, connections, router
from django.db.migrations.recorder import MigrationRecorder

#: the migration that gives them the binary collation
MIGRATION = ("celery_fenced", "0010_mysql_result_ids")
#: (table, column) of every column of django-celery-results naming a task or a group: one
#: job's result row, one group's result and chord counter
RESULT_ID_COLUMNS = (
    ("django_celery_results_taskresult", "task_id"),
    ("django_celery_results_groupresult", "group_id"),
    ("django_celery_results_chordcounter", "group_id"),
)
#: the migration that gives the beat's columns the binary collation, and those columns
BEAT_MIGRATION = ("celery_fenced", "0014_mysql_beat_names")
BEAT_COLUMNS = (
    ("celery_fenced_beatentry", "beat_key"),
    ("celery_fenced_beatentry", "name"),
    ("celery_fenced_beatentry", "task_id"),
)


class Column(NamedTuple):
    """A varchar column as MariaDB or MySQL reports it (``information_schema``)."""

    table: str
    name: str
    length: int
    nullable: bool
    collation: str


def binary_collation(connection: Any) -> str:
    """The family's binary NO PAD collation: ``'pad '`` is not ``'pad'`` (``utf8mb4_bin``
    pads, so it would compare them equal)."""
    return "utf8mb4_nopad_bin" if connection.mysql_is_mariadb else "utf8mb4_0900_bin"


def columns(connection: Any, names: tuple[tuple[str, str], ...]) -> list[Column]:
    """The varchar columns ``names`` as the current database has them (a missing table or
    column is left out)."""
    wanted = " OR ".join(["(TABLE_NAME = %s AND COLUMN_NAME = %s)"] * len(names))
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT TABLE_NAME, COLUMN_NAME, CHARACTER_MAXIMUM_LENGTH, IS_NULLABLE, "
            "COLLATION_NAME FROM information_schema.COLUMNS "
            f"WHERE TABLE_SCHEMA = DATABASE() AND ({wanted})",
            [part for name in names for part in name],
        )
        found = cursor.fetchall()
    return [
        Column(t, c, int(n), nullable == "YES", collation)
        for t, c, n, nullable, collation in found
    ]


def binary_sql(connection: Any, column: Column) -> str:
    """The statement that gives ``column`` the binary NO PAD collation, its type, length,
    nullability and indexes unchanged."""
    quote = connection.ops.quote_name
    return (
        f"ALTER TABLE {quote(column.table)} MODIFY {quote(column.name)} "
        f"varchar({column.length}) CHARACTER SET utf8mb4 "
        f"COLLATE {binary_collation(connection)} {'NULL' if column.nullable else 'NOT NULL'}"
    )


class Binary(NamedTuple):
    """Columns a migration of ours made binary, and what folding them again would do."""

    migration: tuple[str, str]
    app_label: str
    columns: tuple[tuple[str, str], ...]
    harm: str
    rewriter: str


#: every group of columns E007 reads: django-celery-results' ids (0010), and the beat
#: keys, entry names and tick task ids of :class:`~celery_fenced.models.BeatEntry` (0014)
CHECKED = (
    Binary(
        MIGRATION,
        "django_celery_results",
        RESULT_ID_COLUMNS,
        "one job's result be read as another's",
        "A django-celery-results migration",
    ),
    Binary(
        BEAT_MIGRATION,
        "celery_fenced",
        BEAT_COLUMNS,
        "one beat entry's ticks be counted as another's",
        "A migration",
    ),
)


def check_result_ids(databases: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """E007: django-celery-results' task and group ids, and the names of the fenced beat's
    entries, compare byte for byte (the MySQL family) once migrations 0010 and 0014 have
    made them so.

    A database check: it reads each model's database when that is among ``databases`` (a
    worker's start reads the lease database, ``migrate`` and ``check --database`` the ones
    named). Before a group's migration is applied it says nothing of that group:
    ``migrate`` runs the checks first, and must not refuse to apply the migration that
    mends the columns.
    """
    if not databases:
        return []  # not asked to read a database
    errors: list[checks.CheckMessage] = []
    for group in CHECKED:
        if apps.is_installed(group.app_label):  # else E004 (django-celery-results)
            errors += _check_binary(group, databases)
    return errors


def _check_binary(group: Binary, databases: Any) -> list[checks.CheckMessage]:
    errors: list[checks.CheckMessage] = []
    for model in apps.get_app_config(group.app_label).get_models():
        table = model._meta.db_table
        names = tuple((t, c) for t, c in group.columns if t == table)
        if not names:
            continue
        alias = router.db_for_write(model)
        connection = connections[alias]
        if alias not in databases or connection.vendor != "mysql":
            continue
        try:
            if group.migration not in MigrationRecorder(connection).applied_migrations():
                continue  # an unapplied migration; ``migrate`` (which runs this) applies it
            found = columns(connection, names)
        except DatabaseError:
            continue  # not reachable now: the first write says so
        errors += [
            checks.Error(
                f"{table}.{column.name} in database {alias!r} has collation "
                f"{column.collation!r}: two ids that differ only in case or trailing spaces "
                f"would share one row there, and {group.harm}.",
                hint=f"{group.rewriter} applied after celery_fenced's {group.migration[1]} "
                f"rewrote the column. Run in `python manage.py dbshell --database {alias}`: "
                f"{binary_sql(connection, column)};",
                obj=f"{table}.{column.name}",
                id="celery_fenced.E007",
            )
            for column in sorted(found, key=lambda column: column.name)
            if column.collation != binary_collation(connection)
        ]
    return errors
