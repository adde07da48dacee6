"""Shared fixtures: every database test runs on SQLite *and* PostgreSQL."""

from __future__ import annotations

import os

import pytest
from django.conf import settings

DATABASE_ALIASES = ["default", "postgres"]


def pytest_configure(config: pytest.Config) -> None:
    if "postgres" not in settings.DATABASES:
        raise pytest.UsageError(
            "PostgreSQL is not configured (FENCED_PG_PORT is unset): run the suite with "
            "`bash tests/run.sh`, which starts a throwaway server. There is no silent "
            "fallback to SQLite."
        )


@pytest.fixture(params=DATABASE_ALIASES, ids=["sqlite", "postgres"])
def alias(request: pytest.FixtureRequest) -> str:
    """A database alias; the test runs once per database."""
    return str(request.param)


@pytest.fixture
def child_env() -> dict[str, str]:
    """Environment for processes the tests start: the test databases, this checkout."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return {
        **os.environ,
        "FENCED_USE_TEST_DATABASES": "1",
        "DJANGO_SETTINGS_MODULE": "testproject.settings",
        "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
