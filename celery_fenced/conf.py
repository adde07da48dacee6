"""Settings, read lazily from the Celery app (and so from Django settings) and validated once.

Every setting is flat: ``fenced_*`` on the Celery app, ``CELERY_FENCED_*`` in Django
settings when the app is configured with ``namespace="CELERY"``.
"""

from __future__ import annotations

import fnmatch
import operator
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, cast

from celery import current_app
from celery.app import app_or_default
from django.conf import settings as django_settings
from django.core.signals import setting_changed

from celery_fenced.exceptions import FencedConfigurationError
from celery_fenced.validators import (
    NEVER_BY_PATTERN,
    TASK_OPTION_NAMES,
    did_you_mean,
    validate_beat_key,
    validate_bool,
    validate_database,
    validate_events,
    validate_limit,
    validate_metrics_port,
    validate_on_busy,
    validate_positive_seconds,
    validate_reclaim,
    validate_reclaim_max,
    validate_renew_interval,
    validate_seconds,
    validate_unique,
)


@dataclass(frozen=True)
class TaskOptions:
    """The fencing options of one task, from its class or from ``fenced_tasks``."""

    ttl: float
    on_busy: str
    renew_interval: float
    key: Any = None  # a str.format template, a callable, or None for the default key
    # record the job at acquire so the reclaimer can send it again; None: the default
    # rule, on for the default key only (an explicit key is reclaimed by its next acquirer)
    reclaim: bool | None = None
    # record the job at publish (the outbox): sent on commit, sent again if never granted
    outbox: bool = True
    # no second copy of the job (same lease key) queued: "until_started" while one is
    # waiting, "until_done" while one is waiting or running; None: no such rule
    unique: str | None = None
    # up to this many holders of the key at once, each with a permit of its own (a
    # fencing token of the key's one sequence); None: one holder, the plain lease
    limit: int | None = None
    # the body runs in one transaction on the lease database, committed with the proof
    # of its token, its result and its release (see :mod:`celery_fenced.atomic`)
    atomic: bool = False

    def __post_init__(self) -> None:
        if self.reclaim is None:
            object.__setattr__(self, "reclaim", self.key is None)


#: the fields of :class:`FencedSettings` that are Celery's own settings, read with the
#: ``fenced_*`` ones (no ``fenced_`` setting of that name)
CELERYS_OWN = ("result_extended",)


