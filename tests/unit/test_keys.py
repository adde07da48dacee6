"""Lease keys: the default hash, templates over named arguments, callables, checks."""

from __future__ import annotations

import datetime as dt
import decimal
import enum
import re
import uuid
from collections.abc import Sequence
from typing import Any

import pytest
from celery import Celery
from kombu import serialization

from celery_fenced.exceptions import FencedConfigurationError, FencedError
from celery_fenced.execution import FencedTask
from celery_fenced.keys import (
    as_carried,
    check_template,
    default_key,
    named_arguments,
    render_key,
    unchanged_by_json,
)
from celery_fenced.models import KEY_MAX_LENGTH


def rebuild(report_id: int, part: str = "all", **extra: Any) -> None:
    """The task body whose arguments the keys below name."""


def render(spec: Any, args: Sequence[Any] = (), kwargs: Any = None) -> str:
    return render_key("mod.rebuild", spec, rebuild, args, kwargs or {})


# -- the default key ----------------------------------------------------------------------
def test_default_key__task_name_and_a_hash() -> None:
    assert re.fullmatch(r"mod\.rebuild:[0-9a-f]{32}", default_key("mod.rebuild", (1,), {}))


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (((1, "a"), {"x": 1}), ((1, "a"), {"x": 1})),
        (((), {"a": 1, "b": {"c": 2, "d": 3}}), ((), {"b": {"d": 3, "c": 2}, "a": 1})),
        (((1, 2), {}), ([1, 2], {})),
    ],
    ids=["same-call", "kwargs-order", "tuple-or-list"],
)
def test_default_key__stable(first: Any, second: Any) -> None:
    assert default_key("mod.t", *first) == default_key("mod.t", *second)


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (("mod.t", (1,), {}), ("mod.t", (2,), {})),
        (("mod.t", (1,), {}), ("mod.t", ("1",), {})),
        (("mod.t", (), {"a": 1}), ("mod.t", (), {"b": 1})),
        (("mod.t", (1, 2), {}), ("mod.t", (2, 1), {})),
        (("mod.t", (1,), {}), ("mod.u", (1,), {})),
    ],
    ids=["value", "type", "kwarg-name", "arg-order", "task"],
)
def test_default_key__differs_for_different_calls(first: Any, second: Any) -> None:
    assert default_key(*first) != default_key(*second)


@pytest.mark.parametrize(
    "make",
    [
        lambda name: default_key(name, (1,), {}),
        lambda name: render_key(name, None, rebuild, (1,), {}),
    ],
    ids=["default_key", "render_key"],
)
def test_default_key__fits_for_a_very_long_task_name(make: Any) -> None:
    key = make("mod." + "x" * 400)
    assert len(key) <= KEY_MAX_LENGTH
    assert key.startswith("mod.xxx")


def test_default_key__differs_for_long_task_names_with_a_common_prefix() -> None:
    prefix = "mod." + "x" * 300
    assert default_key(prefix + ".a", (1,), {}) != default_key(prefix + ".b", (1,), {})


@pytest.mark.parametrize(
    ("args", "kwargs"), [((), {"report_id": 42}), ((42, "all"), {}), ((42,), {"part": "all"})]
)
def test_default_key__same_for_the_same_named_arguments(args: Any, kwargs: Any) -> None:
    assert render(None, args, kwargs) == render(None, (42,))


@pytest.mark.parametrize(
    ("args", "kwargs"), [((object(),), {}), ((), {"report": object()}), ((b"bytes",), {})]
)
def test_default_key__unserialisable_arguments_name_the_task_and_lease_key(
    args: Any, kwargs: Any
) -> None:
    with pytest.raises(FencedError) as error:
        render(None, args, kwargs)
    assert "'mod.rebuild'" in str(error.value)
    assert "JSON-serialisable" in str(error.value)
    assert "give the task a lease_key" in str(error.value)


