"""Settings: read from the Celery app or Django settings, validated with clear errors."""

from __future__ import annotations

import math
from typing import Any

import pytest
from celery import Celery

from celery_fenced import conf
from celery_fenced.exceptions import FencedConfigurationError

# (setting, bad value, fragments the error must contain: the setting and what is allowed)
INVALID = [
    ("fenced_default_ttl", 0, ["fenced_default_ttl", "greater than 0", "got 0"]),
    ("fenced_default_ttl", -1, ["fenced_default_ttl", "greater than 0", "got -1"]),
    ("fenced_default_ttl", "x", ["fenced_default_ttl", "number of seconds", "got 'x'"]),
    ("fenced_default_ttl", math.nan, ["fenced_default_ttl", "greater than 0", "nan"]),
    ("fenced_default_ttl", math.inf, ["fenced_default_ttl", "greater than 0", "inf"]),
    ("fenced_default_ttl", True, ["fenced_default_ttl", "number of seconds", "True"]),
    ("fenced_renew_interval", 60, ["fenced_renew_interval", "shorter than the lease ttl (60s)"]),
    ("fenced_renew_interval", 90.5, ["fenced_renew_interval", "shorter than", "90.5"]),
    ("fenced_renew_interval", 0, ["fenced_renew_interval", "greater than 0"]),
    ("fenced_on_busy", "sometimes", ["fenced_on_busy", "'retry', 'skip', 'fail'", "sometimes"]),
    ("fenced_tasks", ["mod.*"], ["fenced_tasks", "must be a dict", "list"]),
    ("fenced_tasks", {"": {}}, ["fenced_tasks keys", "task names or glob patterns"]),
    (
        "fenced_tasks",
        {"mod.*": {"ttl": 5, "timeout": 3}},
        ["fenced_tasks['mod.*']", "unknown option(s) 'timeout'", "ttl, key, on_busy"],
    ),
    ("fenced_tasks", {"mod.*": 30}, ["fenced_tasks['mod.*']", "must be a dict of options"]),
    ("fenced_tasks", {"mod.*": {"ttl": 0}}, ["fenced_tasks['mod.*'] ttl", "greater than 0"]),
    ("fenced_tasks", {"mod.*": {"ttl": "5"}}, ["fenced_tasks['mod.*'] ttl", "got '5'"]),
    (
        "fenced_tasks",
        {"mod.*": {"on_busy": "later"}},
        ["fenced_tasks['mod.*'] on_busy", "'retry', 'skip', 'fail'", "later"],
    ),
    (
        "fenced_tasks",
        {"mod.*": {"key": 5}},
        ["fenced_tasks['mod.*'] key", "str.format template or a callable"],
    ),
    ("fenced_tasks", {"mod.*": {"key": " "}}, ["fenced_tasks['mod.*'] key", "not be empty"]),
    (
        "fenced_tasks",
        {"mod.*": {"ttl": 10, "renew_interval": 10}},
        ["fenced_tasks['mod.*'] renew interval", "shorter than the lease ttl (10s)"],
    ),
    (
        "fenced_database",
        "nosuch",
        ["fenced_database", "(default, default_replica", "'nosuch'"],
    ),
    ("fenced_database", 3, ["fenced_database", "database alias in DATABASES"]),
]


def fresh_app(**values: Any) -> Celery:
    """A Celery app that is not the current one, with ``values`` in its conf."""
    app = Celery("fresh", set_as_current=False)
    app.conf.update(values)
    return app


@pytest.mark.parametrize("source", ["celery", "django"])
@pytest.mark.parametrize(("name", "value", "fragments"), INVALID)
def test_load__invalid_setting_names_it_and_what_is_allowed(
    settings: Any, source: str, name: str, value: object, fragments: list[str]
) -> None:
    if source == "celery":
        app = fresh_app(**{name: value})
    else:
        setattr(settings, f"CELERY_{name.upper()}", value)
        app = fresh_app()
    with pytest.raises(FencedConfigurationError) as error:
        conf.load(app)
    for fragment in fragments:
        assert fragment in str(error.value)


def test_load__defaults() -> None:
    assert conf.load(fresh_app()) == conf.FencedSettings(
        tasks={}, default_ttl=60.0, renew_interval=None, on_busy="retry", database=None
    )


@pytest.mark.parametrize("source", ["celery", "django"])
def test_load__valid_settings(settings: Any, source: str) -> None:
    values = {
        "fenced_tasks": {"mod.*": {"ttl": 15, "on_busy": "skip", "key": "k:{x}"}},
        "fenced_default_ttl": 30,
        "fenced_renew_interval": 10,
        "fenced_on_busy": "fail",
        "fenced_database": "default_replica",
    }
    if source == "celery":
        app = fresh_app(**values)
    else:
        for name, value in values.items():
            setattr(settings, f"CELERY_{name.upper()}", value)
        app = fresh_app()
    assert conf.load(app) == conf.FencedSettings(
        tasks=values["fenced_tasks"],  # type: ignore[arg-type]
        default_ttl=30.0,
        renew_interval=10.0,
        on_busy="fail",
        database="default_replica",
    )


