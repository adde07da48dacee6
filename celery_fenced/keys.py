"""Lease keys of task executions: a template, a callable, or the default hash."""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import inspect
import json
import string
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kombu import serialization

from celery_fenced import permits
from celery_fenced.exceptions import FencedConfigurationError, InvalidLeaseKey
from celery_fenced.models import KEY_MAX_LENGTH


def template_fields(template: str) -> set[str]:
    """The argument names a ``str.format`` template refers to (``{a.b[0]}`` → ``a``)."""
    names = set()
    for _, field, _, _ in string.Formatter().parse(template):
        if field is None:
            continue
        root = field.split(".", 1)[0].split("[", 1)[0]
        if not root or root.isdigit():
            raise FencedConfigurationError(
                f"lease key template {template!r} must name arguments ({{report_id}}), "
                "not use positional fields"
            )
        names.add(root)
    return names


def check_template(task_name: str, template: str, run: Callable[..., Any] | None) -> None:
    """Fail at definition when the template names an argument the task does not take."""
    fields = template_fields(template)
    if run is None:
        return
    params = inspect.signature(run).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    missing = fields - set(params)
    if missing:
        raise FencedConfigurationError(
            f"task {task_name!r}: lease_key {template!r} names {', '.join(sorted(missing))}, "
            f"which is not an argument of the task (arguments: {', '.join(params) or 'none'})"
        )