# -- templates ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "kwargs", "expected"),
    [
        ((42,), {}, "report:42:all"),
        ((), {"report_id": 42}, "report:42:all"),
        ((42, "head"), {}, "report:42:head"),
        ((42,), {"part": "head"}, "report:42:head"),
    ],
)
def test_render_key__template_over_named_arguments(args: Any, kwargs: Any, expected: str) -> None:
    assert render("report:{report_id}:{part}", args, kwargs) == expected


def test_render_key__template_over_extra_keyword_arguments() -> None:
    assert render("report:{report_id}:{region}", (42,), {"region": "eu"}) == "report:42:eu"


@pytest.mark.parametrize(
    ("spec", "args", "kwargs", "fragment"),
    [
        ("report:{missing}", (42,), {}, "KeyError('missing')"),
        ("report:{report_id}", (), {}, "KeyError('report_id')"),
        ("report:{report_id}", (1, 2, 3), {}, "TypeError"),
        ("report:{report_id.nope}", (42,), {}, "AttributeError"),
    ],
    ids=["unknown-name", "argument-not-given", "too-many-arguments", "bad-attribute"],
)
def test_render_key__template_that_cannot_be_filled_names_the_task(
    spec: str, args: Any, kwargs: Any, fragment: str
) -> None:
    with pytest.raises(FencedError) as error:
        render(spec, args, kwargs)
    assert f"task 'mod.rebuild': lease_key {spec!r} could not be filled" in str(error.value)
    assert fragment in str(error.value)


# -- callables ------------------------------------------------------------------------------
def test_render_key__callable_gets_args_and_kwargs() -> None:
    def key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        return f"report:{args[0]}:{kwargs['part']}"

    assert render(key, [42], {"part": "head"}) == "report:42:head"


def boom(args: Any, kwargs: Any) -> str:
    raise RuntimeError("boom")


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        (boom, "the lease_key callable raised RuntimeError('boom')"),
        (lambda args, kwargs: 42, "the lease_key callable must return a str, got int"),
        (lambda args, kwargs: None, "must return a str, got NoneType"),
        (lambda args, kwargs: "", "the lease key must be a non-empty string"),
        (lambda args, kwargs: "k" * 256, "the lease key must be at most 255 characters, got 256"),
        ("{report_id}" + "k" * 300, "the lease key must be at most 255 characters, got 302"),
    ],
    ids=["raises", "int", "none", "empty", "too-long", "template-too-long"],
)
def test_render_key__bad_key_gives_a_clear_error(spec: Any, fragment: str) -> None:
    with pytest.raises(FencedError) as error:
        render(spec, (42,))
    assert str(error.value).startswith("task 'mod.rebuild': ")
    assert fragment in str(error.value)


# -- checks at definition -------------------------------------------------------------------
def test_check_template__positional_fields_are_refused() -> None:
    with pytest.raises(FencedConfigurationError, match="must name arguments"):
        check_template("mod.rebuild", "report:{0}", rebuild)


def define(**options: Any) -> Any:
    """Define (and so validate) a FencedTask on a fresh app."""
    app = Celery("fresh", set_as_current=False)

    def build(report_id: int, part: str = "all") -> None:
        pass

    def build_bound(self: Any, report_id: int) -> None:
        pass

    body = build_bound if options.get("bind") else build
    app.task(name="mod.build", base=FencedTask, shared=False, **options)(body)
    return app.tasks["mod.build"]


@pytest.mark.parametrize(
    ("options", "fragments"),
    [
        ({"lease_key": "x:{missing}"}, ["'mod.build'", "names missing", "report_id, part"]),
        ({"lease_key": "x:{self}", "bind": True}, ["'mod.build'", "names self"]),
        ({"lease_key": "x:{0}"}, ["'x:{0}'", "must name arguments"]),
        ({"lease_key": 5}, ["'mod.build'", "lease_key must be a str.format template"]),
        ({"lease_ttl": 0}, ["'mod.build'", "lease_ttl", "greater than 0"]),
        ({"lease_ttl": "30"}, ["'mod.build'", "lease_ttl", "got '30'"]),
        ({"lease_on_busy": "x"}, ["'mod.build'", "lease_on_busy", "'retry', 'skip', 'fail'"]),
        (
            {"lease_ttl": 10, "lease_renew_interval": 10},
            ["'mod.build'", "lease_renew_interval", "shorter than the lease ttl (10s)"],
        ),
    ],
)
def test_definition__invalid_option_names_task_and_option(
    options: dict[str, Any], fragments: list[str]
) -> None:
    with pytest.raises(FencedConfigurationError) as error:
        define(**options)
    for fragment in fragments:
        assert fragment in str(error.value)


