"""A database router for tests that sends every model to one alias."""

from __future__ import annotations

from typing import Any

TARGET = "default"


class AllToTarget:
    def db_for_read(self, model: Any, **hints: Any) -> str:
        return TARGET

    def db_for_write(self, model: Any, **hints: Any) -> str:
        return TARGET

    def allow_relation(self, obj1: Any, obj2: Any, **hints: Any) -> bool:
        return True

    def allow_migrate(self, db: str, app_label: str, **hints: Any) -> None:
        return None


class PrimaryReplica(AllToTarget):
    """Django's usual primary/replica router: reads from ``TARGET``'s replica."""

    def db_for_read(self, model: Any, **hints: Any) -> str:
        return f"{TARGET}_replica"