@dataclass(frozen=True)
class FencedSettings:
    """The validated ``fenced_*`` settings (each field is the setting without ``fenced_``)."""

    tasks: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    default_ttl: float = 60.0
    renew_interval: float | None = None
    on_busy: str = "retry"
    database: str | None = None
    reclaim: bool | None = None
    reclaim_max: int = 3
    reclaim_grace: float = 1.0
    reclaim_resend_after: float = 300.0
    #: seconds a completed task id counts as a duplicate of itself
    duplicate_window: float = 86400.0
    #: "anomalies": only what an operator must see (takeovers, losses, refusals, ...);
    #: "all": an event for every grant and release too
    events: str = "anomalies"
    #: a worker grants and stores successes on PostgreSQL over a connection of its own,
    #: kept open between tasks (:mod:`celery_fenced.store.owned`); False: Django's
    keep_connection: bool = True
    #: that kept connection prepares its statements on the server; False: plain queries
    prepare: bool = True
    #: record fenced jobs at publish and send them on commit (the outbox)
    outbox: bool = True
    #: seconds past its ETA (or its last sending) before a pending job is sent again
    outbox_resend_after: float = 300.0
    #: permits per key of tasks that set no ``lease_limit`` (None: one holder)
    default_limit: int | None = None
    #: bodies of tasks without ``lease_atomic`` run in one transaction (see ``atomic``)
    atomic: bool = False
    #: a worker serves its Prometheus metrics on this port (None: it does not)
    metrics_port: int | None = None
    #: the lease a fenced beat's leader holds (None: ``"celery-beat:<app main name>"``)
    beat_key: str | None = None
    #: seconds the beat leader's lease lasts unrenewed: a standby takes over within it
    beat_ttl: float = 30.0
    #: Celery's own ``result_extended`` (not a ``fenced_*`` setting), read with them: the
    #: fenced backend's result rows keep the task's arguments, name and worker
    result_extended: bool = False

    @property
    def routine_events(self) -> bool:
        """Whether every grant and release is recorded as an event (``"all"``)."""
        return self.events == "all"

    def options_for(self, task_name: str) -> dict[str, Any] | None:
        """The ``fenced_tasks`` options that select ``task_name``, or None.

        An exact name wins over glob patterns; among patterns the longest wins. Patterns
        never select Celery's built-in tasks (``celery.*``) or this package's own
        (``celery_fenced.*``): ``"*"`` means all of *your* tasks.
        """
        if task_name in self.tasks:
            return dict(self.tasks[task_name])
        if task_name.startswith(NEVER_BY_PATTERN):
            return None
        matches = [p for p in self.tasks if fnmatch.fnmatchcase(task_name, p)]
        if not matches:
            return None
        return dict(self.tasks[max(matches, key=len)])

    def configured_options(self, task_name: str) -> TaskOptions | None:
        """The validated options ``fenced_tasks`` gives ``task_name`` (merged over the
        global settings), or None when it does not select it. The name alone decides:
        a process that publishes the task by name need not import it."""
        config = self.options_for(task_name)
        if config is None:
            return None
        return self.options_of_entry(task_name, config)

    def options_of_entry(self, task_name: str, config: Mapping[str, Any]) -> TaskOptions:
        """The options of ``task_name`` from its ``fenced_tasks`` entry ``config``,
        merged over the global settings and validated."""
        return self.task_options(
            f"fenced_tasks option of task {task_name!r}",
            **{name: config.get(name) for name in TASK_OPTION_NAMES},
        )

    def task_options(
        self,
        where: str,
        *,
        ttl: object = None,
        on_busy: object = None,
        renew_interval: object = None,
        key: object = None,
        reclaim: object = None,
        outbox: object = None,
        unique: object = None,
        limit: object = None,
        atomic: object = None,
    ) -> TaskOptions:
        """Merge one task's options over the global defaults and validate them."""
        real_ttl = validate_positive_seconds(
            self.default_ttl if ttl is None else ttl, f"{where} ttl"
        )
        busy = validate_on_busy(self.on_busy if on_busy is None else on_busy, f"{where} on_busy")
        raw_interval = renew_interval if renew_interval is not None else self.renew_interval
        if raw_interval is None:
            interval = real_ttl / 3
        else:
            interval = validate_renew_interval(raw_interval, real_ttl, f"{where} renew interval")
        if key is not None and not (isinstance(key, str) or callable(key)):
            raise FencedConfigurationError(
                f"{where} key must be a str.format template or a callable "
                f"(args, kwargs) -> str, got {key!r}"
            )
        if isinstance(key, str) and not key.strip():
            raise FencedConfigurationError(f"{where} key must not be empty")
        # the task's own choice, else fenced_reclaim, else the default rule
        chosen = validate_reclaim(reclaim, f"{where} reclaim")
        if chosen is None:
            chosen = self.reclaim
        recorded = self.outbox if outbox is None else validate_bool(outbox, f"{where} outbox")
        one_copy = validate_unique(unique, f"{where} unique")
        if one_copy is not None and not recorded:
            raise FencedConfigurationError(
                f"{where} unique={one_copy!r} needs the outbox (it is decided by the job's "
                "row in the lease database at publish): set fenced_outbox and the task's "
                "outbox option to True, or unique to None"
            )
        permits = validate_limit(limit, f"{where} limit")
        if permits is None:
            permits = self.default_limit
        if permits is not None and one_copy == "until_done":
            raise FencedConfigurationError(
                f"{where} unique='until_done' keeps one copy queued or running: it cannot "
                f"have permits too (limit={permits}); use unique='until_started', or no limit"
            )
        whole = self.atomic if atomic is None else validate_bool(atomic, f"{where} atomic")
        return TaskOptions(
            ttl=real_ttl,
            on_busy=busy,
            renew_interval=interval,
            key=key,
            reclaim=chosen,
            outbox=recorded,
            unique=one_copy,
            limit=permits,
            atomic=whole,
        )


