"""The integration layer needs PostgreSQL and Redis: `bash tests/run.sh` starts them."""

from __future__ import annotations

import pytest

from tests.conftest import require_servers
from tests.integration.test_seams import broker  # noqa: F401 (the fixture, for other modules)


def pytest_configure(config: pytest.Config) -> None:
    require_servers()
