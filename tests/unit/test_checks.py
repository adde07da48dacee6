"""Django system checks: a bad setting or USE_TZ = False fails at start."""

from __future__ import annotations

from typing import Any

import pytest
from django.core import checks
from django.db import connections

from celery_fenced.checks import check_settings
from celery_fenced.execution import FencedTask
from tests.unit.test_hooks import fresh_app


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


def test_check_settings__task_option_typo_says_did_you_mean(settings: Any) -> None:
    settings.CELERY_FENCED_TASKS = {"mod.*": {"tll": 6}}
    (error,) = check_settings()
    assert error.id == "celery_fenced.E001"
    assert (
        "fenced_tasks['mod.*'] has unknown option(s) 'tll' (did you mean 'ttl'?); allowed: "
        "ttl, key," in error.msg
    )


def test_check_settings__several_option_typos_each_with_its_guess(settings: Any) -> None:
    settings.CELERY_FENCED_TASKS = {"mod.*": {"tll": 6, "kye": "k", "zzz": 1}}
    (error,) = check_settings()
    assert "(did you mean 'key' for 'kye', 'ttl' for 'tll'?)" in error.msg


@pytest.mark.parametrize(
    ("setting", "value", "where", "obj"),
    [
        ("CELERY_FENCED_DEFAULT_TTL", 0.5, "fenced_default_ttl is 0.5s", "fenced_default_ttl"),
        (
            "CELERY_FENCED_TASKS",
            {"mod.*": {"ttl": 0.05}},
            "fenced_tasks['mod.*'] ttl is 0.05s",
            "fenced_tasks",
        ),
    ],
)
def test_check_settings__ttl_below_a_second_is_e008(
    settings: Any, setting: str, value: object, where: str, obj: str
) -> None:
    setattr(settings, setting, value)
    (error,) = check_settings()
    assert (error.id, error.obj) == ("celery_fenced.E008", obj)
    assert f"{where}, below 1s: too short to renew" in error.msg
    assert "SILENCED_SYSTEM_CHECKS" in str(error.hint)


def test_check_settings__ttl_of_a_second_passes(settings: Any) -> None:
    settings.CELERY_FENCED_DEFAULT_TTL = 1
    settings.CELERY_FENCED_TASKS = {"mod.*": {"ttl": 1.0}}
    assert check_settings() == []


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

    settings.CELERY_FENCED_DATABASE = "default_replica"  # results stay on "default"
    warnings = check_result_database()
    assert [w.id for w in warnings] == ["celery_fenced.W001"]
    assert (
        "results to database 'default' but the leases are in 'default_replica'" in warnings[0].msg
    )
    assert "CELERY_FENCED_DATABASE = 'default'" in str(warnings[0].hint)


# -- E003: unknown setting names -------------------------------------------------------
@pytest.mark.parametrize(
    ("setting", "suggestion", "effect"),
    [
        ("CELERY_FENCED_TASK", "CELERY_FENCED_TASKS", "the tasks it names run unfenced"),
        ("CELERY_FENCED_DEFUALT_TTL", "CELERY_FENCED_DEFAULT_TTL", "the default applies"),
        ("CELERY_FENCED_RENEW_INTERVL", "CELERY_FENCED_RENEW_INTERVAL", "the default applies"),
    ],
)
def test_check_unknown_settings__django_name_with_did_you_mean(
    settings: Any, setting: str, suggestion: str, effect: str
) -> None:
    from celery_fenced.checks import check_unknown_settings

    setattr(settings, setting, {"x": {}})
    errors = check_unknown_settings()
    assert [(e.id, e.obj) for e in errors] == [("celery_fenced.E003", setting)]
    assert f"{setting} is not a celery-fenced setting" in errors[0].msg
    assert f"Did you mean {suggestion}?" in errors[0].msg
    assert effect in errors[0].msg
    assert "CELERY_FENCED_DEFAULT_TTL" in str(errors[0].hint)


