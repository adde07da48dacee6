"""The acceptance layer needs PostgreSQL and Redis: `bash tests/run.sh` starts them."""

from __future__ import annotations

import pytest

from tests.conftest import require_servers


def pytest_configure(config: pytest.Config) -> None:
    require_servers()
