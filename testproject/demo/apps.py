from __future__ import annotations

from typing import Any

from django.apps import AppConfig
from django.db.backends.signals import connection_created


def _sqlite_wal(sender: Any, connection: Any, **kwargs: Any) -> None:
    """SQLite in WAL mode: readers never block the writer; writers wait (busy timeout)."""
    if connection.vendor == "sqlite":
        with connection.cursor() as cursor:
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=NORMAL")


class DemoConfig(AppConfig):
    name = "testproject.demo"
    label = "demo"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        connection_created.connect(_sqlite_wal, dispatch_uid="testproject.demo.wal")