@pytest.mark.parametrize(
    ("setting", "suggestion", "effect"),
    [
        ("CELERY_FENCE_TASKS", "CELERY_FENCED_TASKS", "the tasks it names run unfenced"),
        ("CELERY_FENCING_TASKS", "CELERY_FENCED_TASKS", "the tasks it names run unfenced"),
        ("CELERY_FENCEDTASKS", "CELERY_FENCED_TASKS", "the tasks it names run unfenced"),
        ("FENCED_TASKS", "CELERY_FENCED_TASKS", "the tasks it names run unfenced"),
        ("CELERY_FENCED_TTL", "CELERY_FENCED_DEFAULT_TTL", "the default applies"),
        ("CELERY_FENCED_LIMIT", "CELERY_FENCED_DEFAULT_LIMIT", "the default applies"),
        ("CELERY_FENCE_ON_BUSY", "CELERY_FENCED_ON_BUSY", "the default applies"),
    ],
)
def test_check_unknown_settings__prefix_typo_with_did_you_mean(
    settings: Any, setting: str, suggestion: str, effect: str
) -> None:
    from celery_fenced.checks import check_unknown_settings

    setattr(settings, setting, 5)
    errors = check_unknown_settings()
    assert [(e.id, e.obj) for e in errors] == [("celery_fenced.E003", setting)]
    assert f"{setting} is not a celery-fenced setting" in errors[0].msg
    assert f"Did you mean {suggestion}?" in errors[0].msg
    assert effect in errors[0].msg


@pytest.mark.parametrize("setting", ["FENCE_HEIGHT", "FENCED_GARDEN", "CELERY_RESULT_EXPIRES"])
def test_check_unknown_settings__other_settings_pass(settings: Any, setting: str) -> None:
    from celery_fenced.checks import check_unknown_settings

    setattr(settings, setting, 5)
    assert check_unknown_settings() == []


def test_check_unknown_settings__celery_app_name(settings: Any) -> None:
    from celery_fenced.checks import check_unknown_settings, run

    app = fresh_app(fenced_defualt_ttl=5)
    errors, _ = run(app)
    assert [e.id for e in errors] == ["celery_fenced.E003"]
    assert "Did you mean fenced_default_ttl?" in errors[0].msg
    assert check_unknown_settings() == []  # the project's own app has no such name


def test_check_unknown_settings__known_names_pass(settings: Any) -> None:
    from celery_fenced.checks import check_unknown_settings

    settings.CELERY_FENCED_DEFAULT_TTL = 5
    settings.CELERY_FENCED_TASKS = {}
    assert check_unknown_settings() == []


# -- the fenced tasks against the backend, the broker and each other ---------------------
def task_messages(app: Any, name: str | None = None) -> list[Any]:
    """The check_tasks messages of ``app`` (about ``name`` only, when given)."""
    from celery_fenced.checks import run

    errors, warnings = run(app)
    found = [*errors, *warnings]
    return [m for m in found if name is None or m.obj == name]


def noop() -> None:
    pass


def test_check_tasks__project_passes() -> None:
    from celery_fenced.task_checks import check_tasks

    assert check_tasks() == []


@pytest.mark.parametrize("backend", ["django-db", "redis://127.0.0.1:1/0"])
def test_check_tasks__results_not_fenced_is_w002(backend: str) -> None:
    app = fresh_app(result_backend=backend)
    warnings = [m for m in task_messages(app) if m.id == "celery_fenced.W002"]
    assert len(warnings) == 1
    assert "mod.build" in warnings[0].msg
    assert f"result_backend {backend!r}" in warnings[0].msg
    assert "the results are not fenced" in warnings[0].msg
    assert "fenced-db" in str(warnings[0].hint)


@pytest.mark.parametrize("backend", ["fenced-db", "celery_fenced.backends:FencedDatabaseBackend"])
def test_check_tasks__fenced_result_backend_passes(backend: str) -> None:
    app = fresh_app(result_backend=backend)
    assert task_messages(app) == []


def test_check_tasks__no_result_backend_is_w008() -> None:
    app = fresh_app(result_backend=None)
    (warning,) = task_messages(app)
    assert warning.id == "celery_fenced.W008"
    assert "1 fenced task(s) (mod.build), but no result_backend is set" in warning.msg
    assert "AsyncResult.get() raises NotImplementedError" in warning.msg
    assert 'CELERY_RESULT_BACKEND = "fenced-db"' in str(warning.hint)