def named_arguments(
    run: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    """``run``'s arguments by name, defaults included, as ``Signature.bind_partial``
    gives them (a ``**kwargs`` spread among them); TypeError where it raises."""
    signature, var_keyword, plain = _signature(run)
    if plain is not None and len(args) <= len(plain):
        named = _plain_arguments(plain, args, kwargs)
        if named is not None:
            return named
    bound = signature.bind_partial(*args, **kwargs)
    bound.apply_defaults()
    named = dict(bound.arguments)
    if var_keyword is not None and var_keyword in named:
        named.update(named.pop(var_keyword))
    return named


def _plain_arguments(
    plain: tuple[tuple[str, Any], ...], args: Sequence[Any], kwargs: Mapping[str, Any]
) -> dict[str, Any] | None:
    """What ``bind_partial`` and ``apply_defaults`` give for a function whose every
    parameter is positional-or-keyword (``plain``: each one's name and default), without
    their cost on every execution; None when ``kwargs`` names a parameter given by
    position or none at all (``bind_partial`` raises: let it)."""
    named: dict[str, Any] = {}
    given = len(args)
    used = 0
    for index, (name, default) in enumerate(plain):
        if index < given:
            if name in kwargs:
                return None
            named[name] = args[index]
        elif name in kwargs:
            named[name] = kwargs[name]
            used += 1
        elif default is not _EMPTY:
            named[name] = default
    return named if used == len(kwargs) else None


_EMPTY = inspect.Parameter.empty
_PLAIN = inspect.Parameter.POSITIONAL_OR_KEYWORD
_Read = tuple[inspect.Signature, str | None, tuple[tuple[str, Any], ...] | None]


def _signature(run: Callable[..., Any]) -> _Read:
    """``run``'s signature, its ``**kwargs`` name and, when every parameter is
    positional-or-keyword, each one's name and default; worked out once per function.

    Every execution renders its key from its arguments; ``inspect.signature`` is the
    slow part of that, and a task's ``run`` does not change.
    """
    try:
        return _signatures(run)
    except TypeError:  # unhashable: not worth keeping
        return _read_signature(run)


def _read_signature(run: Callable[..., Any]) -> _Read:
    signature = inspect.signature(run)
    params = signature.parameters.values()
    var_keyword = next((p.name for p in params if p.kind is p.VAR_KEYWORD), None)
    plain = None
    if all(p.kind is _PLAIN for p in params):
        plain = tuple((p.name, p.default) for p in params)
    return signature, var_keyword, plain


_signatures = functools.lru_cache(maxsize=1024)(_read_signature)


def default_key(task_name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
    """``task name:sha256 of the JSON arguments`` — stable across processes and hosts."""
    try:
        payload = json.dumps(
            [task_name, list(args), dict(kwargs)], sort_keys=True, separators=(",", ":")
        )
    except (TypeError, ValueError) as exc:
        raise InvalidLeaseKey(
            f"task {task_name!r}: the default lease key hashes the arguments as JSON, and "
            f"they are not JSON-serialisable ({exc}); give the task a lease_key"
        ) from None
    digest = hashlib.sha256(payload.encode()).hexdigest()[:32]
    room = KEY_MAX_LENGTH - len(digest) - 1
    return f"{task_name[:room]}:{digest}"


def replacements(value: Any) -> int:
    """How many times a task replaced itself before this message: Celery's
    ``replaced_task_nesting`` as a message or its options carry it (0 when none)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def message_digest(
    task_id: str,
    task_name: str,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    nesting: int = 0,
) -> str:
    """A digest of one job: its task id and message (task name and arguments), and how
    many times it was replaced (``nesting``, Celery's ``replaced_task_nesting``).

    A redelivered or re-sent message has the same; a task id reused for a new job with
    other arguments has another, and so has the replacement of a task by a signature of
    itself (``Task.replace`` keeps the task id: the replacement is the next step of the
    job, not a copy of the message it replaced). An aware datetime is hashed as its UTC moment (a
    ``ZoneInfo`` one comes back from JSON with a fixed offset: the same moment); other
    arguments JSON cannot carry by their ``repr``: at worst such a job is not recognised
    as a duplicate and runs again.
    """
    job: list[Any] = [task_id, task_name, list(args), dict(kwargs)]
    if nesting:  # a job never replaced keeps the digest it always had
        job.append(nesting)
    payload = json.dumps(
        job,
        sort_keys=True,
        separators=(",", ":"),
        default=_moment_or_repr,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


def _moment_or_repr(value: Any) -> str:
    if isinstance(value, dt.datetime) and value.utcoffset() is not None:
        return value.astimezone(dt.timezone.utc).isoformat()
    return repr(value)


def render_key(
    task_name: str,
    spec: Any,
    run: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
) -> str:
    """The lease key of one execution; errors name the task and what is wrong."""
    if spec is None:
        try:  # f(42) and f(report_id=42) are the same job
            named = named_arguments(run, args, kwargs)
        except TypeError:
            key = default_key(task_name, args, kwargs)
        else:
            key = default_key(task_name, (), named)
    elif callable(spec):
        try:
            key = spec(tuple(args), dict(kwargs))
        except Exception as exc:
            raise InvalidLeaseKey(
                f"task {task_name!r}: the lease_key callable raised {exc!r}"
            ) from exc
        if not isinstance(key, str):
            raise InvalidLeaseKey(
                f"task {task_name!r}: the lease_key callable must return a str, "
                f"got {type(key).__name__}"
            )
    else:
        try:
            key = str(spec).format(**named_arguments(run, args, kwargs))
        except (KeyError, IndexError, AttributeError, TypeError) as exc:
            raise InvalidLeaseKey(
                f"task {task_name!r}: lease_key {spec!r} could not be filled from the "
                f"call's arguments ({exc!r})"
            ) from None
    check_key(key, f"task {task_name!r}: the lease key")
    return key


#: the message header that carries a job's lease key, decided once where the job is
#: published and kept by every copy of its message (a redelivery, a retry, the outbox's
#: and the reclaimer's re-sends): a worker runs the job under it instead of working the
#: key out again from arguments that may have changed shape in the message (a tuple
#: arrives as a list, a dict's int keys as strings)
KEY_HEADER = "fenced_lease_key"


def as_carried(args: Sequence[Any], kwargs: Mapping[str, Any], serializer: str) -> tuple[Any, Any]:
    """``args`` and ``kwargs`` as a worker decodes them from a message written with
    ``serializer``: the arguments a key is worked out from, at publish as at run time."""
    if serializer == "json":
        carried = _as_json_reads([list(args), dict(kwargs)])
        if carried is not _CHANGED:  # what the round trip gives back, without its cost
            return carried[0], carried[1]
    content_type, encoding, data = serialization.dumps([list(args), dict(kwargs)], serializer)
    carried = serialization.loads(data, content_type, encoding, accept={content_type})
    return carried[0], carried[1]


#: the types JSON writes and reads back as the very same type and value (exactly these:
#: a subclass, an ``IntEnum``, is written as its base's value and read back as that)
_JSON_PLAIN = frozenset({str, float, bool, type(None)})
#: the ints read back as written by every JSON reader (a longer one may be refused)
_JSON_INTS = range(-(2**63), 2**64)
#: what :func:`_as_json_reads` answers for a value JSON would change or refuse
_CHANGED: Any = object()


def unchanged_by_json(value: Any) -> bool:
    """Whether ``value`` reads back from JSON equal and of the same types: strings,
    numbers, booleans and None, in lists and in dicts with string keys. (A tuple comes
    back a list, a dict's int key a string, a date a string.)"""
    return _as_json_reads(value) is not _CHANGED


def _as_json_reads(value: Any) -> Any:
    """A copy of ``value`` as JSON reads it back (new lists and dicts, as a round trip
    makes them), or :data:`_CHANGED` when JSON would change it, refuse it, or it nests
    too deep to look at."""
    try:
        return _json_copy(value)
    except RecursionError:
        return _CHANGED


def _json_copy(value: Any) -> Any:
    kind = type(value)
    if kind in _JSON_PLAIN or (kind is int and value in _JSON_INTS):
        return value
    if kind is list:
        items = [_json_copy(item) for item in value]
        return _CHANGED if any(item is _CHANGED for item in items) else items
    if kind is dict:
        if value.keys() == _KOMBU_MARKER:  # kombu reads it back as a datetime, Decimal...
            return _CHANGED
        if not all(type(k) is str for k in value):
            return _CHANGED
        copied = {k: _json_copy(v) for k, v in value.items()}
        return _CHANGED if any(v is _CHANGED for v in copied.values()) else copied
    return _CHANGED


#: the keys of a dict kombu's JSON decoder turns into another value (its ``object_hook``:
#: ``{"__type__": "datetime", "__value__": ...}`` reads back a datetime, an unknown
#: ``__type__`` fails), whatever the values
_KOMBU_MARKER = frozenset({"__type__", "__value__"})


def publish_key(
    task_name: str,
    spec: Any,
    run: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    serializer: str,
) -> str:
    """The lease key of a job being published: :func:`render_key` over its arguments as
    its message carries them (the default key hashes their JSON, the same either way)."""
    if spec is not None:
        args, kwargs = as_carried(args, kwargs, serializer)
    return render_key(task_name, spec, run, args, kwargs)


#: the message header naming the job :data:`KEY_HEADER`'s key was decided for (its task
#: name and id, :func:`job_of`): a key header that reached another job's message (a
#: parent's headers passed on to the job it publishes) is not that job's key
JOB_HEADER = "fenced_lease_key_job"


def job_of(task_name: str, task_id: str) -> str:
    """The job a key header names: ``task name[task id]``."""
    return f"{task_name}[{task_id}]"


def key_headers(key: str, task_name: str, task_id: str) -> dict[str, str]:
    """The headers that carry ``key`` as the key of job ``task_id`` of ``task_name``."""
    return {KEY_HEADER: key, JOB_HEADER: job_of(task_name, task_id)}


def headers_of(options: Mapping[str, Any]) -> dict[str, Any]:
    """The custom message headers a publish's ``options`` carry (a copy; none: empty)."""
    headers = options.get("headers")
    return dict(headers) if isinstance(headers, Mapping) else {}


def stamp_key(options: dict[str, Any], key: str | None, task_name: str, task_id: str) -> None:
    """Give a publish's ``options`` the headers that carry ``key`` as the key of job
    ``task_id`` of ``task_name``; with no key, take off a key header they carry from
    another job (a parent's headers passed on)."""
    if key is not None:  # every copy of the message runs under it
        options["headers"] = {**headers_of(options), **key_headers(key, task_name, task_id)}
    elif KEY_HEADER in headers_of(options):
        options["headers"] = without_key(headers_of(options))


def without_key(headers: Mapping[str, Any]) -> dict[str, Any]:
    """``headers`` without a key of their own (:func:`key_headers`)."""
    return {k: v for k, v in headers.items() if k not in (KEY_HEADER, JOB_HEADER)}


def carried_key(
    headers: Mapping[str, Any] | None, task_name: str, task_id: str | None
) -> str | None:
    """The key a message's ``headers`` carry (:data:`KEY_HEADER`) for job ``task_id`` of
    ``task_name``, checked; None when they carry none, or one decided for another job."""
    if not headers or not task_id:
        return None
    key = headers.get(KEY_HEADER)
    if key is None or headers.get(JOB_HEADER) != job_of(task_name, task_id):
        return None
    return check_key(key, f"the {KEY_HEADER} header of the message")


def check_key(key: object, subject: str = "key") -> str:
    """``key`` if the lease table can store it; else :class:`InvalidLeaseKey` naming
    ``subject`` and what would be valid (a non-empty string of at most 255 characters,
    without NUL)."""
    if not isinstance(key, str) or not key:
        raise InvalidLeaseKey(f"{subject} must be a non-empty string, got {key!r}")
    if len(key) > KEY_MAX_LENGTH:
        raise InvalidLeaseKey(
            f"{subject} must be at most {KEY_MAX_LENGTH} characters, got {len(key)}: {key[:40]!r}…"
        )
    if permits.SEPARATOR in key:
        raise InvalidLeaseKey(
            f"{subject} must not contain the unit separator ('\\x1f': it names the "
            f"permits of a key, lease_limit), got {key[:40]!r}"
        )
    if "\x00" in key:
        raise InvalidLeaseKey(
            f"{subject} must not contain NUL characters ('\\x00'; PostgreSQL cannot store "
            f"them), got {key[:40]!r}"
        )
    return key