def _defaults() -> dict[str, Any]:
    """Each setting's name (``fenced_`` + the field) and default, read off FencedSettings."""
    values: dict[str, Any] = {}
    for setting in fields(FencedSettings):
        if setting.name in CELERYS_OWN:
            continue
        if setting.default is not MISSING:
            values[f"fenced_{setting.name}"] = setting.default
        else:
            values[f"fenced_{setting.name}"] = cast(Callable[[], Any], setting.default_factory)()
    return values


#: the settings and their defaults (``fenced_*`` on the Celery app)
DEFAULTS: dict[str, Any] = _defaults()


def _raw_settings(app: Any = None) -> dict[str, Any]:
    values = dict(DEFAULTS)
    conf = None
    if app is None:
        app = current_app
    conf = app.conf
    for name in DEFAULTS:
        value = conf.get(name)
        if value is None:
            value = _django_setting(name)
        if value is not None:
            values[name] = value
    return values


def _django_setting(name: str) -> Any:
    if not django_settings.configured:
        return None
    return getattr(django_settings, f"CELERY_{name.upper()}", None)


def load(app: Any = None) -> FencedSettings:
    """The validated ``fenced_*`` settings of ``app`` (default: the current app).

    Read and validated once, then kept on the app until its settings change: a change
    through ``app.conf`` (``update``, attribute or item assignment), a new configuration
    (``config_from_object``) or a change of Django settings through ``override_settings``
    (or pytest-django's ``settings``, or anything that sends ``setting_changed``) is seen
    by the next call. Invalid settings are never kept: every call raises until fixed.
    """
    if app is None:
        app = app_or_default()  # the app itself: each access through the proxy costs
    kept = getattr(app, _CACHE_ATTRIBUTE, None)
    if kept is not None:
        stamp = _stamp(app)
        if stamp is not None and kept[0] == stamp[0] and _all_same(kept[1], stamp[1]):
            return kept[2]  # type: ignore[no-any-return]
    settings = _load(app)
    stamp = _stamp(app)  # after reading: the first read finalizes a pending configuration
    if stamp is not None:
        setattr(app, _CACHE_ATTRIBUTE, (*stamp, settings))
    return settings


#: Where :func:`load` keeps an app's validated settings, with the stamp they were read at.
_CACHE_ATTRIBUTE = "_celery_fenced_settings"
#: The names a setting can have among ``app.conf``'s own changes (with and without the
#: Django namespace).
_CHANGE_KEYS = (
    *DEFAULTS,
    *(f"CELERY_{name.upper()}" for name in DEFAULTS),
    *CELERYS_OWN,
    *(f"CELERY_{name.upper()}" for name in CELERYS_OWN),
)
_CHANGE_KEY_SET = frozenset(_CHANGE_KEYS)
#: Bumped whenever Django announces a settings change.
_generation = 0


def _stamp(app: Any) -> tuple[tuple[int, int], tuple[Any, ...]] | None:
    """What the settings were read from: counters, and objects compared by identity.

    ``app.conf``, its maps (Celery can swap a configuration in place) and its own changes
    of the ``fenced_*`` names; Django's settings holder and the count of its announced
    changes (``setting_changed``).
    None when the app's configuration is not a Celery ``Settings`` (yet): then nothing
    is kept.
    """
    conf = app.conf
    changes = getattr(conf, "changes", None)
    if not isinstance(changes, dict):
        return None
    maps = conf.maps
    # most apps change none of these names at run time: then only that is compared
    # (the stamp's length tells the two cases apart)
    changed = () if _CHANGE_KEY_SET.isdisjoint(changes) else map(changes.get, _CHANGE_KEYS)
    return (_generation, len(maps)), (_django_holder(), conf, *maps, *changed)


def _django_holder() -> object:
    """The object that holds Django's settings now, compared by identity.

    ``override_settings`` replaces it on every change, and announces each changed name
    with ``setting_changed`` (counted in ``_generation``), but a deletion through
    pytest-django's ``settings`` fixture announces nothing. Django has no public way to
    see that; the alternative, reading the ten ``CELERY_FENCED_*`` names on every call,
    measured 16 times slower (42 µs against 2.5 µs a call) on the path of every task.
    """
    return django_settings._wrapped  # type: ignore[misc]


def _all_same(kept: tuple[Any, ...], now: tuple[Any, ...]) -> bool:
    """Every value the very same object (contents are not compared: identity is cheap)."""
    return len(kept) == len(now) and all(map(operator.is_, kept, now))


