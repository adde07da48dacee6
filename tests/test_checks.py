"""Django system checks: a bad setting or USE_TZ = False fails at start."""

from __future__ import annotations

from typing import Any

import pytest
from django.core import checks

from celery_fenced.checks import check_settings


def test_check_settings__project_settings_pass() -> None:
    assert check_settings() == []


@pytest.mark.parametrize(
    ("setting", "value", "fragment"),
    [
        ("CELERY_FENCED_DEFAULT_TTL", 0, "fenced_default_ttl must be a number of seconds"),
        ("CELERY_FENCED_ON_BUSY", "sometimes", "fenced_on_busy must be one of"),
        ("CELERY_FENCED_TASKS", {"mod.*": {"tll": 5}}, "unknown option(s) 'tll'"),
        ("CELERY_FENCED_DATABASE", "nosuch", "fenced_database must name a database alias"),
    ],
)
def test_check_settings__invalid_setting_is_e001(
    settings: Any, setting: str, value: object, fragment: str
) -> None:
    setattr(settings, setting, value)
    errors = check_settings()
    assert [e.id for e in errors] == ["celery_fenced.E001"]
    assert fragment in errors[0].msg


def test_check_settings__use_tz_false_is_e002(settings: Any) -> None:
    settings.USE_TZ = False
    errors = check_settings()
    assert [e.id for e in errors] == ["celery_fenced.E002"]
    assert "USE_TZ = True" in errors[0].msg


def test_check_settings__registered_with_django(settings: Any) -> None:
    settings.CELERY_FENCED_ON_BUSY = "sometimes"
    settings.USE_TZ = False
    errors = checks.run_checks(tags=["celery_fenced"])
    assert sorted(e.id for e in errors) == ["celery_fenced.E001", "celery_fenced.E002"]


def test_check_result_database__same_database_passes() -> None:
    from celery_fenced.checks import check_result_database

    assert check_result_database() == []


def test_check_result_database__results_elsewhere_is_w001(settings: Any) -> None:
    from celery_fenced.checks import check_result_database

    settings.CELERY_FENCED_DATABASE = "postgres"  # results stay on "default"
    warnings = check_result_database()
    assert [w.id for w in warnings] == ["celery_fenced.W001"]
    assert "results to database 'default' but the leases are in 'postgres'" in warnings[0].msg
    assert "CELERY_FENCED_DATABASE = 'default'" in str(warnings[0].hint)