def test_check_tasks__acks_late_false_is_w003() -> None:
    app = fresh_app()
    app.task(name="mod.early", base=FencedTask, acks_late=False, shared=False)(noop)
    app.task(
        name="mod.early_keyed", base=FencedTask, acks_late=False, lease_key="k", shared=False
    )(noop)
    (default,) = task_messages(app, "mod.early")
    assert default.id == "celery_fenced.W003"
    assert "acknowledged before the body runs" in default.msg
    assert "only the reclaimer sends it again" in default.msg
    (keyed,) = task_messages(app, "mod.early_keyed")
    assert "nothing sends it again: the job is gone" in keyed.msg
    assert task_messages(app, "mod.build") == []


def test_check_tasks__ttl_above_visibility_timeout_is_w004() -> None:
    app = fresh_app(
        broker_url="redis://127.0.0.1:1/0",
        broker_transport_options={"visibility_timeout": 20},
    )
    (warning,) = task_messages(app, "mod.build")  # lease_ttl=30
    assert warning.id == "celery_fenced.W004"
    assert "lease ttl 30s is longer than the broker's visibility_timeout (20s)" in warning.msg
    assert "redis redelivers an unacknowledged message after 20s" in warning.msg
    assert "is retried until the lease is free" in warning.msg


def test_check_tasks__time_limit_above_visibility_timeout_is_w005() -> None:
    app = fresh_app(broker_url="redis://127.0.0.1:1/0", task_time_limit=7200)
    (warning,) = task_messages(app, "mod.build")  # default visibility timeout: 3600 s
    assert warning.id == "celery_fenced.W005"
    assert "hard time limit 7200s is longer than the broker's visibility_timeout (3600s)" in (
        warning.msg
    )
    assert "redelivered by redis while it still holds its lease" in warning.msg


def test_check_tasks__skip_with_short_visibility_timeout_says_the_job_is_lost() -> None:
    app = fresh_app(
        broker_url="sqs://",
        broker_transport_options={"visibility_timeout": 10},
        fenced_on_busy="skip",
    )
    (warning,) = task_messages(app, "mod.build")
    assert "is dropped (on_busy='skip'): the job is lost" in warning.msg


def test_check_tasks__filesystem_broker_has_no_visibility_timeout() -> None:
    app = fresh_app(broker_url="filesystem://", task_time_limit=7200)
    assert task_messages(app, "mod.build") == []


def test_check_tasks__renew_interval_above_half_the_ttl_is_w006() -> None:
    app = fresh_app()
    app.task(
        name="mod.tight", base=FencedTask, lease_ttl=10, lease_renew_interval=8, shared=False
    )(noop)
    (warning,) = task_messages(app, "mod.tight")
    assert warning.id == "celery_fenced.W006"
    assert "renew interval 8s is more than half its lease ttl (10s)" in warning.msg


def test_check_tasks__task_options_that_do_not_fit_the_settings_are_e001() -> None:
    app = fresh_app(fenced_renew_interval=45)  # mod.build has lease_ttl=30
    errors = [m for m in task_messages(app) if m.id == "celery_fenced.E001"]
    assert len(errors) == 1
    assert "task 'mod.build'" in errors[0].msg  # the first fenced task that does not fit
    assert "must be shorter than the lease ttl" in errors[0].msg


def test_check_tasks__configured_key_template_naming_no_argument_is_e001() -> None:
    app = fresh_app(fenced_tasks={"mod.add": {"key": "add:{z}"}})
    errors = [m for m in task_messages(app) if m.id == "celery_fenced.E001"]
    assert len(errors) == 1
    assert "'mod.add': lease_key 'add:{z}' names z" in errors[0].msg


def test_check_tasks__lease_ttl_below_a_second_is_e008() -> None:
    app = fresh_app()
    app.task(name="mod.quick", base=FencedTask, lease_ttl=0.05, shared=False)(noop)
    (error,) = task_messages(app, "mod.quick")
    assert error.id == "celery_fenced.E008"
    assert "task 'mod.quick': lease_ttl is 0.05s, below 1s" in error.msg
    assert "renewed every ttl / 3 (17 ms" in error.msg