@pytest.mark.parametrize("bind", [False, True])
def test_definition__valid_template(bind: bool) -> None:
    task = define(lease_key="report:{report_id}", lease_ttl=30, bind=bind)
    assert isinstance(task, FencedTask)
    assert (task.acks_late, task.reject_on_worker_lost) == (True, True)
    assert render_key(task.name, task.lease_key, task.run, (7,), {}) == "report:7"


def test_named_arguments__signatures_kept_per_function_and_bound_method() -> None:
    class Job:
        def run(self, report_id: int, **extra: Any) -> None:
            pass

    def other(name: str, count: int = 2) -> None:
        pass

    first, second = Job(), Job()
    for _ in range(2):  # the second round comes from the kept signatures
        assert named_arguments(first.run, (1,), {"x": 2}) == {"report_id": 1, "x": 2}
        assert named_arguments(second.run, (), {"report_id": 3}) == {"report_id": 3}
        assert named_arguments(other, ("a",), {}) == {"name": "a", "count": 2}
    with pytest.raises(TypeError):
        named_arguments(other, (), {"nosuch": 1})


def test_message_digest__a_zoneinfo_datetime_and_its_json_round_trip_are_one_job() -> None:
    """A recorded job comes back from JSON with a fixed-offset datetime; a copy of a pickled
    message keeps its ``ZoneInfo``: the reclaimer's revoke must name the copy's delivery."""
    import datetime as dt
    import zoneinfo
    from types import SimpleNamespace

    from celery_fenced import execution, reclaim

    when = dt.datetime(2024, 1, 1, tzinfo=zoneinfo.ZoneInfo("Europe/Paris"))
    args, kwargs = (when,), {"at": when}
    recorded = reclaim.decode_job(
        reclaim.encode_job(reclaim.Job("t", list(args), dict(kwargs), {"retries": 0}))
    )
    late_copy = execution.delivery_of("tid", "t", args, kwargs, SimpleNamespace(retries=0))
    assert reclaim.delivery_of("tid", recorded) == late_copy
    later = when + dt.timedelta(hours=1)
    other = execution.delivery_of("tid", "t", (later,), kwargs, SimpleNamespace(retries=0))
    assert other.digest != late_copy.digest  # another moment, another job


