"""What a project fences, worked out once for the system checks and the worker's start.

:func:`fenced_tasks` lists the tasks that run under a lease (``FencedTask`` subclasses and
the tasks ``fenced_tasks`` selects) with their merged options; :func:`load_project_tasks`
imports the project's task modules the way the worker does, so that ``manage.py check``
sees what the worker will see; :func:`summary` is the worker's one start-up line.
"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from celery.app import app_or_default, backends
from django.db import connections

from celery_fenced import conf, hooks, keys, store
from celery_fenced.exceptions import FencedConfigurationError
from celery_fenced.execution import FencedExecution
from celery_fenced.roles import is_fenced_backend

logger = logging.getLogger(__name__)

#: The apps the system checks look at, innermost last (:func:`checking`).
_checking: list[Any] = []


@contextlib.contextmanager
def checking(app: Any) -> Iterator[None]:
    """While the system checks run inside it, they check ``app`` (None: the current app)."""
    if app is not None:
        _checking.append(app)
    try:
        yield
    finally:
        if app is not None:
            _checking.pop()


def checked_app() -> Any:
    """The app the system checks look at: a worker's being started, else the current one."""
    if _checking:
        return _checking[-1]
    return app_or_default()


#: Brokers that redeliver an unacknowledged message after a visibility timeout, with the
#: timeout kombu uses when ``broker_transport_options`` sets none.
VISIBILITY_TIMEOUTS = {"redis": 3600.0, "rediss": 3600.0, "sentinel": 3600.0, "sqs": 1800.0}
#: Result backends that store a fenced execution's result under the token check.
FENCED_BACKENDS = ("fenced-db", "celery_fenced.backends:FencedDatabaseBackend")


@dataclass(frozen=True)
class FencedTaskInfo:
    """One fenced task: its name, the task object and its merged, validated options."""

    name: str
    task: Any
    options: conf.TaskOptions
    configured: bool  # selected by ``fenced_tasks`` (else a ``FencedTask`` subclass)

    @property
    def key(self) -> str:
        key = self.options.key
        if key is None:
            return "default key"
        if isinstance(key, str):
            return f"key {key!r}"
        return f"key {getattr(key, '__qualname__', repr(key))}()"

    @property
    def acks_late(self) -> bool:
        # a task that fenced_tasks selects gets acks_late=True at worker start
        return True if self.configured else bool(self.task.acks_late)

    @property
    def declared_acks_early(self) -> bool:
        """Whether the task itself says ``acks_late=False`` (overridden when fenced by
        ``fenced_tasks``)."""
        return hooks.declared_acks_early(self.task)

    @property
    def time_limit(self) -> float | None:
        limit = self.task.time_limit
        if limit is None:
            limit = self.task.app.conf.task_time_limit
        return float(limit) if limit else None


_loading: set[int] = set()


def load_project_tasks(app: Any) -> None:
    """Import the project's task modules and finalize ``app``, as a worker does at start.

    ``manage.py check`` does not import task modules (Celery's ``autodiscover_tasks`` is
    lazy), so without this a lease-key template error shows only when a worker starts.
    Does nothing in a worker (it has loaded them itself) or when called again. Raises
    :class:`FencedConfigurationError` from a task's definition.
    """
    loader = app.loader
    if getattr(loader, "worker_initialized", False) or getattr(app, "_fenced_loaded", False):
        return
    if id(app) in _loading:  # the Django fixup runs the checks from inside the import
        return
    _loading.add(id(app))
    try:
        loader.import_default_modules()
        app.finalize(auto=True)
        app._fenced_loaded = True
    finally:
        _loading.discard(id(app))


def fenced_tasks(app: Any) -> list[FencedTaskInfo]:
    """Every task of ``app`` that runs under a lease, with its options, sorted by name.

    Raises :class:`FencedConfigurationError` naming the task whose options do not fit
    the settings (say a global ``fenced_renew_interval`` not below its ``lease_ttl``).
    """
    settings = conf.load(app)
    found = []
    for name, task in sorted(app.tasks.items()):
        configured = settings.options_for(name)
        if isinstance(task, FencedExecution) and task._fenced_config is None:
            found.append(FencedTaskInfo(name, task, task.fenced_options(), configured=False))
        elif configured is not None:
            options = settings.options_of_entry(name, configured)
            if isinstance(options.key, str):
                keys.check_template(name, options.key, getattr(task, "run", None))
            found.append(FencedTaskInfo(name, task, options, configured=True))
    return found


def unmatched_patterns(app: Any) -> list[str]:
    """The ``fenced_tasks`` keys that select none of ``app``'s registered tasks."""
    settings = conf.load(app)
    names = list(app.tasks)
    return [
        pattern
        for pattern in settings.tasks
        if not any(
            settings.options_for(name) is not None and fnmatch.fnmatchcase(name, pattern)
            for name in names
        )
    ]


def result_backend_name(app: Any) -> str:
    """The configured result backend as the user wrote it ('' when none)."""
    backend = app.conf.result_backend
    if backend is None or backend is False:
        return ""
    if isinstance(backend, type):
        return f"{backend.__module__}:{backend.__qualname__}"
    return str(backend)


def results_fenced(app: Any) -> bool:
    """Whether ``app`` stores results with :class:`FencedDatabaseBackend` (or a subclass)."""
    name = result_backend_name(app)
    if not name:
        return False
    if name in FENCED_BACKENDS:
        return True
    try:
        found: Any = backends.by_url(name, app.loader)
        return is_fenced_backend(found[0])
    except Exception:  # not importable: Celery reports it when it loads the backend
        return False


def visibility_timeout(app: Any) -> tuple[str, float] | None:
    """``(transport, seconds)`` for a broker that redelivers after a visibility timeout."""
    url = app.conf.broker_url or ""
    if isinstance(url, list | tuple):
        url = url[0] if url else ""
    transport = str(url).split("://", 1)[0].split("+", 1)[0].lower()
    if transport not in VISIBILITY_TIMEOUTS:
        return None
    options = app.conf.broker_transport_options or {}
    seconds = options.get("visibility_timeout", VISIBILITY_TIMEOUTS[transport])
    try:
        return transport, float(seconds)
    except (TypeError, ValueError):
        return None


def lease_database() -> str:
    """The lease database's alias (:func:`celery_fenced.store.database_alias`)."""
    return store.database_alias()


def database_description() -> str:
    """The lease database: alias, vendor and name (never a password)."""
    alias = lease_database()
    connection = connections[alias]
    params = connection.settings_dict
    where = str(params.get("NAME") or "")
    host = params.get("HOST")
    if host:
        port = params.get("PORT")
        where = f"{host}{':' + str(port) if port else ''}/{where}"
    return f"{alias!r} ({connection.vendor} {where})"


def summary(app: Any) -> str:
    """One line for the worker's log: what is fenced, how results are stored, where."""
    try:
        tasks = fenced_tasks(app)
    except FencedConfigurationError as exc:
        return f"celery-fenced: {exc}"
    if tasks:
        listed = "; ".join(
            f"{info.name} ({info.key}, ttl {info.options.ttl:g}s"
            f"{'' if info.options.limit is None else f', {info.options.limit} permits'})"
            for info in tasks
        )
        what = f"{len(tasks)} fenced task{'s' if len(tasks) != 1 else ''}: {listed}"
    else:
        what = "no fenced tasks"
    backend = result_backend_name(app) or "none"
    results = (
        f"results fenced ({backend})"
        if results_fenced(app)
        else f"results NOT fenced (result backend: {backend})"
    )
    return f"celery-fenced: {what} | {results} | lease database {database_description()}"