def _settings_changed(**kwargs: Any) -> None:
    global _generation
    _generation += 1


setting_changed.connect(_settings_changed, dispatch_uid="celery_fenced.conf.settings_changed")


def _load(app: Any) -> FencedSettings:
    """Read and validate the ``fenced_*`` settings of ``app``."""
    raw = _raw_settings(app)
    tasks = raw["fenced_tasks"]
    if not isinstance(tasks, Mapping):
        raise FencedConfigurationError(
            "fenced_tasks (CELERY_FENCED_TASKS) must be a dict mapping task names or glob "
            f"patterns to option dicts, got {type(tasks).__name__}"
        )
    default_ttl = validate_positive_seconds(raw["fenced_default_ttl"], "fenced_default_ttl")
    interval = raw["fenced_renew_interval"]
    if interval is not None:
        interval = validate_renew_interval(interval, default_ttl, "fenced_renew_interval")
    on_busy = validate_on_busy(raw["fenced_on_busy"], "fenced_on_busy")
    database = raw["fenced_database"]
    if database is not None:
        validate_database(database)
    settings = FencedSettings(
        tasks=tasks,
        default_ttl=default_ttl,
        renew_interval=interval,
        on_busy=on_busy,
        database=database,
        reclaim=validate_reclaim(raw["fenced_reclaim"], "fenced_reclaim"),
        reclaim_max=validate_reclaim_max(raw["fenced_reclaim_max"], "fenced_reclaim_max"),
        reclaim_grace=validate_seconds(raw["fenced_reclaim_grace"], "fenced_reclaim_grace"),
        reclaim_resend_after=validate_positive_seconds(
            raw["fenced_reclaim_resend_after"], "fenced_reclaim_resend_after"
        ),
        duplicate_window=validate_positive_seconds(
            raw["fenced_duplicate_window"], "fenced_duplicate_window"
        ),
        events=validate_events(raw["fenced_events"], "fenced_events"),
        keep_connection=validate_bool(raw["fenced_keep_connection"], "fenced_keep_connection"),
        prepare=validate_bool(raw["fenced_prepare"], "fenced_prepare"),
        outbox=validate_bool(raw["fenced_outbox"], "fenced_outbox"),
        outbox_resend_after=validate_positive_seconds(
            raw["fenced_outbox_resend_after"], "fenced_outbox_resend_after"
        ),
        default_limit=validate_limit(raw["fenced_default_limit"], "fenced_default_limit"),
        metrics_port=validate_metrics_port(raw["fenced_metrics_port"], "fenced_metrics_port"),
        beat_key=validate_beat_key(raw["fenced_beat_key"], "fenced_beat_key"),
        beat_ttl=validate_positive_seconds(raw["fenced_beat_ttl"], "fenced_beat_ttl"),
        atomic=validate_bool(raw["fenced_atomic"], "fenced_atomic"),
        result_extended=bool(app.conf.find_value_for_key("extended", "result")),
    )
    for pattern, options in tasks.items():
        where = f"fenced_tasks[{pattern!r}]"
        if not isinstance(pattern, str) or not pattern:
            raise FencedConfigurationError(
                f"fenced_tasks keys must be task names or glob patterns, got {pattern!r}"
            )
        if not isinstance(options, Mapping):
            raise FencedConfigurationError(
                f"{where} must be a dict of options ({', '.join(TASK_OPTION_NAMES)}), "
                f"got {options!r}"
            )
        unknown = set(options) - set(TASK_OPTION_NAMES)
        if unknown:
            raise FencedConfigurationError(
                f"{where} has unknown option(s) {', '.join(sorted(map(repr, unknown)))}"
                f"{did_you_mean(unknown, TASK_OPTION_NAMES)}; "
                f"allowed: {', '.join(TASK_OPTION_NAMES)}"
            )
        settings.task_options(
            where,
            ttl=options.get("ttl"),
            on_busy=options.get("on_busy"),
            renew_interval=options.get("renew_interval"),
            key=options.get("key"),
            reclaim=options.get("reclaim"),
            outbox=options.get("outbox"),
            unique=options.get("unique"),
            limit=options.get("limit"),
            atomic=options.get("atomic"),
        )
    return settings