def _bound(run: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | str:
    """What ``named_arguments`` gave through ``bind_partial`` alone (or its error)."""
    import inspect

    try:
        bound = inspect.signature(run).bind_partial(*args, **kwargs)
    except TypeError:
        return "TypeError"
    bound.apply_defaults()
    return dict(bound.arguments)


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ((), {}),
        ((1,), {}),
        ((1, 2), {}),
        ((1, 2, 3), {}),
        ((1, 2, 3, 4), {}),
        ((), {"report_id": 1}),
        ((1,), {"page": 2}),
        ((), {"page": 2, "report_id": 1}),
        ((1,), {"size": 5}),
        ((1,), {"report_id": 2}),
        ((1,), {"nosuch": 2}),
        ((1, 2), {"page": 3}),
    ],
)
def test_named_arguments__plain_signatures_as_bind_partial_gives_them(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """The shortcut for plain parameters names what ``bind_partial`` names, in its order,
    and raises where it raises."""

    def run(report_id: int, page: int, size: int = 10) -> None:
        pass

    expected = _bound(run, args, kwargs)
    try:
        got: dict[str, Any] | str = named_arguments(run, args, kwargs)
    except TypeError:
        got = "TypeError"
    assert got == expected
    if isinstance(got, dict):
        assert list(got) == list(expected)


# -- arguments as a message carries them --------------------------------------------------
class Colour(enum.IntEnum):
    RED = 1


class Name(str):
    """A str subclass: JSON writes it as a plain string."""


@pytest.mark.parametrize(
    "value",
    [
        "text",
        "ünïcode \ud800",  # a lone surrogate: escaped by JSON, read back the same
        0,
        -(2**80),
        True,
        None,
        1.5,
        -0.0,
        1e308,
        float("inf"),
        [1, "a", [None, {"k": 2.5}]],
        {"b": 1, "a": {"c": [True, False]}},
        (1, 2),
        [(1, 2)],
        {1: "int key"},
        {"k": (1,)},
        Colour.RED,
        Name("sub"),
        dt.date(2026, 12, 6),
        decimal.Decimal("1.10"),
        uuid.UUID(int=7),
        b"bytes",
    ],
    ids=repr,
)
def test_as_carried__the_json_round_trip_or_what_it_would_give(value: Any) -> None:
    """Arguments that read back from JSON unchanged skip the round trip; the key decided
    at publish is the one the round trip gives for every value, and what ``"{x}"`` and the
    default key make of it the same."""
    args, kwargs = [value], {"x": value}
    content_type, encoding, data = serialization.dumps([args, kwargs], "json")
    expected = serialization.loads(data, content_type, encoding, accept={content_type})
    carried = as_carried((value,), {"x": value}, "json")
    assert repr(list(carried)) == repr(expected)
    assert [type(v) for v in carried[0]] == [type(v) for v in expected[0]]
    assert render("{x}", kwargs=carried[1]) == render("{x}", kwargs=expected[1])
    assert _key_or_error(carried) == _key_or_error(expected)
    if unchanged_by_json(value):  # the fast path's claim: the same value, the same types
        assert repr(value) == repr(expected[0][0])
        assert type(value) is type(expected[0][0])


def _key_or_error(carried: Any) -> str:
    """The default key of carried arguments, or the error that refuses them."""
    try:
        return default_key("t", carried[0], carried[1])
    except FencedError as exc:
        return f"refused: {exc}"


@pytest.mark.parametrize(
    "value",
    [
        {"__type__": "datetime", "__value__": "2024-01-01T00:00:00"},
        {"__type__": "decimal", "__value__": "1.10"},
        {"__type__": "bytes", "__value__": "abc"},
        {"__type__": "nope", "__value__": 1},
    ],
)
def test_as_carried__a_kombu_marker_dict_goes_through_the_round_trip(value: object) -> None:
    """kombu's JSON decoder turns ``{"__type__", "__value__"}`` dicts into other values
    (or refuses them): such a dict always takes the round trip."""
    assert not unchanged_by_json(value)
    try:
        content_type, encoding, data = serialization.dumps([[], {"x": value}], "json")
        expected = serialization.loads(data, content_type, encoding, accept={content_type})
    except Exception as exc:
        with pytest.raises(type(exc)):
            as_carried([], {"x": value}, "json")
    else:
        assert as_carried([], {"x": value}, "json") == (expected[0], expected[1])


def test_as_carried__a_copy_as_the_round_trip_makes_one() -> None:
    """Arguments that skip the round trip come back as new lists and dicts, as a round
    trip makes them: a key callable that changes them leaves the message's own alone."""
    nested = {"ids": [1, 2]}
    args, kwargs = as_carried(([nested],), {"x": nested}, "json")
    args[0][0]["ids"].append(3)
    kwargs["x"]["ids"].append(4)
    assert nested == {"ids": [1, 2]}


def test_unchanged_by_json__ints_every_reader_takes_and_nesting_it_can_look_at() -> None:
    """An int beyond 64 bits (kombu's writer refuses the longest) and a list that holds
    itself take the round trip, which decides for them as before."""
    loop: list[Any] = []
    loop.append(loop)
    assert unchanged_by_json(2**63 - 1)
    assert not unchanged_by_json(2**64)
    assert not unchanged_by_json(10**5000)
    assert not unchanged_by_json(loop)