@pytest.mark.parametrize(
    ("patterns", "unmatched"),
    [
        ({"mod.nosuch": {}, "mod.*": {}}, ["mod.nosuch"]),
        ({"Mod.*": {}}, ["Mod.*"]),  # case counts
        ({"celery.*": {}}, ["celery.*"]),  # patterns never select Celery's own
        ({"*": {}, "other.sub": {}}, []),
    ],
)
def test_check_tasks__pattern_matching_no_task_is_w009(
    patterns: dict[str, Any], unmatched: list[str]
) -> None:
    app = fresh_app(fenced_tasks=patterns)
    warnings = [m for m in task_messages(app) if m.id == "celery_fenced.W009"]
    assert [w.obj for w in warnings] == [f"fenced_tasks[{p!r}]" for p in unmatched]
    for warning, pattern in zip(warnings, unmatched, strict=True):
        assert f"fenced_tasks[{pattern!r}] matches no registered task" in warning.msg
        assert "autodiscover_tasks()" in warning.msg


def test_check_tasks__configured_task_with_acks_late_false_is_w010() -> None:
    app = fresh_app(fenced_tasks={"mod.*": {}})
    app.task(name="mod.early", acks_late=False, shared=False)(noop)
    (warning,) = task_messages(app, "mod.early")
    assert warning.id == "celery_fenced.W010"
    assert "sets acks_late=False, but fenced_tasks selects it" in warning.msg
    assert task_messages(app, "mod.add") == []  # acks_late not set: no word


def test_check_tasks__configured_task_of_an_acks_late_false_app_passes() -> None:
    """``task_acks_late=False`` for the whole app is not the task's own choice."""
    app = fresh_app(fenced_tasks={"mod.*": {}}, task_acks_late=False)
    app.task(name="mod.plain", shared=False)(noop)
    assert task_messages(app, "mod.plain") == []


# -- atomic tasks ---------------------------------------------------------------------------
def atomic_app(**conf: Any) -> Any:
    app = fresh_app(result_backend="fenced-db", **conf)
    app.task(name="mod.atomic", base=FencedTask, lease_atomic=True, shared=False)(noop)
    return app


def test_check_tasks__atomic_on_sqlite_is_w012() -> None:
    (warning,) = task_messages(atomic_app())
    assert warning.id == "celery_fenced.W012"
    assert "1 atomic task(s) (mod.atomic) on SQLite, which has one writer" in warning.msg
    assert "other grants, renewals, results" in warning.msg


def test_check_tasks__every_task_atomic_by_the_setting_is_named() -> None:
    (warning,) = task_messages(atomic_app(fenced_atomic=True))
    assert "2 atomic task(s) (mod.atomic, mod.build)" in warning.msg


def test_check_tasks__atomic_results_elsewhere_is_w011(settings: Any) -> None:
    settings.CELERY_FENCED_DATABASE = "default_replica"  # results stay on "default"
    found = [m for m in task_messages(atomic_app()) if m.id == "celery_fenced.W011"]
    assert len(found) == 1
    assert "transaction on the lease database 'default_replica'" in found[0].msg
    assert "results are written to 'default': the result cannot commit with the body" in (
        found[0].msg
    )


@pytest.mark.parametrize(
    ("vendor", "expected"),
    [("mysql", ["celery_fenced.W013"]), ("mariadb", []), ("postgresql", []), (None, [])],
)
def test_check_tasks__atomic_on_mysql_is_w013(
    monkeypatch: pytest.MonkeyPatch, vendor: str | None, expected: list[str]
) -> None:
    from celery_fenced import task_checks

    monkeypatch.setattr(task_checks, "lease_vendor", lambda alias, databases: vendor)
    found = task_messages(atomic_app())
    assert [m.id for m in found] == expected
    if expected:
        assert "no server-side bound on a transaction left idle" in found[0].msg


def test_check_tasks__no_atomic_task_no_atomic_warning() -> None:
    assert task_messages(fresh_app(result_backend="fenced-db")) == []


def test_lease_vendor__the_mysql_family_unread_is_unknown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from celery_fenced.task_checks import lease_vendor

    assert lease_vendor("default", None) == "sqlite"
    monkeypatch.setattr(connections["default"], "vendor", "mysql")
    assert lease_vendor("default", None) is None
    assert lease_vendor("default", ["other"]) is None