def test_load__celery_conf_wins_over_django_settings(settings: Any) -> None:
    settings.CELERY_FENCED_DEFAULT_TTL = 7
    settings.CELERY_FENCED_ON_BUSY = "skip"
    loaded = conf.load(fresh_app(fenced_default_ttl=5))
    assert (loaded.default_ttl, loaded.on_busy) == (5.0, "skip")


TASKS = {
    "mod.add": {"ttl": 1},
    "mod.add*": {"ttl": 2},
    "mod.*": {"ttl": 3},
    "mod.sub.*": {"ttl": 4},
    "*": {"ttl": 5},
}


@pytest.mark.parametrize(
    ("task_name", "ttl"),
    [
        ("mod.add", 1),  # the exact name beats a longer glob
        ("mod.addition", 2),  # the longest glob wins
        ("mod.mul", 3),
        ("mod.sub.x", 4),
        ("other.task", 5),  # "*" matches all
    ],
)
def test_options_for__exact_then_longest_glob(task_name: str, ttl: int) -> None:
    assert conf.FencedSettings(tasks=TASKS).options_for(task_name) == {"ttl": ttl}


def test_options_for__no_match_and_a_copy() -> None:
    settings = conf.FencedSettings(tasks={"mod.*": {"ttl": 3}})
    assert settings.options_for("other.task") is None
    settings.options_for("mod.x")["ttl"] = 99  # type: ignore[index]
    assert settings.options_for("mod.x") == {"ttl": 3}


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({}, conf.TaskOptions(ttl=60.0, on_busy="retry", renew_interval=20.0)),
        ({"ttl": 9}, conf.TaskOptions(ttl=9.0, on_busy="retry", renew_interval=3.0)),
        (
            {"ttl": 9, "on_busy": "skip", "renew_interval": 2, "key": "k:{x}"},
            conf.TaskOptions(ttl=9.0, on_busy="skip", renew_interval=2.0, key="k:{x}"),
        ),
    ],
)
def test_task_options__merged_over_the_defaults(
    options: dict[str, Any], expected: conf.TaskOptions
) -> None:
    assert conf.FencedSettings().task_options("task 't'", **options) == expected


@pytest.mark.parametrize(
    "task_name", ["celery.chord_unlock", "celery.backend_cleanup", "celery_fenced.reclaim"]
)
def test_options_for__star_never_selects_builtin_tasks(task_name: str) -> None:
    settings = conf.FencedSettings(tasks={"*": {"ttl": 5}, "celery.accumulate": {"ttl": 7}})
    assert settings.options_for(task_name) is None
    assert settings.options_for("reports.rebuild") == {"ttl": 5}
    assert settings.options_for("celery.accumulate") == {"ttl": 7}  # named exactly


def test_load__kept_until_the_app_conf_changes() -> None:
    app = fresh_app(fenced_default_ttl=5)
    first = conf.load(app)
    assert conf.load(app) is first  # read and validated once
    app.conf.update(fenced_default_ttl=6)
    assert conf.load(app).default_ttl == 6.0
    app.conf.fenced_on_busy = "skip"
    assert conf.load(app).on_busy == "skip"
    app.conf["fenced_on_busy"] = "fail"
    assert conf.load(app).on_busy == "fail"


def test_load__kept_until_a_first_fenced_name_is_changed_on_the_app_and_after() -> None:
    """An app whose configuration changed none of the package's names at run time, then
    one, then none again: each change is seen by the next call."""
    app = fresh_app()
    app.conf.worker_concurrency = 3  # a change of Celery's own: nothing of ours
    first = conf.load(app)
    assert conf.load(app) is first
    app.conf.fenced_default_ttl = 7
    assert conf.load(app).default_ttl == 7.0
    app.conf.pop("fenced_default_ttl")
    assert conf.load(app).default_ttl == 60.0
    app.conf.result_extended = True  # Celery's own, read with them
    assert conf.load(app).result_extended is True


def test_load__kept_until_django_settings_change(settings: Any) -> None:
    app = fresh_app()
    assert conf.load(app).default_ttl == 60.0
    settings.CELERY_FENCED_DEFAULT_TTL = 9
    assert conf.load(app).default_ttl == 9.0
    del settings.CELERY_FENCED_DEFAULT_TTL
    assert conf.load(app).default_ttl == 60.0


def test_load__invalid_settings_are_never_kept() -> None:
    app = fresh_app(fenced_on_busy="sometimes")
    for _ in range(2):
        with pytest.raises(FencedConfigurationError):
            conf.load(app)
    app.conf.update(fenced_on_busy="skip")
    assert conf.load(app).on_busy == "skip"
    app.conf.update(fenced_on_busy="never")
    with pytest.raises(FencedConfigurationError):
        conf.load(app)
