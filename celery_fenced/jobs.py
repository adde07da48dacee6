"""A recorded job: what is needed to send a job again, kept as JSON in the lease database.

The job is stored as JSON through kombu's serializer registry and read back accepting
JSON only: nothing read from the database is ever unpickled. It is recorded with a
grant (:func:`celery_fenced.reclaim.job_for`) or at publish (the outbox,
:func:`recorded_options`), and sent again by :mod:`celery_fenced.resend`.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from celery.utils.time import maybe_iso8601, maybe_make_aware
from kombu import serialization

from celery_fenced import context, keys, store

if TYPE_CHECKING:
    from celery import Celery

    from celery_fenced.store import Delivery

CONTENT_TYPE = "application/json"
#: the message header that marks a plain task's job the outbox holds: the worker that
#: starts it ends its row (:func:`celery_fenced.outbox.plain_job_started`)
PLAIN_HEADER = "fenced_outbox"
VERSION = 1
#: options of the original message that are sent again with the job
OPTION_NAMES = frozenset(
    {
        "queue",
        "exchange",
        "routing_key",
        "priority",
        "root_id",
        "parent_id",
        "group_id",
        "group_index",
        "link",
        "link_error",
        "chain",
        "chord",
        "retries",
        "expires",
        "time_limit",
        "soft_time_limit",
        "headers",
        "shadow",
        "replaced_task_nesting",
    }
)


@dataclass(frozen=True)
class Job:
    """A job as recorded at acquire: enough to send it again."""

    task: str
    args: list[Any]
    kwargs: dict[str, Any]
    options: dict[str, Any] = field(default_factory=dict)


def encode_job(job: Job) -> str:
    """The JSON text of ``job`` (kombu's ``json`` serializer: dates, UUIDs, decimals)."""
    payload = {
        "v": VERSION,
        "task": job.task,
        "args": list(job.args),
        "kwargs": dict(job.kwargs),
        "options": job.options,
    }
    content_type, _, data = serialization.dumps(payload, serializer="json")
    if content_type != CONTENT_TYPE:  # pragma: no cover - kombu's registry was changed
        raise ValueError(f"the json serializer produced {content_type!r}")
    return data if isinstance(data, str) else data.decode()


def decode_job(text: str) -> Job:
    """Read a recorded job back, accepting JSON only; ``ValueError`` if it is not a job."""
    try:
        payload = serialization.loads(text, CONTENT_TYPE, "utf-8", accept={CONTENT_TYPE})
    except Exception as exc:
        raise ValueError(f"not a JSON job ({exc})") from None
    if not isinstance(payload, dict) or payload.get("v") != VERSION:
        raise ValueError("not a recorded job (unknown format)")
    task, args, kwargs, options = (payload.get(k) for k in ("task", "args", "kwargs", "options"))
    if not isinstance(task, str) or not task:
        raise ValueError(f"the task name must be a non-empty string, got {task!r}")
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        raise ValueError("args must be a list and kwargs a dict")
    if not isinstance(options, dict) or not set(options) <= OPTION_NAMES:
        raise ValueError(f"unexpected options {sorted(set(options or {}) - OPTION_NAMES)}")
    return Job(task, args, kwargs, options)


def expired(job: Job, now: dt.datetime) -> bool:
    """Whether ``job``'s ``expires`` is ``now`` or earlier (the database's time: every
    expiry decision is the database's, whatever the clocks of workers and reclaimers)."""
    value = job.options.get("expires")
    if not value:
        return False
    try:
        moment = maybe_iso8601(value)
    except (TypeError, ValueError):  # not a moment: the worker would not expire it either
        return False
    return moment is not None and maybe_make_aware(moment) <= now


def delivery_of(task_id: str, job: Job) -> Delivery:
    """The delivery a copy of ``job``'s message is (its task id, digest and retries)."""
    retries = int(job.options.get("retries") or 0)
    nesting = keys.replacements(job.options.get("replaced_task_nesting"))
    digest = keys.message_digest(task_id, job.task, job.args, job.kwargs, nesting)
    return store.Delivery(task_id, digest, retries, nesting)


def send_job(app: Celery, job: Job, task_id: str, **more: Any) -> None:
    """Send a recorded ``job`` again with its task id (``more``: options of this sending);
    recorded already, it is no new publish by task name."""
    with context.sending_decided():
        app.send_task(
            job.task,
            args=job.args,
            kwargs=job.kwargs,
            task_id=task_id,
            add_to_parent=False,
            **job.options,
            **more,
        )


# -- a publish's job (the outbox) --------------------------------------------------------
def recorded_options(
    app: Any, options: Mapping[str, Any], expires: float | dt.datetime | None
) -> dict[str, Any]:
    """The options of a publish that its recorded job keeps, to be sent again with it."""
    kept = {
        option: value
        for option, value in options.items()
        if option in OPTION_NAMES and value is not None and option != "expires"
    }
    if "headers" in kept:  # a retry carries its request's: only what JSON can carry
        kept["headers"] = _portable_headers(kept["headers"])
        if not kept["headers"]:
            del kept["headers"]
    if expires is not None:  # absolute: a later sending keeps the first one's deadline
        kept["expires"] = (
            expires
            if isinstance(expires, dt.datetime)
            else app.now() + dt.timedelta(seconds=expires)
        ).isoformat()
    return kept


def _portable_headers(headers: Any) -> dict[str, Any]:
    """The custom message headers a re-sending can carry: string keys, values kombu's
    ``json`` serializer can write (as the job's); none of a process's own
    (``_``-prefixed) attributes."""
    if not isinstance(headers, Mapping):
        return {}
    kept = {}
    for name, value in headers.items():
        if not isinstance(name, str) or name.startswith("_"):
            continue
        if keys.unchanged_by_json(value):  # written as it is (a key header's string)
            kept[name] = value
            continue
        try:
            serialization.dumps(value, serializer="json")
        except Exception:
            continue
        kept[name] = value
    return kept


def seconds(value: Any) -> float | None:
    """A countdown or expiry given in seconds, or None."""
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def moment(value: Any) -> dt.datetime | None:
    """An ETA or expiry time as an aware datetime (naive: UTC, as Celery reads it)."""
    if isinstance(value, str):
        try:
            value = dt.datetime.fromisoformat(value)
        except ValueError:
            return None
    if not isinstance(value, dt.datetime):
        return None
    return value if value.tzinfo is not None else value.replace(tzinfo=dt.timezone.utc)


def expiry(value: Any) -> float | dt.datetime | None:
    """A publish's ``expires``: a moment, or seconds from now."""
    when = moment(value)
    return seconds(value) if when is None else when
